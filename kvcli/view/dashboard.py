"""The live dashboard: memory, the KV block map, the fragmentation breakdown against contiguous
preallocation, and throughput / latency, all rendered from one `Snapshot`.

`LiveDashboard` decouples the engine from rendering: `update()` only stores the snapshot, and
rich's refresh thread renders the latest one 4 times a second. Off a terminal it prints
`format_log_line` at most every `log_interval_s` instead.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from kvcli.metrics.snapshot import KVBreakdown, MemorySnapshot, Snapshot, WindowSummary
from kvcli.view.block_map import render_block_map
from kvcli.view.plain_log import (
    current_tok_s,
    format_log_line,
    human_bytes,
    itl_values,
    pct,
    percentile,
    seconds,
    ttft_values,
)

SPARK = "▁▂▃▄▅▆▇█"
_EIGHTHS = " ▏▎▍▌▋▊▉"
LABEL = "bold"
NOTE = "yellow"
# Rows the dashboard needs besides the block grid (header, two stat panels, map legend and
# borders, fragmentation panel); the grid gets what is left of a terminal's height.
_FIXED_ROWS = 27
MAX_MAP_ROWS = 16

_CATEGORIES = (
    ("tokens", "token_bytes", "green"),
    ("reserved", "reserved_bytes", "yellow"),
    ("internal", "internal_bytes", "magenta"),
    ("external", "external_bytes", "red"),
)


# -- small renderers ---------------------------------------------------------------------------

def sparkline(values: tuple[float, ...] | list[float], width: int) -> str:
    """The last `width` values as ▁..█, scaled from 0 to their maximum."""
    xs = list(values)[-width:] if width > 0 else []
    if not xs:
        return ""
    top = max(xs)
    if top <= 0:
        return SPARK[0] * len(xs)
    last = len(SPARK) - 1
    return "".join(SPARK[min(last, max(0, round(x / top * last)))] for x in xs)


def hbar(fraction: float, width: int) -> str:
    """A horizontal bar `width` cells wide at 100%, in eighth-cell steps; '▶' marks a value past
    100% (external fragmentation can exceed the allocated bytes it is measured against)."""
    over = fraction > 1.0
    units = round(min(max(fraction, 0.0), 1.0) * width * 8)
    full, rem = divmod(units, 8)
    bar = "█" * full + (_EIGHTHS[rem] if rem else "")
    bar = bar.ljust(width)
    return bar[:-1] + "▶" if over else bar


def _kv_table(rows: list[tuple[str, str]], width: int) -> Table:
    """Label / value rows `width` cells wide. Fixed column widths spare rich from measuring
    every cell on each refresh (measurement dominated the render time)."""
    label_width = max(len(label) for label, _ in rows)
    t = Table.grid(padding=(0, 1))
    t.add_column(style=LABEL, no_wrap=True, width=label_width)
    t.add_column(overflow="fold", width=max(1, width - label_width - 1))
    for label, value in rows:
        t.add_row(label, value)
    return t


# -- panels ------------------------------------------------------------------------------------

def memory_panel(m: MemorySnapshot | None, width: int = 50) -> Panel:
    if m is None:
        return Panel(Text("not sampled", style="dim"), title="memory", title_align="left")

    def used_of_total() -> str:
        assert m.device_total_bytes
        used = m.device_used_bytes
        share = f" ({pct(used / m.device_total_bytes)})" if used is not None else ""
        return f"{human_bytes(used)} of {human_bytes(m.device_total_bytes)}{share}"

    rows: list[tuple[str, str]] = [("device", m.device)]
    if m.gpu_found:
        if m.device_total_bytes:
            rows.append(("device used", used_of_total()))
        proc = m.process_used_bytes
        if proc is not None and m.device_total_bytes:
            share = pct(proc / m.device_total_bytes)
            rows.append(("this process", f"{human_bytes(proc)} ({share} of device)"))
        else:
            rows.append(("this process", human_bytes(proc)))
        if m.torch_allocated_bytes is not None and m.torch_reserved_bytes is not None:
            alloc, res = m.torch_allocated_bytes, m.torch_reserved_bytes
            rows.append(("torch allocated", human_bytes(alloc)))
            rows.append(("torch reserved", human_bytes(res)))
            frag = res - alloc
            share = f" ({pct(frag / res)} of reserved)" if res else ""
            rows.append(("allocator frag", f"{human_bytes(frag)}{share}"))
    else:
        rows.append(("process RSS", human_bytes(m.process_used_bytes)))
        if m.device_total_bytes:
            rows.append(("system RAM", used_of_total()))
    rows.append(("KV pool", human_bytes(m.kv_pool_bytes)))
    rows.append(("weights", human_bytes(m.weight_bytes)))
    body: list[RenderableType] = [_kv_table(rows, width - 4)]  # less border and padding
    if m.note:
        body.append(Text(m.note, style=NOTE))
    return Panel(Group(*body), title="memory", title_align="left")


def throughput_panel(s: Snapshot, width: int = 50) -> Panel:
    ttft = ttft_values(s)
    itl = itl_values(s)
    tps = s.tokens_per_s
    rows: list[tuple[str, str]] = [
        # width less border and padding (4) and the label column ("prefix cache" + 1)
        ("tok/s", sparkline(tps, max(8, width - 4 - 13)) or "no samples yet"),
        ("current", f"{current_tok_s(s):,.1f} tok/s" + (f" (peak {max(tps):,.1f})" if tps else "")),
        ("TTFT p50", f"{seconds(percentile(ttft, 50))} over {len(ttft)} requests"),
        ("ITL p50/p99", f"{seconds(percentile(itl, 50))} / {seconds(percentile(itl, 99))}"),
        ("requests", f"running {s.num_running} · waiting {s.num_waiting}"),
        ("preemptions", f"{s.num_preempted}"),
        ("prefix cache", f"{pct(s.prefix_hit_rate)} hit "
                         f"({s.prefix_hit_tokens:,} of {s.prefix_query_tokens:,} tokens)"),
        ("tokens", f"prompt {s.prompt_tokens:,} · generated {s.generated_tokens:,}"),
    ]
    if s.spec.method != "none":
        rows.append(("speculation", spec_line(s)))
    if s.cpu_threads:
        rows.append(("CPU threads", threads_line(s)))
    return Panel(_kv_table(rows, width - 4), title="throughput & latency", title_align="left")


def threads_line(s: Snapshot) -> str:
    """The kernels' CPU threads now, e.g. '2 (auto · changed 3 times)', '1 (auto)', '2'."""
    if not s.threads_auto:
        return f"{s.cpu_threads}"
    n = s.thread_switches
    changed = f" · changed {n} time{'s' if n != 1 else ''}" if n else ""
    return f"{s.cpu_threads} (auto{changed})"


