"""The dashboard for a server watched through /metrics (`kvcli watch URL`): the panels its metrics
allow, built from the dashboard's own pieces. Every server gets KV usage and blocks over time,
requests, throughput and latency percentiles (from its histograms); a `kvcli serve` server also gets
the fragmentation panel with the contiguous what-if, rendered by the same code as the local view."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from kvcli.metrics.server import ServerSample, Timeline
from kvcli.metrics.snapshot import Snapshot
from kvcli.view.dashboard import NOTE, SPARK, _kv_table, fragmentation_panel, hbar, sparkline
from kvcli.view.plain_log import human_bytes, pct, seconds


def _num(x: float | None, fmt: str = "{:,.0f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def detail_snapshot(s: ServerSample) -> Snapshot | None:
    """A Snapshot carrying what kvcli's metrics say, for the local view's fragmentation panel."""
    d = s.detail
    if d is None:
        return None
    return Snapshot(step=0, time_s=s.t, layout="paged" if d.whatif is not None else "contiguous",
                    num_running=int(s.running or 0), num_waiting=int(s.waiting or 0),
                    num_preempted=int(s.preemptions or 0), kv=d.kv, contiguous_whatif=d.whatif,
                    whatif_fits=d.whatif_fits, blocks=None, memory=None, max_model_len=d.max_model_len,
                    block_size=d.block_size, num_blocks=s.blocks_total or 0, blocks_used=s.blocks_used or 0)


def usage_line(values: list[float], width: int) -> str:
    """Fractions 0..1 as ▁..█ on an absolute scale (a sparkline scales to its maximum: a near-empty
    cache would look full)."""
    return "".join(SPARK[min(len(SPARK) - 1, max(0, round(v * (len(SPARK) - 1))))] for v in values[-width:])


def kv_panel(tl: Timeline, width: int) -> Panel:
    s = tl.latest
    assert s is not None
    spark_w = max(8, width - 4 - 13)
    usage = tl.usage(spark_w)
    rows: list[tuple[str, str]] = []
    if s.kv_usage is not None:
        rows.append(("usage", f"{hbar(s.kv_usage, max(4, spark_w - 8))} {pct(s.kv_usage)}"))
        rows.append(("over time", usage_line(usage, spark_w) if usage else "no samples yet"))
    else:
        rows.append(("usage", "not exported by this server"))
    if s.blocks_total is not None:
        used = "n/a" if s.blocks_used is None else f"{s.blocks_used:,}"
        bs = s.cache_info.get("block_size") or (str(s.detail.block_size) if s.detail else None)
        rows.append(("blocks", f"{used} of {s.blocks_total:,}" + (f" x {bs} tokens" if bs else "")))
    if s.detail is not None:
        rows.append(("KV pool", f"{human_bytes(s.detail.pool_bytes)} · {s.detail.bytes_per_token:,} B/token"))
    if s.cache_info.get("cache_dtype"):
        rows.append(("KV dtype", s.cache_info["cache_dtype"]))
    return Panel(_kv_table(rows, width - 4), title="KV cache", title_align="left")


def traffic_panel(tl: Timeline, width: int) -> Panel:
    s = tl.latest
    assert s is not None
    spark_w = max(8, width - 4 - 13)
    tps = tl.tok_s(spark_w)
    ttft, itl = tl.since_start("ttft"), tl.since_start("itl")

    def q(h, p: float) -> str:
        return seconds(h.quantile(p)) if h is not None else "n/a"

    hit = tl.prefix_hit_rate()
    rows: list[tuple[str, str]] = [
        ("tok/s", sparkline(tps, spark_w) if tps else "no samples yet"),
        ("current", f"{tps[-1]:,.1f} tok/s (peak {max(tps):,.1f})" if tps else "n/a"),
        ("requests", f"running {_num(s.running)} · waiting {_num(s.waiting)}"),
        ("preemptions", _num(s.preemptions)),
        ("TTFT p50/p99", f"{q(ttft, .5)} / {q(ttft, .99)}" + (f" over {ttft.count:,.0f}" if ttft else "")),
        ("ITL p50/p99", f"{q(itl, .5)} / {q(itl, .99)}" + (f" over {itl.count:,.0f}" if itl else "")),
        ("prefix cache", "n/a" if hit is None else
         f"{pct(hit[0] / hit[1]) if hit[1] else '0.0%'} hit ({hit[0]:,.0f} of {hit[1]:,.0f} tokens)"),
        ("tokens", f"prompt {_num(s.prompt_tokens)} · generated {_num(s.generation_tokens)}"),
    ]
    return Panel(_kv_table(rows, width - 4), title="throughput & latency", title_align="left")


def render_server(tl: Timeline, status: str = "", width: int = 100) -> RenderableType:
    header = Text(no_wrap=True, overflow="ellipsis")
    header.append("kvcli watch", style="bold")
    s = tl.latest
    header.append(f" · {tl.url}")
    if s is not None:
        header.append(f" · {s.flavor} · {s.t:,.1f} s · {len(tl.series):,} samples")
    parts: list[RenderableType] = [header]
    if status:
        parts.append(Text(status, style=NOTE))
    if s is None:
        parts.append(Text("no metrics yet", style="dim"))
        return Group(*parts)
    left = width // 2
    top = Table.grid()
    top.add_column(width=left)
    top.add_column(width=width - left)
    top.add_row(kv_panel(tl, left), traffic_panel(tl, width - left))
    parts.append(top)
    snap = detail_snapshot(s)
    if snap is not None:
        parts.append(fragmentation_panel(snap, width))
    elif s.flavor != "kvcli":
        parts.append(Text("the KV memory breakdown and the contiguous what-if need per-request lengths, which "
                          f"{s.flavor}'s metrics do not export", style="dim"))
    return Group(*parts)


def log_line(tl: Timeline, status: str = "") -> str:
    """One plain line per sample, for a pipe."""
    s = tl.latest
    if s is None:
        return f"kvcli watch {tl.url}: {status or 'no metrics yet'}"
    tps = tl.tok_s(1)
    kv = "n/a" if s.kv_usage is None else pct(s.kv_usage)
    line = (f"t={s.t:.1f}s kv={kv} blocks={_num(s.blocks_used)}/{_num(s.blocks_total)} "
            f"running={_num(s.running)} waiting={_num(s.waiting)} preemptions={_num(s.preemptions)} "
            f"tok/s={f'{tps[-1]:.1f}' if tps else 'n/a'}")
    return line + (f" · {status}" if status else "")
