"""One-line progress log for non-terminal output (a file, a CI log), plus the small number and
statistic formatters that the dashboard shares with it so both show the same values."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence

from kvcli.metrics.snapshot import KVBreakdown, Snapshot


def human_bytes(n: float | None) -> str:
    """Binary units, one decimal: 1536 -> '1.5 KiB'; None -> 'n/a'."""
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def same_destination(a, b) -> bool:
    """Whether two streams write to one place (a terminal, a file or pipe that `2>&1` joined): lines written to
    one then show inside the other's."""
    try:
        return os.path.samestat(os.fstat(a.fileno()), os.fstat(b.fileno()))
    except (AttributeError, OSError, ValueError):
        return False


def pct(fraction: float) -> str:
    return f"{fraction * 100:.1f}%"


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method) of unsorted values; None if empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ttft_values(s: Snapshot) -> list[float]:
    return [r.ttft_s for r in s.requests if r.ttft_s is not None]


def itl_values(s: Snapshot) -> list[float]:
    return [x for r in s.requests for x in r.itl_s]


def current_tok_s(s: Snapshot) -> float:
    return s.tokens_per_s[-1] if s.tokens_per_s else 0.0


def seconds(x: float | None) -> str:
    """Latencies: '0.21s' above 100 ms, '12.3ms' below; 'n/a' when there is no sample yet."""
    if x is None:
        return "n/a"
    return f"{x:.2f}s" if x >= 0.1 else f"{x * 1000:.1f}ms"


def kv_shares(kv: KVBreakdown) -> Iterable[tuple[str, float]]:
    """The non-zero categories of the breakdown, as shares of allocated KV memory."""
    for part, label in (("token_bytes", "tokens"), ("reserved_bytes", "reserved"),
                        ("internal_bytes", "internal"), ("external_bytes", "external")):
        share = kv.share_of_allocated(part)
        if share or part in ("token_bytes", "internal_bytes"):
            yield label, share


def format_log_line(s: Snapshot) -> str:
    """e.g. 'step 120 · running 3 waiting 1 · KV 42.0% of pool: 96.9% tokens 3.1% internal ·
    71.2 tok/s · TTFT p50 0.21s' (one line, no markup)."""
    kv = s.kv
    pool_use = kv.allocated_bytes / kv.total_bytes if kv.total_bytes else 0.0
    shares = " ".join(f"{pct(v)} {label}" for label, v in kv_shares(kv))
    parts = [
        f"step {s.step}",
        f"running {s.num_running} waiting {s.num_waiting}"
        + (f" preempted {s.num_preempted}" if s.num_preempted else ""),
        f"KV {pct(pool_use)} of pool: {shares}",
        f"{current_tok_s(s):.1f} tok/s",
        f"TTFT p50 {seconds(percentile(ttft_values(s), 50))}",
    ]
    if s.spec.method != "none":
        parts.append(f"spec {pct(s.spec.acceptance_rate)} accepted, {s.spec.tokens_per_request_step:.2f} tok/step/req")
    if s.window is not None:
        parts.append(f"window S {s.window.sink_tokens} + W {s.window.window:,}: {s.window.dropped_tokens:,} tokens "
                     f"dropped, {s.window.recycled_blocks:,} blocks recycled")
    return " · ".join(parts)
