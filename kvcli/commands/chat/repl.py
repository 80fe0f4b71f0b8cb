"""The chat REPL: reading lines, slash commands, running a turn through the engine with Ctrl-C
handling, and everything printed.

Streams: replies go to stdout, everything else (banner, status lines, notices, /stats, /blocks, the
dashboard) to stderr. In a terminal a message is a line, or the lines of a paste: lines already waiting
when one is entered came with it (a terminal without bracketed paste sends a pasted newline as Enter),
and a pasted last line without its newline stays in the editor until Enter. With stdin not a terminal
each input line is one user message (or slash command), every message gets its reply followed by a
newline (an empty line when it could not be sent), and the exit code at EOF is 0, so
`printf 'Hi\\n' | kvcli chat` scripts.

Ctrl-C while a reply streams stops that reply only: the request is aborted between engine steps
(never inside one), the partial reply, as shown, stays in the conversation marked as interrupted, or
the turn is dropped when nothing had been shown yet. Ctrl-C at the prompt only reminds of /quit and
Ctrl-D. In a pipeline (stdin not a terminal) Ctrl-C stops the reply and then the session, with the
summary and exit code 130.
"""

from __future__ import annotations

import json
import select
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from kvcli.commands.chat.live import ReplyView
from kvcli.commands.chat.session import ChatArgs, Conversation, TurnRecord, turn_record
from kvcli.engine.scheduler import KVBudgetTooSmall
from kvcli.metrics.memory import MemoryProbe
from kvcli.model.tokenizer import NO_CHAT_TEMPLATE, has_chat_template
from kvcli.options import ConfigError
from kvcli.view.block_map import render_block_map
from kvcli.view.summary import summary_table

PROMPT = "you> "
HELP = (
    ("/stats", "engine summary: tokens, prefill/decode speed, KV blocks and bytes, weights"),
    ("/blocks", "the KV block map"),
    ("/live", "toggle the full dashboard (memory, KV blocks, fragmentation, throughput) while a reply streams"),
    ("/reset", "clear the conversation (the system prompt stays)"),
    ("/save FILE", "write the transcript as JSON (system prompt, messages, per-turn token counts)"),
    ("/help", "this list"),
    ("/quit", "exit with a summary (also Ctrl-D)"),
)


def unreadable_input(line: str) -> str | None:
    """Why an input line cannot be a message, or None: bytes that are not UTF-8 (read as surrogates, stdin's
    errors="surrogateescape") or a NUL byte, which `continue` and `perplexity` refuse in a file as well."""
    bad = next((i for i, ch in enumerate(line) if "\udc80" <= ch <= "\udcff"), None)
    if bad is not None:
        return f"not valid UTF-8 (byte {ord(line[bad]) - 0xDC00:#04x} at character {bad})"
    if "\x00" in line:
        return "a NUL byte in the line, expected text"
    return None


@contextmanager
def keys_unechoed(active: bool):
    """While a reply streams, keys typed ahead are not echoed into it: the terminal keeps them (echo off, the
    line discipline otherwise as it was: Ctrl-C still signals) and the next prompt's line editor shows them."""
    try:
        import termios
    except ImportError:  # not a POSIX terminal
        active = False
    fd, old = None, None
    if active:
        try:
            fd = sys.stdin.fileno()
            old = termios.tcgetattr(fd)
            new = list(old)
            new[3] &= ~termios.ECHO  # lflag
            termios.tcsetattr(fd, termios.TCSANOW, new)  # TCSANOW: what was typed stays
        except (termios.error, OSError, ValueError):
            old = None
    try:
        yield
    finally:
        if old is not None:
            try:
                termios.tcsetattr(fd, termios.TCSANOW, old)
            except (termios.error, OSError):
                pass


class SigintLatch:
    """Turns Ctrl-C into a flag for the duration of a reply, so the engine is never interrupted in
    the middle of a step (which could leave a request half-updated)."""

    def __init__(self) -> None:
        self.hit = False
        self._prev = None
        self._installed = False

    def _on_sigint(self, signum, frame) -> None:  # noqa: ARG002
        self.hit = True

    def __enter__(self) -> "SigintLatch":
        try:
            self._prev = signal.signal(signal.SIGINT, self._on_sigint)
            self._installed = True
        except (ValueError, OSError):  # not the main thread: KeyboardInterrupt is caught instead
            self._installed = False
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._prev if self._prev is not None else signal.default_int_handler)


def isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def ranges(ids: list[int]) -> str:
    """[0, 1, 2, 7, 8] -> '0-2, 7-8'."""
    out: list[str] = []
    start = prev = None
    for b in ids:
        if start is None:
            start = prev = b
        elif b == prev + 1:
            prev = b
        else:
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = b
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ", ".join(out)


def input_waiting(seconds: float = 0.02) -> bool:
    """Whether more typed input is already waiting on stdin: within 20 ms of an Enter that is a paste (or
    text sent with it), never a person typing the next line."""
    try:
        return bool(select.select([sys.stdin], [], [], seconds)[0])
    except (OSError, ValueError):
        return False


class ChatRepl:
    def __init__(self, engine, a: ChatArgs, err: Console, interactive: bool) -> None:
        self.engine = engine
        self.a = a
        self.err = err
        self.interactive = interactive
        self.live = a.live
        self.convo = Conversation(a.system, engine.tokenizer.apply_chat_template)
        self.last_turn: tuple[str, list[int], int] | None = None  # req id, block table, tokens
        self.probe: MemoryProbe | None = None  # opened the first time the dashboard shows

    # --- small output helpers -------------------------------------------------------------------------
    def note(self, text: str, style: str = "yellow") -> None:
        """One line on stderr (soft-wrapped: never split by rich)."""
        self.err.print(text, style=style, soft_wrap=True, markup=False, highlight=False)

    def close(self) -> None:
        if self.probe is not None:
            self.probe.close()
            self.probe = None

    # --- reading input --------------------------------------------------------------------------------
    def read(self) -> str | None:
        """One message, or None at EOF: a line, or in a terminal the lines of a paste. KeyboardInterrupt
        propagates."""
        if not self.interactive:
            line = sys.stdin.readline()
            return None if line == "" else line.rstrip("\r\n")
        try:
            if isatty(sys.stdout):
                line = input(self._prompt_text())
            else:
                self.err.print(PROMPT, end="", markup=False, highlight=False)  # keep a redirected stdout clean
                line = input()
        except EOFError:
            return None
        while input_waiting():  # a paste's next lines, already there when its first was entered
            try:
                line += "\n" + input()
            except EOFError:
                break
        return line

    def _prompt_text(self) -> str:
        if "readline" in sys.modules and self.err.is_terminal and not self.err.no_color:
            # \001..\002 tell readline the color codes take no columns.
            return "\001\033[1;36m\002" + PROMPT.rstrip() + "\001\033[0m\002 "
        return PROMPT

    # --- the loop -------------------------------------------------------------------------------------
    def loop(self) -> int:
        if not has_chat_template(self.engine.tokenizer):
            self.note(NO_CHAT_TEMPLATE.format(what="turns"), style="dim")
        if self.convo.system_notice:
            self.note(self.convo.system_notice, style="dim")
        while True:
            try:
                line = self.read()
            except KeyboardInterrupt:
                self.err.print()
                if not self.interactive:
                    self.goodbye()
                    return 130
                self.note("(use /quit or Ctrl-D to exit)", style="dim")
                continue
            if line is None:
                if self.interactive:
                    self.err.print()
                break
            text = line.strip()
            if not text:
                continue
            problem = unreadable_input(text)
            if problem:
                self.note(f"{problem}: not sent (the conversation is unchanged)")
                continue
            if text.startswith("/") and not text.startswith("//") and "\n" not in text:
                if not self.command(text):
                    break
                continue
            if text.startswith("//"):  # a message that starts with a slash
                text = text[1:]
            if self.turn(text) and not self.interactive:
                # Ctrl-C in a pipeline means stop the script, not just this reply.
                self.goodbye()
                return 130
        self.goodbye()
        return 0

    # --- slash commands -------------------------------------------------------------------------------
    def command(self, line: str) -> bool:
        """Runs a slash command; False means quit."""
        name, _, rest = line.partition(" ")
        name = name.lower()
        rest = rest.strip()
        if name in ("/quit", "/exit", "/q"):
            return False
        if name in ("/help", "/?"):
            for cmd, what in HELP:
                self.err.print(f"  [bold]{escape(cmd):<11}[/bold] {escape(what)}", highlight=False)
            self.err.print("  [dim]a line starting with // sends a message that starts with /; a pasted block of "
                           "lines is one message; Ctrl-C stops a reply; Ctrl-D quits[/dim]", highlight=False)
        elif name == "/stats":
            self.stats()
        elif name == "/blocks":
            self.blocks()
        elif name == "/live":
            self.live = not self.live
            where = "" if self.err.is_terminal else " (shown only when stderr is a terminal)"
            self.note(f"live dashboard {'on' if self.live else 'off'}{where}", style="dim")
        elif name == "/reset":
            n = self.convo.reset()
            self.note(f"conversation cleared ({n} turn{'s' if n != 1 else ''}; the system prompt stays)", style="dim")
        elif name == "/save":
            if not rest:
                self.note("usage: /save FILE")
            else:
                self.save(Path(rest).expanduser())
        else:
            self.note(f"unknown command {name} (/help lists the commands; start with // to send a "
                      f"message beginning with /)")
        return True

    def stats(self) -> None:
        e, c = self.engine, self.convo
        snap = e.snapshot()
        self.err.print(summary_table(snap, title="kvcli chat"))
        n = len(c.turns)
        line = (f"conversation: {n} turn{'s' if n != 1 else ''} holding {c.context_tokens():,} tokens of the "
                f"{e.max_model_len:,}-token context (the next prompt, before your message)")
        if c.dropped_turns:
            line += f" ({c.dropped_turns} oldest turns dropped)"
        line += f" · prefix-cache hits {snap.prefix_hit_tokens:,} tokens"
        self.note(line, style="dim")

    def blocks(self) -> None:
        snap = self.engine.snapshot(block_map=True)
        if snap.blocks is None:
            self.note(f"no block map ({snap.layout} layout)", style="dim")
        else:
            self.err.print(render_block_map(snap.blocks, width=max(16, min(96, self.err.width - 2)), height=16))
            self.err.print()  # the map's legend ends without a newline
        if self.last_turn is not None:
            rid, table, tokens = self.last_turn
            held = snap.blocks is not None and rid in snap.blocks.owners
            where = "still held" if held else "blocks freed when the reply ended; a prefix cache may keep them " \
                                              "as cached-free"
            self.note(f"last turn ({rid}): {tokens:,} tokens in {len(table):,} blocks [{ranges(table)}] · {where}",
                      style="dim")

    def save(self, path: Path) -> None:
        e, c = self.engine, self.convo
        data = c.transcript(str(e.source), self.a.params, e.max_model_len, self.a.truncate)
        try:
            path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        except OSError as ex:
            self.note(f"cannot write {path}: {ex.strerror or ex}", style="red")
            return
        n = len(c.turns)
        self.note(f"saved {n} turn{'s' if n != 1 else ''} to {path}", style="dim")

    # --- a turn -----------------------------------------------------------------------------------------
    def _not_sent(self) -> None:
        if not self.interactive:
            sys.stdout.write("\n")  # keep one reply (here empty) per message for scripts
            sys.stdout.flush()

    def _view(self) -> ReplyView:
        if self.live and self.err.is_terminal and self.probe is None:
            self.probe = MemoryProbe(str(self.engine.device))
        return ReplyView(self.engine, self.err, self.probe if self.live and self.err.is_terminal else None)

    def turn(self, text: str) -> bool:
        """One exchange; True when Ctrl-C stopped it."""
        e, a = self.engine, self.a
        user = {"role": "user", "content": text}
        fit = self.convo.fit(user, e.max_model_len, a.params.max_tokens, a.truncate, e.retention is not None)
        if fit.notice:
            self.note(fit.notice, style="red" if fit.error else "yellow")
        if fit.ids is None:
            self._not_sent()
            return False
        ids = fit.ids
        seed = None if a.params.seed is None else a.params.seed + self.convo.total_turns
        before = e.snapshot()

        view = self._view()
        spinner = None
        started = False
        shown: list[str] = []
        failed: str | None = None
        table: list[int] = []
        t0 = time.perf_counter()
        req = None
        # The latch covers the request from before it exists to after it is finished or aborted, so
        # no Ctrl-C can leave a request behind in the engine.
        with SigintLatch() as latch:
            try:
                try:
                    # Past the window each turn rebuilds only the sinks (the system prompt) and the window.
                    req = e.add_request(ids, a.params.with_(seed=seed), skip_to_window=e.retention is not None)
                except (ConfigError, KVBudgetTooSmall) as ex:
                    self.note(f"cannot run this turn: {ex}", style="red")
                    self._not_sent()
                    return False
                rid = req.req_id
                if self.interactive and self.err.is_terminal and view.dash is None:
                    spinner = self.err.status("[dim]thinking…[/dim]", spinner="dots")
                    spinner.start()
                with view, keys_unechoed(self.interactive and isatty(sys.stdin)):
                    while not req.finished and not latch.hit:
                        outs = e.step()
                        if not req.finished:
                            table = e.kv.held_blocks(rid)  # every KV group's (Gemma: its windowed layers' too)
                        view.update()
                        for o in outs:
                            if o.req_id != rid or not o.new_text or latch.hit:
                                continue  # after Ctrl-C nothing more is shown (nor kept)
                            piece = o.new_text if started else o.new_text.lstrip()
                            if not piece:
                                continue
                            if not started:
                                started = True
                                if spinner is not None:
                                    spinner.stop()
                                    spinner = None
                            view.write(piece)
                            shown.append(piece)
            except KeyboardInterrupt:  # only when the latch could not be installed
                latch.hit = True
            except KVBudgetTooSmall as ex:
                failed = str(ex)
            finally:
                if spinner is not None:
                    spinner.stop()
                if req is not None and not req.finished:
                    e.abort(req.req_id)
            interrupted = latch.hit and req.finish_reason == "abort"
        wall = time.perf_counter() - t0
        view.finish()
        if not interrupted and not failed:
            # Ctrl-C during the step that finished the reply anyway: show the rest, so the screen
            # matches what the conversation keeps.
            rest = e.output_text(req.req_id).lstrip()[len("".join(shown)):]
            if rest:
                view.write(rest)
                shown.append(rest)
                started = True
        if started or not self.interactive:
            sys.stdout.write("\n")
            sys.stdout.flush()

        if failed:
            self.note(f"cannot run this turn: {failed}", style="red")
            return False
        # An interrupted reply keeps what was on the screen; a finished one the model's exact text.
        reply = "".join(shown) if interrupted else e.output_text(req.req_id)
        if interrupted and not reply.strip():
            self.note("interrupted before the reply started; the message was not kept", style="yellow")
            return True

        after = e.snapshot()
        # The request's blocks grow monotonically; its table is gone once it finished, and the
        # last step's token never enters the cache, so the last table seen is the peak.
        kv_blocks = max(len(table), -(-(req.num_computed_tokens - e.scheduler.dropped_tokens(req)) // after.block_size))
        self.last_turn = (rid, table, req.num_computed_tokens)
        rec = turn_record(text, reply, ids, req, before, after, interrupted=interrupted, seconds=wall,
                          kv_blocks=kv_blocks, dropped_tokens=e.scheduler.dropped_tokens(req))
        self.convo.add(user, rec)
        self.status_line(rec, after.num_blocks)
        return interrupted

    def status_line(self, t: TurnRecord, num_blocks: int) -> None:
        parts = [f"{t.prompt_tokens:,} prompt tokens", f"{t.generated_tokens:,} generated",
                 f"{t.decode_tok_s:,.1f} tok/s decode"]
        if t.ttft_s is not None:
            parts.append(f"first token {t.ttft_s:.2f} s")
        parts.append(f"prefix hit {t.prefix_hit_tokens:,} tokens")
        parts.append(f"prefill saved {t.prefill_tokens_saved:,} tokens")
        parts.append(f"KV {t.kv_blocks:,} of {num_blocks:,} blocks")
        if t.dropped_tokens:
            r = self.engine.retention
            parts.append(f"{t.dropped_tokens:,} tokens dropped (kept {r.sink_slots:,} sink + the last {r.window:,}; "
                         f"--kv-window)")
        head = "[interrupted] " if t.interrupted else ("[length] " if t.finish_reason == "length" else "")
        self.note(head + " · ".join(parts), style="yellow" if t.interrupted else "dim")

    def goodbye(self) -> None:
        c = self.convo
        title = (f"kvcli chat: {c.total_turns} turn{'s' if c.total_turns != 1 else ''}, "
                 f"{c.total_prompt:,} prompt tokens submitted, prefix-cache hits {c.total_hits:,} tokens")
        self.err.print(summary_table(self.engine.snapshot(), title=title))