def spec_line(s: Snapshot) -> str:
    """Guesses so far and the slots the last step held for them, e.g. 'ngram k<=5 adaptive: 41.0% of 800
    accepted · 2.31 tok/step/req · 5 guess slots last step · 3.2/verify · 1 paused' (3.2: the guesses a
    verification carried on average)."""
    sp = s.spec
    line = (f"{sp.method} {sp.limit}: {pct(sp.acceptance_rate)} of {sp.proposed:,} accepted · "
            f"{sp.tokens_per_request_step:.2f} tok/step/req · {sp.last_step_guesses} guess slots last step · "
            f"{sp.mean_draft:.1f}/verify")
    return line + (f" · {sp.paused} paused" if sp.paused else "")


def _breakdown_cell(kv: KVBreakdown, part: str, style: str, bar_width: int) -> Text:
    share = kv.share_of_allocated(part)
    cell = Text(no_wrap=True, overflow="crop")
    cell.append(hbar(share, bar_width), style=style)
    cell.append(f" {pct(share):>6} {human_bytes(getattr(kv, part)):>10}")
    return cell


def fragmentation_panel(s: Snapshot, width: int) -> Panel:
    columns: list[tuple[str, KVBreakdown]] = [(f"{s.layout} (live)", s.kv)]
    if s.contiguous_whatif is not None:
        columns.append(("contiguous what-if (max-len)", s.contiguous_whatif))
    # Inside the panel (width - 4): the label column (14 + 2 padding), then per column 2 padding
    # and a cell of bar + " 100.0%" (7) + " 1023.9 MiB" (11); one cell of slack against cropping.
    per_column = (width - 4 - 16) // len(columns) - 2
    bar_width = max(4, per_column - 18 - 1)
    t = Table(box=None, padding=(0, 1), show_edge=False, header_style=LABEL)
    t.add_column("% of allocated", style=LABEL, no_wrap=True, width=14)
    for header, _ in columns:
        t.add_column(header, no_wrap=True, width=per_column)
    for label, part, style in _CATEGORIES:
        t.add_row(label, *(_breakdown_cell(kv, part, style, bar_width) for _, kv in columns))
    t.add_row("allocated", *(f"{human_bytes(kv.allocated_bytes)} of a "
                             f"{human_bytes(kv.total_bytes)} pool" for _, kv in columns))
    body: list[RenderableType] = [t]
    if s.contiguous_whatif is not None and s.whatif_fits is not None:
        body.append(whatif_line(s.whatif_fits, s.num_running, s.max_model_len))
    return Panel(Group(*body), title="KV fragmentation (vLLM Fig. 2 categories)", title_align="left")


