"""`kvcli chat`'s entry point: load the engine, print the banner, hand over to the REPL."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from kvcli.commands.chat.repl import ChatRepl, isatty
from kvcli.commands.chat.session import ChatArgs
from kvcli.commands.common import Fail, build_engine
from kvcli.model.loader import first_line
from kvcli.model.tokenizer import chat_template_error


def _sinks_cover_the_system_prompt(a: ChatArgs, fail: Fail) -> ChatArgs:
    """A bounded cache keeps the system prompt (the template's own where none is given) among its sinks:
    --sink-tokens grows to cover it."""
    from dataclasses import replace

    from kvcli.commands.chat.session import Conversation
    from kvcli.model.loader import load_tokenizer
    from kvcli.options import ConfigError

    try:
        tok = load_tokenizer(a.model)
    except Exception:  # the model load below reports a bad --model in one line
        return a
    n = Conversation(a.system, tok.apply_chat_template).system_tokens()
    if n <= a.options.sink_tokens:
        return a
    try:
        return replace(a, options=replace(a.options, sink_tokens=n))
    except ConfigError as e:
        fail(str(e))


def run_chat(a: ChatArgs, fail: Fail) -> int:
    interactive = isatty(sys.stdin)
    try:  # bytes that are not UTF-8 stay visible as surrogates: the REPL refuses such a line (unreadable_input)
        sys.stdin.reconfigure(errors="surrogateescape")
    except (AttributeError, ValueError, OSError):
        pass
    err = Console(stderr=True, highlight=False)

    if a.options.kv_window is not None:
        a = _sinks_cover_the_system_prompt(a, fail)
    try:
        with err.status("loading model…", spinner="dots"):
            engine = build_engine(a.model, a.quant, a.options, fail)
    except KeyboardInterrupt:
        err.print()
        return 130
    if engine.tokenizer is None:
        fail("this model has no tokenizer, so it cannot chat")
    broken = chat_template_error(engine.tokenizer)
    if broken is not None:
        fail(f"this model's chat template cannot render a user message ({type(broken).__name__}: "
             f"{first_line(broken)})")
    if a.params.max_tokens >= engine.max_model_len:
        fail(f"--max-tokens {a.params.max_tokens} leaves no room for the conversation in the "
             f"{engine.max_model_len:,}-token context (lower --max-tokens or raise --max-model-len)")

    err.print(f"[dim]{escape(Path(str(engine.source)).name)} · {engine.config.num_layers} layers · weights "
              f"{engine.linear_mode} · KV {engine.kv_dtype} on {engine.device} · loaded in "
              f"{engine.load_seconds:.1f} s[/dim]", soft_wrap=True)
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        live = " · live dashboard on (/live toggles)" if a.live else ""
        err.print(f"[dim]chat · {engine.max_model_len:,}-token context · up to {a.params.max_tokens} tokens per "
                  f"reply · /help for commands · Ctrl-C stops a reply · Ctrl-D or /quit exits{live}[/dim]",
                  soft_wrap=True)
    repl = ChatRepl(engine, a, err, interactive)
    try:
        return repl.loop()
    except KeyboardInterrupt:  # e.g. Ctrl-C while /stats renders
        err.print()
        repl.goodbye()
        return 130
    except BrokenPipeError:  # `kvcli chat | head`: the reader left; stop quietly
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush cannot fail
        except (OSError, ValueError):
            pass
        return 141
    finally:
        repl.close()
