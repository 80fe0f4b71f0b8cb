"""`kvcli chat`: a multi-turn REPL over the model's chat template, replies streamed through the paged
KV cache.

Every turn submits the whole conversation (rendered by the chat template) as a new request, so a
prefix cache in the KV manager can reuse the earlier turns' blocks; the status line after a turn says
how many prompt tokens were hits when the engine reports it.

Streams: replies go to stdout, everything else (banner, status lines, notices, /stats, /blocks) to
stderr. With stdin not a terminal each input line is one user message (or slash command), every
message gets its reply followed by a newline (an empty line when it could not be sent), and the exit
code at EOF is 0, so `printf 'Hi\\n' | kvcli chat` scripts.

Ctrl-C while a reply streams stops that reply only: the request is aborted between engine steps
(never inside one), the partial reply, as shown, stays in the conversation marked as interrupted (as
chat UIs keep a stopped answer), or the turn is dropped when nothing had been shown yet. Ctrl-C at
the prompt only reminds of /quit and Ctrl-D. In a pipeline (stdin not a terminal) Ctrl-C stops the
reply and then the session, with the summary and exit code 130.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from kvcli.commands.common import Fail, build_engine
from kvcli.config import SamplingParams
from kvcli.options import ConfigError, EngineOptions
from kvcli.engine.scheduler import KVBudgetTooSmall
from kvcli.view.summary import summary_table

PROMPT = "you> "
HELP = (
    ("/stats", "engine summary: tokens, prefill/decode speed, KV blocks and bytes, weights"),
    ("/blocks", "the KV block map"),
    ("/reset", "clear the conversation (the system prompt stays)"),
    ("/save FILE", "write the transcript as JSON (system prompt, messages, per-turn token counts)"),
    ("/help", "this list"),
    ("/quit", "exit with a summary (also Ctrl-D)"),
)


@dataclass(frozen=True)
class ChatArgs:
    system: str | None
    params: SamplingParams  # per reply; turn i samples with seed + i
    truncate: bool
    model: str | None
    quant: str
    options: EngineOptions


@dataclass
class TurnRecord:
    user: str
    reply: str
    prompt_tokens: int
    generated_tokens: int
    finish_reason: str | None
    interrupted: bool
    seconds: float
    ttft_s: float | None
    decode_tok_s: float
    kv_blocks: int
    prefix_hit_tokens: int | None = None
    prefill_tokens_saved: int | None = None


class _SigintLatch:
    """Turns Ctrl-C into a flag for the duration of a reply, so the engine is never interrupted in
    the middle of a step (which could leave a request half-updated)."""

    def __init__(self) -> None:
        self.hit = False
        self._prev = None
        self._installed = False

    def _on_sigint(self, signum, frame) -> None:  # noqa: ARG002
        self.hit = True

    def __enter__(self) -> "_SigintLatch":
        try:
            self._prev = signal.signal(signal.SIGINT, self._on_sigint)
            self._installed = True
        except (ValueError, OSError):  # not the main thread: KeyboardInterrupt is caught instead
            self._installed = False
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._prev if self._prev is not None else signal.default_int_handler)


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


# --- defensive reads of engine state (the cache layer is evolving; never crash on a missing field) --
def _used_blocks(engine) -> int:
    kv = engine.kv
    try:
        return int(kv.num_blocks - kv.num_free_blocks)
    except AttributeError:
        pass
    pool = getattr(engine, "pool", None)
    try:
        return int(pool.num_used)
    except AttributeError:
        return 0


def _total_blocks(engine) -> int:
    for obj, name in ((engine, "num_blocks"), (engine.kv, "num_blocks"), (getattr(engine, "pool", None), "num_blocks")):
        v = getattr(obj, name, None)
        if isinstance(v, int):
            return v
    return 0


def _prefix_hits_total(engine) -> int | None:
    """Cumulative prefix-cache hit tokens, if the engine reports them anywhere."""
    try:
        snap = engine.snapshot()
    except Exception:
        snap = None
    for obj in (snap, engine, getattr(engine, "kv", None), getattr(engine, "metrics", None)):
        v = getattr(obj, "prefix_hit_tokens", None) if obj is not None else None
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def _request_hits(req) -> int | None:
    for name in ("num_cached_tokens", "prefix_hit_tokens", "num_prefix_hit_tokens"):
        v = getattr(req, name, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def _computed_prompt_tokens(engine) -> int | None:
    v = getattr(engine, "_prompt_tokens", None)
    if isinstance(v, int):
        return v
    try:
        return int(engine.snapshot().prompt_tokens)
    except Exception:
        return None


def _ranges(ids: list[int]) -> str:
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


class ChatSession:
    def __init__(self, engine, a: ChatArgs, err: Console, interactive: bool) -> None:
        self.engine = engine
        self.a = a
        self.err = err
        self.interactive = interactive
        self.messages: list[dict] = []  # user/assistant turns the model sees (system kept apart)
        self.turns: list[TurnRecord] = []  # this conversation's turns (since the last /reset)
        self.dropped_turns = 0  # turns dropped by --truncate in this conversation
        self.total_turns = 0
        self.total_prompt = 0
        self.total_hits: int | None = None
        self.last_turn: tuple[str, list[int], int] | None = None  # req id, block table, tokens
        self.out = sys.stdout

    # --- small output helpers -------------------------------------------------------------------------
    def note(self, text: str, style: str = "yellow") -> None:
        """One line on stderr (soft-wrapped: never split by rich)."""
        self.err.print(text, style=style, soft_wrap=True, markup=False, highlight=False)

    def _template(self, history: list[dict], user: dict | None = None) -> list[int]:
        msgs: list[dict] = []
        if self.a.system:
            msgs.append({"role": "system", "content": self.a.system})
        msgs.extend({"role": m["role"], "content": m["content"]} for m in history)
        if user is not None:
            msgs.append(user)
        return list(self.engine.tokenizer.apply_chat_template(msgs, add_generation_prompt=True))

    # --- reading input --------------------------------------------------------------------------------
    def read(self) -> str | None:
        """One line, or None at EOF. KeyboardInterrupt propagates."""
        if not self.interactive:
            line = sys.stdin.readline()
            return None if line == "" else line.rstrip("\r\n")
        try:
            if _isatty(sys.stdout):
                return input(self._prompt_text())
            self.err.print(PROMPT, end="", markup=False, highlight=False)  # keep a redirected stdout clean
            return input()
        except EOFError:
            return None

    def _prompt_text(self) -> str:
        if "readline" in sys.modules and self.err.is_terminal and not self.err.no_color:
            # \001..\002 tell readline the color codes take no columns.
            return "\001\033[1;36m\002" + PROMPT.rstrip() + "\001\033[0m\002 "
        return PROMPT

    # --- the loop -------------------------------------------------------------------------------------
    def loop(self) -> int:
        while True:
            try:
                line = self.read()
            except KeyboardInterrupt:
                if not self.interactive:
                    self.err.print()
                    self.goodbye()
                    return 130
                self.err.print()
                self.note("(use /quit or Ctrl-D to exit)", style="dim")
                continue
            if line is None:
                if self.interactive:
                    self.err.print()
                break
            text = line.strip()
            if not text:
                continue
            if text.startswith("/") and not text.startswith("//"):
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
            self.err.print("  [dim]a line starting with // sends a message that starts with /; "
                           "Ctrl-C stops a reply; Ctrl-D quits[/dim]", highlight=False)
        elif name == "/stats":
            self.stats()
        elif name == "/blocks":
            self.blocks()
        elif name == "/reset":
            n = len(self.turns)
            self.messages.clear()
            self.turns.clear()
            self.dropped_turns = 0
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
        e = self.engine
        self.err.print(summary_table(e.snapshot(), title="kvcli chat"))
        try:
            ctx = len(self._template(self.messages)) if (self.messages or self.a.system) else 0
        except Exception:  # a template that rejects the conversation as it stands
            ctx = 0
        line = (f"conversation: {len(self.turns)} turn{'s' if len(self.turns) != 1 else ''}, "
                f"{ctx:,} prompt tokens of a {e.max_model_len:,}-token context")
        if self.dropped_turns:
            line += f" ({self.dropped_turns} oldest turns dropped)"
        hits = _prefix_hits_total(e)
        if hits is not None:
            line += f" · prefix-cache hits {hits:,} tokens"
        self.note(line, style="dim")

    def blocks(self) -> None:
        e = self.engine
        rendered = _render_block_map(e, self.err.width)
        if rendered is not None:
            self.err.print(rendered)
            self.err.print()  # the map's legend ends without a newline
        else:
            for row in _text_block_grid(e):
                self.err.print(row, markup=False, highlight=False, soft_wrap=True)
        if self.last_turn is not None:
            rid, table, tokens = self.last_turn
            live = rid in (getattr(e.kv, "tables", None) or {})
            where = "still held" if live else ("blocks freed when the reply ended; a prefix cache may keep them "
                                              "as cached-free")
            self.note(f"last turn ({rid}): {tokens:,} tokens in {len(table):,} blocks [{_ranges(table)}] · {where}",
                      style="dim")

    def save(self, path: Path) -> None:
        data = {
            "model": str(self.engine.source),
            "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "system": self.a.system,
            "settings": {"max_tokens": self.a.params.max_tokens, "temperature": self.a.params.temperature,
                         "top_p": self.a.params.top_p, "top_k": self.a.params.top_k, "seed": self.a.params.seed,
                         "max_model_len": self.engine.max_model_len, "truncate": self.a.truncate},
            "messages": self.messages,
            "dropped_turns": self.dropped_turns,
            "turns": [asdict(t) for t in self.turns],
        }
        try:
            path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        except OSError as ex:
            self.note(f"cannot write {path}: {ex.strerror or ex}", style="red")
            return
        self.note(f"saved {len(self.turns)} turn{'s' if len(self.turns) != 1 else ''} to {path}", style="dim")

    # --- a turn -----------------------------------------------------------------------------------------
    def fit(self, user: dict) -> list[int] | None:
        """The prompt ids for the conversation plus `user`, leaving room for --max-tokens; drops the
        oldest turns under --truncate; None (after a one-line notice) when it cannot fit."""
        max_len, mt = self.engine.max_model_len, self.a.params.max_tokens
        room = max_len - mt
        try:
            ids = self._template(self.messages, user)
            if len(ids) <= room:
                return ids
            alone = self._template([], user)
        except Exception as ex:  # a model's Jinja template may reject a conversation; never crash
            self.note(f"cannot apply the chat template: {ex}; not sent", style="red")
            return None
        if len(alone) > room:
            self.note(f"message too long: {len(alone):,} prompt tokens + --max-tokens {mt} exceed the "
                      f"{max_len:,}-token context; not sent")
            return None
        if not self.a.truncate:
            self.note(f"context full: this turn needs {len(ids):,} prompt tokens + --max-tokens {mt} > the "
                      f"{max_len:,}-token context; /reset to start over (or run with --truncate); not sent")
            return None
        starts = [i for i, m in enumerate(self.messages) if m["role"] == "user"]
        for k in range(1, len(starts) + 1):
            cut = starts[k] if k < len(starts) else len(self.messages)
            ids = self._template(self.messages[cut:], user)
            if len(ids) <= room:
                del self.messages[:cut]
                self.dropped_turns += k
                self.note(f"context full: dropped the {k} oldest turn{'s' if k != 1 else ''} to fit "
                          f"({len(ids):,} prompt tokens + --max-tokens {mt} <= {max_len:,})")
                return ids
        return None  # unreachable: the message alone fits

    def turn(self, text: str) -> bool:
        """One exchange; True when Ctrl-C stopped it."""
        e = self.engine
        user = {"role": "user", "content": text}
        ids = self.fit(user)
        if ids is None:
            if not self.interactive:
                self.out.write("\n")  # keep one reply (here empty) per message for scripts
                self.out.flush()
            return False
        a = self.a
        seed = None if a.params.seed is None else a.params.seed + self.total_turns
        params = a.params.with_(seed=seed)
        hits_before = _prefix_hits_total(e)
        computed_before = _computed_prompt_tokens(e)

        spinner = None
        started = False
        shown: list[str] = []
        interrupted = False
        failed: str | None = None
        peak_blocks = 0
        table: list[int] = []
        t0 = time.perf_counter()
        req = None
        # The latch covers the request from before it exists to after it is finished or aborted, so
        # no Ctrl-C can leave a request behind in the engine.
        with _SigintLatch() as latch:
            try:
                try:
                    req = e.add_request(ids, params)
                except (ConfigError, KVBudgetTooSmall) as ex:
                    failed = str(ex)
                    return self._failed_turn(failed)
                rid = req.req_id
                if self.interactive and self.err.is_terminal:
                    spinner = self.err.status("[dim]thinking…[/dim]", spinner="dots")
                    spinner.start()
                while not req.finished and not latch.hit:
                    outs = e.step()
                    peak_blocks = max(peak_blocks, _used_blocks(e))
                    if not req.finished:
                        table = list(e.kv.block_table(rid))
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
                        self.out.write(piece)
                        self.out.flush()
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
        if not interrupted and not failed:
            # Ctrl-C during the step that finished the reply anyway: show the rest, so the screen
            # matches what the conversation keeps.
            rest = req.output_text.lstrip()[len("".join(shown)):]
            if rest:
                self.out.write(rest)
                shown.append(rest)
                started = True
        if started or not self.interactive:
            self.out.write("\n")
            self.out.flush()

        if failed:
            self.note(f"cannot run this turn: {failed}", style="red")
            return False
        # An interrupted reply keeps what was on the screen; a finished one the model's exact text.
        reply = "".join(shown) if interrupted else req.output_text
        if interrupted and not reply.strip():
            self.note("interrupted before the reply started; the message was not kept", style="yellow")
            return True

        # Per-turn numbers.
        n_gen = len(req.output_token_ids)
        times = list(getattr(req, "token_times", []) or [])
        decode_tps = (len(times) - 1) / (times[-1] - times[0]) if len(times) >= 2 and times[-1] > times[0] else 0.0
        first = getattr(req, "first_token_time", None)
        arrival = getattr(req, "arrival_time", None)
        ttft = first - arrival if first is not None and arrival is not None else None
        hits = _request_hits(req)
        hits_after = _prefix_hits_total(e)
        if hits is None and hits_before is not None and hits_after is not None:
            hits = max(0, hits_after - hits_before)
        saved = None
        if hits is not None:
            computed_after = _computed_prompt_tokens(e)
            if computed_before is not None and computed_after is not None:
                computed = computed_after - computed_before
                saved = max(0, len(ids) - computed) if 0 <= computed <= len(ids) else hits
            else:
                saved = hits
        bs = getattr(e.kv, "block_size", 16)
        tokens_held = req.num_computed_tokens
        self.last_turn = (rid, table, tokens_held)

        self.messages.append(user)
        msg = {"role": "assistant", "content": reply}
        if interrupted:
            msg["interrupted"] = True
        self.messages.append(msg)
        rec = TurnRecord(user=text, reply=reply, prompt_tokens=len(ids), generated_tokens=n_gen,
                         finish_reason="interrupted" if interrupted else req.finish_reason,
                         interrupted=interrupted, seconds=round(wall, 3),
                         ttft_s=None if ttft is None else round(ttft, 3), decode_tok_s=round(decode_tps, 2),
                         kv_blocks=max(peak_blocks, -(-tokens_held // bs)), prefix_hit_tokens=hits,
                         prefill_tokens_saved=saved)
        self.turns.append(rec)
        self.total_turns += 1
        self.total_prompt += len(ids)
        if hits is not None:
            self.total_hits = (self.total_hits or 0) + hits
        self.status_line(rec)
        return interrupted

    def _failed_turn(self, message: str) -> bool:
        self.note(f"cannot run this turn: {message}", style="red")
        if not self.interactive:
            self.out.write("\n")
            self.out.flush()
        return False

    def status_line(self, t: TurnRecord) -> None:
        parts = [f"{t.prompt_tokens:,} prompt tokens", f"{t.generated_tokens:,} generated",
                 f"{t.decode_tok_s:,.1f} tok/s decode"]
        if t.ttft_s is not None:
            parts.append(f"first token {t.ttft_s:.2f} s")
        if t.prefix_hit_tokens is not None:
            parts.append(f"prefix hit {t.prefix_hit_tokens:,} tokens")
            if t.prefill_tokens_saved is not None:
                parts.append(f"prefill saved {t.prefill_tokens_saved:,} tokens")
        parts.append(f"KV {t.kv_blocks:,} of {_total_blocks(self.engine):,} blocks")
        head = "[interrupted] " if t.interrupted else ("[length] " if t.finish_reason == "length" else "")
        self.note(head + " · ".join(parts), style="yellow" if t.interrupted else "dim")

    def goodbye(self) -> None:
        e = self.engine
        snap = e.snapshot()
        title = (f"kvcli chat: {self.total_turns} turn{'s' if self.total_turns != 1 else ''}, "
                 f"{self.total_prompt:,} prompt tokens submitted")
        if self.total_hits is not None:
            title += f", prefix-cache hits {self.total_hits:,} tokens"
        self.err.print(summary_table(snap, title=title))


# --- /blocks -------------------------------------------------------------------------------------------
def _engine_block_map(engine):
    """A kvcli.metrics.snapshot.BlockMap of the pool now, from the engine's own collector if it has
    one, else built from the block tables (owner -1 free, -2 cached-free)."""
    metrics = getattr(engine, "metrics", None)
    fn = getattr(metrics, "block_map", None) or getattr(engine, "block_map", None)
    if callable(fn):
        return fn()
    from kvcli.metrics.snapshot import BlockMap

    kv = engine.kv
    bs = kv.block_size
    n = _total_blocks(engine)
    owner, fill, ref = [-1] * n, [0] * n, [0] * n
    owners: list[str] = []
    for rid, table in (getattr(kv, "tables", None) or {}).items():
        idx = len(owners)
        owners.append(rid)
        req = engine.requests.get(rid)
        done = req.num_computed_tokens if req is not None else len(table) * bs
        for i, b in enumerate(table):
            if owner[b] == -1:
                owner[b] = idx
            fill[b] = max(fill[b], min(bs, max(0, done - i * bs)))
            ref[b] += 1
    return BlockMap(bs, tuple(owner), tuple(fill), tuple(ref), tuple(owners))


def _render_block_map(engine, width: int):
    """kvcli.view.block_map's renderer when it is there and works; None otherwise."""
    try:
        mod = importlib.import_module("kvcli.view.block_map")
    except Exception:
        return None
    render = getattr(mod, "render_block_map", None) or getattr(mod, "render", None)
    if not callable(render):
        return None
    try:
        bm = _engine_block_map(engine)
        try:
            return render(bm, width=max(16, min(96, width - 2)), height=16)
        except TypeError:
            return render(bm)
    except Exception:
        return None