def whatif_line(fits: int, running: int, max_model_len: int) -> Text:
    """The max-len what-if in requests: how many regions the pool holds against what runs now."""
    head = f"contiguous preallocation: the pool fits {fits:,} regions of {max_model_len:,} tokens"
    if fits < running:
        line = Text(f"{head}, so only {fits:,} of these {running:,} requests could run at once")
        line.stylize(NOTE)
        return line
    these = "this request" if running == 1 else f"these {running:,} requests"
    return Text(f"{head}: {these}, and at most {fits:,} at once")


def window_line(w: WindowSummary) -> Text:
    """The bounded cache in one line: its rule (S, W), the tokens dropped and the blocks recycled so far, e.g.
    'bounded KV: S 4 (16 sink slots) + W 992 · ≤ 1,023 tokens/request (peak 1,020) · 3,249 tokens dropped ·
    203 blocks recycled'."""
    line = Text(no_wrap=True, overflow="ellipsis")
    line.append("bounded KV", style=LABEL)
    line.append(f": S {w.sink_tokens} ({w.sink_slots:,} sink slots) + W {w.window:,} · ≤ {w.max_slots:,} "
                f"tokens/request (peak {w.peak_tokens:,}) · ")
    line.append(f"{w.dropped_tokens:,} tokens dropped · {w.recycled_blocks:,} blocks recycled",
                style=NOTE if w.dropped_tokens else "")
    return line


def block_map_panel(s: Snapshot, width: int, map_rows: int) -> Panel:
    if s.blocks is None:
        body: RenderableType = Text(f"no block map ({s.layout} layout)", style="dim")
    else:
        # Panel border (2) + padding (2) leave width - 4 cells per row.
        body = render_block_map(s.blocks, width=max(8, width - 4), height=map_rows)
    if s.window is not None:
        body = Group(window_line(s.window), body)
    return Panel(body, title="KV blocks", title_align="left")


def render_dashboard(s: Snapshot, width: int = 100, map_rows: int = 12) -> RenderableType:
    """All panels for one snapshot, laid out for a console `width` columns wide with at most
    `map_rows` rows of block map."""
    header = Text(no_wrap=True, overflow="ellipsis")
    header.append("kvcli", style="bold")
    header.append(f" · step {s.step:,} · {s.time_s:,.1f} s · {s.layout} KV layout")
    if s.kv_dtype:
        header.append(f" · KV {s.kv_dtype}, {s.kv_bytes_per_token:,} B/token")
    left = width // 2
    top = Table.grid()
    top.add_column(width=left)
    top.add_column(width=width - left)
    top.add_row(memory_panel(s.memory, left), throughput_panel(s, width - left))
    return Group(header, top, block_map_panel(s, width, map_rows), fragmentation_panel(s, width))


# -- live / plain output -----------------------------------------------------------------------

class _Current:
    """The dashboard as it is when drawn, not when a frame was last set: rich redraws the Live's
    renderable below every print, which then shows the current state without a second render."""

    def __init__(self, dash: LiveDashboard) -> None:
        self.dash = dash

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.dash.renderable()


