"""`kvcli continue FILE`: prefill a long text in chunks, stream its continuation, summarize."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from contextlib import nullcontext

from rich.console import Console, Group
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from kvcli.commands.common import Fail, build_engine
from kvcli.config import SamplingParams
from kvcli.engine.scheduler import KVBudgetTooSmall
from kvcli.options import ConfigError, EngineOptions
from kvcli.inputs import InputError, check_outputs, read_text_file, write_text_file
from kvcli.kvcache.block_manager import sliding_window_of
from kvcli.metrics.snapshot import Snapshot
from kvcli.metrics.window import WindowTracker, with_window
from kvcli.view.dashboard import LiveDashboard
from kvcli.model.tokenizer import document_ids
from kvcli.view.plain_log import human_bytes, same_destination
from kvcli.view.summary import snapshot_dict, summary_table


@dataclass(frozen=True)
class ContinueArgs:
    file: Path
    params: SamplingParams
    truncate: str
    json_out: bool
    output: Path | None
    model: str | None
    quant: str
    options: EngineOptions
    live: bool = True


def fit_prompt(ids: list[int], max_len: int, max_tokens: int, truncate: str, bounded: bool = False,
               sliding: int = 0) -> list[int]:
    """The prompt must leave room for max_tokens inside the context, unless the KV cache is bounded
    (--kv-window): then any length streams through. `sliding`: the window of a model whose every layer slides
    (Mistral), where --kv-window auto keeps the model's own window and an explicit bounded cache must fit in it
    (the error names the flag and that limit)."""
    if bounded:
        return ids
    room = max_len - max_tokens
    if len(ids) <= room:
        return ids
    if room <= 0:
        raise ConfigError(f"--max-tokens {max_tokens} leaves no room for the text in a {max_len}-token context")
    if truncate == "head":
        return ids[-room:]
    keep = f"use --truncate head to keep the last {room:,}"
    hint = (f"{keep}, or --kv-window W to stream it through a bounded cache inside the model's own "
            f"{sliding:,}-token sliding window" if sliding else
            f"{keep}, or --kv-window auto to stream it through a bounded cache")
    raise ConfigError(f"the text has {len(ids):,} tokens; {room:,} fit in the {max_len:,}-token context with "
                      f"room for --max-tokens {max_tokens} ({hint})")


def window_note(ids: int, max_tokens: int, retention, max_len: int) -> str | None:
    """The one line saying what a bounded cache keeps of a text longer than the context (None otherwise)."""
    if retention is None or ids + max_tokens <= max_len:
        return None
    kept = retention.sink_slots + retention.window
    return (f"text of {ids:,} tokens > the {max_len:,}-token context: the KV keeps the first {retention.sink_slots:,} "
            f"(--sink-tokens {retention.sink_tokens}, whole blocks) and the last {retention.window:,} to "
            f"{retention.window + retention.block_size - 1:,} tokens (--kv-window), dropping about "
            f"{max(0, ids + max_tokens - kept):,} as it streams; --kv-window none refuses the text, --truncate "
            f"head keeps only its end")


def run_continue(a: ContinueArgs, fail: Fail) -> int:
    err = Console(stderr=True)
    params = a.params
    try:
        text = read_text_file(a.file)
    except InputError as e:
        fail(str(e))
    check_outputs((a.output,), fail, inputs=(a.file,))

    with err.status("loading model…", spinner="dots"):
        engine = build_engine(a.model, a.quant, a.options, fail)
    ids = document_ids(engine.tokenizer, text, literal=True)  # a document: special spellings are its text
    if len(ids) + params.max_tokens <= engine.max_model_len:
        engine.unbounded_for_kv_groups()  # Gemma: per-group tables hold less than the bounded cache's one table
    try:
        c = engine.config
        prompt = fit_prompt(ids, engine.max_model_len, params.max_tokens, a.truncate, engine.retention is not None,
                            sliding=sliding_window_of(c))
        req = engine.add_request(prompt, params)
    except (ConfigError, KVBudgetTooSmall) as e:
        fail(str(e))
    err.print(f"[dim]{Path(engine.source).name} · {engine.config.num_layers} layers · weights {engine.linear_mode} · "
              f"KV {engine.kv_dtype} on {engine.device} · loaded in {engine.load_seconds:.1f} s[/dim]")
    if len(prompt) < len(ids):
        err.print(f"[yellow]truncated: kept the last {len(prompt):,} of {len(ids):,} tokens[/yellow]")
    note = window_note(len(ids), params.max_tokens, engine.retention, engine.max_model_len)
    if note and not a.json_out:
        err.print(f"[yellow]{note}[/yellow]", highlight=False)

    interrupted = False
    # On a terminal: the dashboard with a prefill bar on top. Otherwise (a pipe, --no-live): plain
    # log lines on stderr every 2 s. --json keeps stderr quiet apart from errors.
    view = None if a.json_out else _LiveView(engine, err, len(prompt), live=a.live and err.is_terminal)
    by_line = view is not None and view.dash.use_live and sys.stdout.isatty()  # stdout shares the terminal
    stream = _Stream(quiet=a.json_out, above=view.dash if by_line else None)
    if view is not None and not by_line and same_destination(sys.stdout, sys.stderr):
        view.dash.end_text_line = stream.end_line  # log lines on stderr never land inside a line of the text
    t0 = time.perf_counter()
    try:
        with (view.dash if view else nullcontext()):
            while engine.has_unfinished():
                for o in engine.step():
                    stream.emit(o.new_text)
                if view:
                    view.update(req.num_computed_tokens)
    except KeyboardInterrupt:
        interrupted = True
        engine.abort(req.req_id)
    except KVBudgetTooSmall as e:
        fail(str(e))
    wall = time.perf_counter() - t0

    continuation = "".join(stream.pieces)
    if not a.json_out:
        if by_line:  # the unfinished last line, held back while the dashboard was up
            sys.stdout.write("".join(stream.held))
        sys.stdout.write("\n")
        sys.stdout.flush()
    if a.output is not None:
        try:
            write_text_file(a.output, continuation)
        except InputError as e:  # the continuation is already on stdout
            fail(str(e))
    snap = with_window(engine.snapshot(), engine)
    if a.json_out:
        report = {
            "model": engine.source,
            "file": str(a.file),
            "prompt_tokens": len(prompt),
            "text_tokens": len(ids),
            "truncated": len(prompt) < len(ids),
            "generated_token_ids": list(req.output_token_ids),
            "text": continuation,
            "finish_reason": "interrupted" if interrupted else req.finish_reason,
            "kv_window": engine.retention.window if engine.retention else None,
            "sink_tokens": engine.retention.sink_tokens if engine.retention else None,
            "dropped_tokens": engine.scheduler.dropped_tokens(req),
            # KV groups (Gemma): the paged layout's block tables per request, or null with one table
            "kv_groups": engine.kv_groups.describe() if engine.kv_groups.hybrid else None,
            "wall_seconds": round(wall, 3),
            "load_seconds": round(engine.load_seconds, 3),
            "weights_format": engine.linear_mode,
            "cuda_graphs": engine.cuda_graphs,
            "metrics": snapshot_dict(snap),
        }
        print(json.dumps(report, indent=2))
    else:
        table = summary_table(snap, title="kvcli continue" + (" (interrupted)" if interrupted else ""))
        dropped = engine.scheduler.dropped_tokens(req)  # the summary's "bounded KV" row: the run's (one request)
        paged, contiguous = _layout_comparison(snap, req.num_computed_tokens - dropped)
        table.add_row("vs contiguous (max-len)",
                      f"paged held {human_bytes(paged)}; preallocating {snap.max_model_len:,} slots would "
                      f"reserve {human_bytes(contiguous)} ({contiguous / max(paged, 1):.1f}x)")
        if engine.device.type == "cuda":
            table.add_row("CUDA graphs", engine.cuda_graphs)
        err.print(table)
    return 130 if interrupted else 0


def _layout_comparison(s: Snapshot, tokens: int) -> tuple[int, int]:
    """KV bytes this run held in blocks, against a contiguous max-length reservation."""
    bs = s.block_size
    per_slot = s.bytes_per_block // bs
    paged = -(-tokens // bs) * bs * per_slot
    contiguous = -(-s.max_model_len // bs) * bs * per_slot
    return paged, contiguous


class _LiveView:
    """Feeds the dashboard a snapshot at most every 0.2 s, so the engine loop stays fast."""

    def __init__(self, engine, console: Console, prompt_tokens: int, live: bool) -> None:
        from kvcli.metrics.memory import MemoryProbe

        self.engine = engine
        self.progress = Progress(TextColumn("prefill"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
                                 TimeRemainingColumn(), console=console, auto_refresh=False)
        self.task = self.progress.add_task("prefill", total=prompt_tokens)
        self.prompt_tokens = prompt_tokens
        self.dash = _PrefillDashboard(console, live=live, progress=self.progress)
        self.probe = MemoryProbe(str(engine.device))
        self.weights = sum(engine.weight_bytes().values())  # fixed for the run: summed once
        self.window = WindowTracker(engine)  # the blocks a bounded cache recycles, marked on the map
        self.last = 0.0

    def update(self, computed: int) -> None:
        """After every engine step."""
        self.window.observe()
        now = time.perf_counter()
        if now - self.last >= 0.2:
            self.last = now
            e = self.engine
            self.progress.update(self.task, completed=min(computed, self.prompt_tokens))
            self.dash.prefilling = computed < self.prompt_tokens
            self.dash.update(self.window.snapshot(self.probe.sample(e.kv_pool_bytes, self.weights), block_map=True))


class _PrefillDashboard(LiveDashboard):
    """The dashboard with the prefill progress bar above it while the prompt is being computed."""

    def __init__(self, console: Console, *, live: bool, progress: Progress) -> None:
        super().__init__(console, live=live)
        self.progress = progress
        self.prefilling = True

    def renderable(self):
        body = super().renderable()
        return Group(self.progress.get_renderable(), body) if self.prefilling else body

    def log_line(self, s) -> str:
        """The plain log's line, led while the prompt is prefilled by how far it has got (what the bar shows)."""
        line = super().log_line(s)
        if not self.prefilling:
            return line
        task = self.progress.tasks[0]
        return f"prefill {int(task.completed):,} of {int(task.total):,} tokens · {line}"


class _Stream:
    """The continuation as it streams: every piece kept, and written to stdout as it comes or, under
    the live dashboard (`above`), a whole line at a time above the panels (the rest, `held`, when the
    run ends). Linear in the output: a line is joined once, when it completes."""

    def __init__(self, quiet: bool, above: LiveDashboard | None) -> None:
        self.pieces: list[str] = []
        self.held: list[str] = []  # the unfinished line's pieces, under the dashboard
        self.quiet = quiet
        self.above = above
        self.mid_line = False  # written straight to stdout: the last piece did not end its line

    def end_line(self) -> bool:
        """Whether stdout is mid-line (a line of stderr then needs a newline first); the line counts as ended."""
        was, self.mid_line = self.mid_line, False
        return was

    def emit(self, text: str) -> None:
        if not text:
            return
        self.pieces.append(text)
        if self.quiet:
            return
        if self.above is None:
            sys.stdout.write(text)
            sys.stdout.flush()
            self.mid_line = not text.endswith("\n")
            return
        if "\n" not in text:
            self.held.append(text)
            return
        cut = text.rfind("\n") + 1
        line = "".join(self.held) + text[:cut]
        self.held = [text[cut:]] if cut < len(text) else []
        self.above.print_above(line)