def _text_block_grid(engine, width: int = 64) -> list[str]:
    """Plain fallback: one character per block ('a'.. per live request, '+' cached-free, '.' free),
    then the blocks of each live request."""
    kv = engine.kv
    n = _total_blocks(engine)
    tables = dict(getattr(kv, "tables", None) or {})
    glyph = ["."] * n
    pool = getattr(engine, "pool", None)
    for b in getattr(pool, "blocks", ()) or ():
        if getattr(b, "ref_cnt", 0) == 0 and getattr(b, "block_hash", None) is not None and b.block_id < n:
            glyph[b.block_id] = "+"
    letters = "abcdefghijklmnopqrstuvwxyz"
    for i, table in enumerate(tables.values()):
        for b in table:
            if 0 <= b < n:
                glyph[b] = letters[i % len(letters)]
    used = _used_blocks(engine)
    rows = [f"KV pool: {n:,} blocks x {getattr(kv, 'block_size', '?')} tokens · {used:,} in use · "
            f"{n - used:,} free   (letter = request, + = cached-free, . = free)"]
    last = max((i for i, g in enumerate(glyph) if g != "."), default=-1)
    shown = max(width, -(-(last + 1) // width) * width) if n else 0
    shown = min(shown, n)
    for start in range(0, shown, width):
        rows.append(f"{start:>6}  " + "".join(glyph[start:start + width]))
    if shown < n:
        rows.append(f"        … {n - shown:,} more blocks, all free")
    for i, (rid, table) in enumerate(tables.items()):
        rows.append(f"  {letters[i % len(letters)]} = {rid}: {len(table):,} blocks [{_ranges(table)}]")
    return rows


# --- entry point -----------------------------------------------------------------------------------------
def run_chat(a: ChatArgs, fail: Fail) -> int:
    interactive = _isatty(sys.stdin)
    try:  # bytes that are not UTF-8 become U+FFFD instead of surrogates the tokenizer rejects
        sys.stdin.reconfigure(errors="replace")
    except (AttributeError, ValueError, OSError):
        pass
    err = Console(stderr=True, highlight=False)

    try:
        with err.status("loading model…", spinner="dots"):
            engine = build_engine(a.model, a.quant, a.options, fail)
    except KeyboardInterrupt:
        err.print()
        return 130
    if getattr(engine, "tokenizer", None) is None:
        fail("this model has no tokenizer, so it cannot chat")
    if a.params.max_tokens >= engine.max_model_len:
        fail(f"--max-tokens {a.params.max_tokens} leaves no room for the conversation in the "
             f"{engine.max_model_len:,}-token context (lower --max-tokens or raise --max-model-len)")

    kv_dtype = getattr(engine, "kv_dtype", None) or getattr(getattr(engine, "kv_cache", None), "dtype", "?")
    err.print(f"[dim]{escape(Path(str(engine.source)).name)} · {engine.config.num_layers} layers · weights "
              f"{engine.linear_mode} · KV {kv_dtype} on {engine.device} · loaded in {engine.load_seconds:.1f} s"
              f"[/dim]", soft_wrap=True)
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        err.print(f"[dim]chat · {engine.max_model_len:,}-token context · up to {a.params.max_tokens} tokens per reply · "
                  f"/help for commands · Ctrl-C stops a reply · Ctrl-D or /quit exits[/dim]", soft_wrap=True)
    session = ChatSession(engine, a, err, interactive)
    try:
        return session.loop()
    except KeyboardInterrupt:  # e.g. Ctrl-C while /stats renders
        err.print()
        session.goodbye()
        return 130
    except BrokenPipeError:  # `kvcli chat | head`: the reader left; stop quietly
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush cannot fail
        except (OSError, ValueError):
            pass
        return 141