class LiveDashboard:
    """`with LiveDashboard() as dash: ... dash.update(snapshot)` once per engine step.

    On a terminal (and with `live=True`) a rich Live on stderr redraws the latest snapshot
    `refresh_per_second` times a second from its own thread; `update` never renders. Otherwise
    one `log_line` (format_log_line's) is printed at most every `log_interval_s` seconds, plus the last
    snapshot on exit. Text meant to scroll above the panels goes through `print_above`.

    Every draw, the refresh thread's and `print_above`'s, holds one lock from cursor positioning to
    the write. rich's own refresh thread does not exclude a print from another thread (its Live lock
    covers only the cursor-up count, computed from the previous frame's height), so a frame drawn in
    between, taller or shorter, left a stale panel row among the printed lines or erased one of them.
    """

    def __init__(
        self,
        console: Console | None = None,
        *,
        live: bool = True,
        refresh_per_second: float = 4,
        log_interval_s: float = 2.0,
        no_color: bool | None = None,
        redirect_stdout: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # no_color=None lets rich read the NO_COLOR environment variable.
        self.console = console or Console(stderr=True, no_color=no_color)
        self.use_live = live and self.console.is_terminal
        self._refresh = refresh_per_second
        self._interval = log_interval_s
        # Redirecting stdout into the Live console keeps streamed text above the dashboard on a
        # terminal, but it would move piped output to stderr, so only when stdout is a terminal.
        if redirect_stdout is None:
            isatty = getattr(sys.stdout, "isatty", None)
            redirect_stdout = bool(isatty and isatty())
        self._redirect_stdout = redirect_stdout
        self._clock = clock
        self._live: Live | None = None
        self._latest: Snapshot | None = None
        self._logged: Snapshot | None = None
        self._last_log = float("-inf")
        self._cache: tuple[Snapshot, int, int, RenderableType] | None = None
        self._draw = threading.Lock()  # one draw at a time: see the class docstring
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None
        # Plain log lines: where streamed text shares their destination, a callable that says whether that text
        # is mid-line now (and counts the line as ended), so that a log line starts a line of its own.
        self.end_text_line: Callable[[], bool] | None = None

    @property
    def latest(self) -> Snapshot | None:
        return self._latest

    def update(self, snapshot: Snapshot) -> None:
        # A single attribute store: atomic under the GIL, so the refresh thread sees either the
        # old or the new snapshot, and the engine never waits on the display's lock.
        self._latest = snapshot
        if not self.use_live and self._clock() - self._last_log >= self._interval:
            self._log(snapshot)

    def _log(self, s: Snapshot) -> None:
        self._last_log = self._clock()
        self._logged = s
        if self.end_text_line is not None and self.end_text_line():
            self.console.print()
        self.console.print(self.log_line(s), markup=False, highlight=False, soft_wrap=True)

    def log_line(self, s: Snapshot) -> str:
        """One plain log line for a snapshot (a command's view may say more)."""
        return format_log_line(s)

    def _map_rows(self, s: Snapshot) -> int:
        # A bounded cache adds its line to the KV panel, and a legend row for its two states.
        fixed = _FIXED_ROWS + (2 if s.window is not None else 0)
        return max(2, min(MAX_MAP_ROWS, self.console.height - fixed))

    def renderable(self) -> RenderableType:
        """What the Live shows now; rebuilt only when the snapshot or the terminal size changed."""
        s = self._latest
        if s is None:
            return Text("kvcli: waiting for the first engine step…", style="dim")
        width, rows = self.console.width, self._map_rows(s)
        cached = self._cache
        if cached is not None and cached[0] is s and cached[1] == width and cached[2] == rows:
            return cached[3]
        r = render_dashboard(s, width=width, map_rows=rows)
        self._cache = (s, width, rows, r)
        return r

    def __enter__(self) -> LiveDashboard:
        if self.use_live:
            self._live = Live(
                _Current(self),
                console=self.console,
                auto_refresh=False,  # refreshed by _refresh_loop, under self._draw
                transient=False,
                redirect_stdout=self._redirect_stdout,
            )
            with self._draw:
                self._live.start(refresh=True)
            self._stop.clear()
            self._refresher = threading.Thread(target=self._refresh_loop, name="kvcli-dashboard", daemon=True)
            self._refresher.start()
        return self

    def _refresh_loop(self) -> None:
        while not self._stop.wait(1.0 / self._refresh):
            with self._draw:
                if self._live is not None:
                    self._live.refresh()

    def print_above(self, text: str) -> None:
        """Whole lines of text (ending in a newline) printed above the panels, which are redrawn at
        once from the current renderable; straight to stdout when no dashboard is up."""
        live = self._live
        if live is None:
            sys.stdout.write(text)
            sys.stdout.flush()
            return
        with self._draw:
            # As the text is, and wrapped by the terminal as a plain write would be; the print draws
            # the panels below it (rich's render hook), as they are now: one render per print.
            self.console.print(text.removesuffix("\n"), markup=False, highlight=False, emoji=False,
                               soft_wrap=True)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._refresher is not None:
            self._stop.set()
            self._refresher.join()
            self._refresher = None
        if self._live is not None:
            with self._draw:
                self._live.stop()  # draws the last snapshot once more and leaves it on screen
            self._live = None
        elif self._latest is not None and self._latest is not self._logged:
            self._log(self._latest)
