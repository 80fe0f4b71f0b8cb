"""Run a trace through an engine and summarise it: the KV memory breakdown averaged over steps,
peak concurrency, throughput, latencies, preemptions. Used by `kvcli profile` and the tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvcli.config import SamplingParams
from kvcli.engine.llm_engine import LLMEngine
from kvcli.metrics.collector import StepRecord
from kvcli.metrics.snapshot import SpecSummary, WindowSummary
from kvcli.metrics.window import window_summary
from kvcli.view.figure_file import save_figure
from kvcli.workloads import Trace

CATEGORIES = ("token_bytes", "reserved_bytes", "internal_bytes", "external_bytes")


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


@dataclass
class ProfileResult:
    layout: str
    label: str
    num_requests: int
    completed: int
    output_tokens: int
    wall_s: float
    steps: int
    peak_running: int
    preemptions: int
    kv_mean: dict[str, float]  # category -> mean bytes over steps with KV in use
    ttft_s: list[float]
    itl_s: list[float]
    pool_bytes: int
    records: list[StepRecord] = field(default_factory=list)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    simulated: bool = False
    kv_dtype: str = ""
    kv_bytes_per_token: int = 0
    spec: SpecSummary = field(default_factory=SpecSummary)
    window: WindowSummary | None = None  # the bounded cache (--kv-window) and what it dropped; None without

    def share(self, category: str) -> float:
        """A category as a share of the KV memory in use (token + reserved + internal + external)."""
        total = sum(self.kv_mean[c] for c in CATEGORIES)
        return self.kv_mean[category] / total if total else 0.0

    @property
    def token_share_of_allocated(self) -> float:
        alloc = sum(self.kv_mean[c] for c in ("token_bytes", "reserved_bytes", "internal_bytes"))
        return self.kv_mean["token_bytes"] / alloc if alloc else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    def to_dict(self, timeline: bool = True) -> dict:
        d = {
            "layout": self.layout, "label": self.label, "simulated": self.simulated,
            "num_requests": self.num_requests, "completed": self.completed, "output_tokens": self.output_tokens,
            "wall_seconds": round(self.wall_s, 4), "steps": self.steps, "output_tokens_per_s": round(self.tokens_per_s, 2),
            "peak_running": self.peak_running, "preemptions": self.preemptions, "kv_pool_bytes": self.pool_bytes,
            "kv_dtype": self.kv_dtype, "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_mean_bytes": {k: round(v) for k, v in self.kv_mean.items()},
            "kv_share_of_in_use": {k: round(self.share(k), 4) for k in CATEGORIES},
            "token_share_of_allocated": round(self.token_share_of_allocated, 4),
            "ttft_s": {"p50": percentile(self.ttft_s, 0.5), "p99": percentile(self.ttft_s, 0.99)},
            "itl_s": {"p50": percentile(self.itl_s, 0.5), "p99": percentile(self.itl_s, 0.99)},
            "speculation": {"method": self.spec.method, "k": self.spec.k, "proposed": self.spec.proposed,
                            "accepted": self.spec.accepted, "acceptance_rate": round(self.spec.acceptance_rate, 4),
                            "tokens_per_request_step": round(self.spec.tokens_per_request_step, 4)},
            "window": None if self.window is None else {
                "kv_window": self.window.window, "sink_tokens": self.window.sink_tokens,
                "sink_slots": self.window.sink_slots, "max_slots": self.window.max_slots,
                "dropped_tokens": self.window.dropped_tokens, "recycled_blocks": self.window.recycled_blocks,
                "kv_tokens_peak": self.window.peak_tokens},
        }
        if timeline:
            d["timeline"] = [
                {"step": r.step, "t": round(r.time_s, 4), "running": r.num_running, "waiting": r.num_waiting,
                 "swapped": r.num_swapped, "preemptions": r.num_preemptions, "tokens": r.num_tokens,
                 **{k: r.kv.__dict__[k] for k in (*CATEGORIES, "free_bytes")}}
                for r in self.records]
        return d


def run_trace(engine: LLMEngine, trace: Trace, prompts: list[list[int]], label: str,
              on_step: Callable[[LLMEngine], None] | None = None, check_invariants: bool = False) -> ProfileResult:
    """Feed requests at their arrival times (wall clock; engine steps when simulating) and step the
    engine until all finish. KeyboardInterrupt stops early; what finished is still reported."""
    pending = sorted(zip(trace.requests, prompts), key=lambda x: x[0].arrival_s)
    ids: list[str] = []
    t0 = time.perf_counter()
    engine.metrics.start = t0
    i = 0
    ticks = 0  # a simulated run's clock: engine steps plus idle ticks between arrivals

    def now() -> float:
        return float(ticks) if engine.simulated else time.perf_counter() - t0

    try:
        while i < len(pending) or engine.has_unfinished():
            while i < len(pending) and pending[i][0].arrival_s <= now():
                req, ids_ = pending[i]
                r = engine.add_request(ids_, SamplingParams(max_tokens=req.max_tokens, ignore_eos=True),
                                       arrival_time=t0 + req.arrival_s if not engine.simulated else None)
                ids.append(r.req_id)
                i += 1
            ticks += 1
            if not engine.has_unfinished():
                if not engine.simulated:
                    time.sleep(min(0.05, max(0.0, pending[i][0].arrival_s - now())))
                continue
            engine.step()
            if check_invariants:
                engine.kv.check_invariants()
            if on_step:
                on_step(engine)
    except KeyboardInterrupt:
        pass
    wall = time.perf_counter() - t0
    reqs = [engine.requests[r] for r in ids]
    done = [r for r in reqs if r.finished]
    recs = engine.metrics.records
    in_use = [r for r in recs if r.kv.allocated_bytes]
    kv_mean = {c: (sum(getattr(r.kv, c) for r in in_use) / len(in_use) if in_use else 0.0) for c in CATEGORIES}
    ttft = [r.first_token_time - r.arrival_time for r in reqs if r.first_token_time is not None]
    itl = [b - a for r in reqs for a, b in zip(r.token_times, r.token_times[1:])]
    return ProfileResult(
        layout=engine.kv.name, label=label, num_requests=len(trace.requests), completed=len(done),
        output_tokens=sum(len(r.output_token_ids) for r in reqs), wall_s=wall, steps=engine.stats().step,
        peak_running=engine.metrics.peak_running, preemptions=engine.scheduler.num_preemptions,
        kv_mean=kv_mean, ttft_s=ttft, itl_s=itl, pool_bytes=engine.kv_pool_bytes, records=list(recs),
        outputs={r.req_id: list(r.output_token_ids) for r in reqs}, simulated=engine.simulated,
        kv_dtype=str(engine.kv_dtype), kv_bytes_per_token=engine.config.kv_bytes_per_token(engine.kv_dtype),
        spec=engine.spec_summary(), window=window_summary(engine))


def plot_timeline(results: list[ProfileResult], path: str) -> None:
    """KV memory over time, stacked by category, one panel per run (headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(10, 3.2 * len(results)), sharex=False, squeeze=False)
    colors = {"token_bytes": "#2e7d32", "reserved_bytes": "#f9a825", "internal_bytes": "#c62828",
              "external_bytes": "#6a1b9a"}
    labels = {"token_bytes": "token states", "reserved_bytes": "reserved", "internal_bytes": "internal frag.",
              "external_bytes": "external frag."}
    for ax, res in zip(axes[:, 0], results):
        x = [r.step for r in res.records]
        ys = [[getattr(r.kv, c) / 2**20 for r in res.records] for c in CATEGORIES]
        ax.stackplot(x, *ys, labels=[labels[c] for c in CATEGORIES], colors=[colors[c] for c in CATEGORIES])
        ax.axhline(res.pool_bytes / 2**20, color="black", lw=0.8, ls="--", label="KV pool")
        ax.set_title(f"{res.label}: token states {res.share('token_bytes'):.1%} of KV in use, "
                     f"peak {res.peak_running} concurrent")
        ax.set_ylabel("KV MiB")
        ax.set_xlabel("engine step")
        ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def breakdown_rows(results: list[ProfileResult]) -> list[tuple[str, list[str]]]:
    """Rows of the side-by-side table, one column per run."""
    def pct(x: float) -> str:
        return f"{x:.1%}"

    def sec(x: float | None) -> str:
        return "n/a" if x is None else f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"

    sim = any(r.simulated for r in results)
    rows = [
        ("KV dtype, bytes/token", [f"{r.kv_dtype}, {r.kv_bytes_per_token:,}" for r in results]),
        ("token states", [pct(r.share("token_bytes")) for r in results]),
        ("reserved", [pct(r.share("reserved_bytes")) for r in results]),
        ("internal fragmentation", [pct(r.share("internal_bytes")) for r in results]),
        ("external fragmentation", [pct(r.share("external_bytes")) for r in results]),
        ("token states / allocated", [pct(r.token_share_of_allocated) for r in results]),
        ("peak concurrent requests", [str(r.peak_running) for r in results]),
        ("completed", [f"{r.completed}/{r.num_requests}" for r in results]),
        ("preemptions", [str(r.preemptions) for r in results]),
        ("engine steps", [str(r.steps) for r in results]),
    ]
    if any(r.window is not None for r in results):
        rows += [
            ("bounded KV (S + W)", [f"{r.window.sink_tokens} + {r.window.window:,}" if r.window else "off"
                                    for r in results]),
            ("tokens dropped", [f"{r.window.dropped_tokens:,}" if r.window else "0" for r in results]),
            ("blocks recycled", [f"{r.window.recycled_blocks:,}" if r.window else "0" for r in results]),
            ("KV tokens per request (peak)", [f"{r.window.peak_tokens:,} of <= {r.window.max_slots:,}" if r.window
                                              else "n/a" for r in results]),
        ]
    if any(r.spec.method != "none" for r in results):
        rows += [
            ("guesses accepted", [f"{pct(r.spec.acceptance_rate)} of {r.spec.proposed:,}" if r.spec.method != "none"
                                  else "off" for r in results]),
            ("tokens per step per request", [f"{r.spec.tokens_per_request_step:.2f}" for r in results]),
        ]
    if not sim:
        rows += [
            ("output tokens/s", [f"{r.tokens_per_s:,.1f}" for r in results]),
            ("TTFT p50 / p99", [f"{sec(percentile(r.ttft_s, .5))} / {sec(percentile(r.ttft_s, .99))}" for r in results]),
            ("ITL p50 / p99", [f"{sec(percentile(r.itl_s, .5))} / {sec(percentile(r.itl_s, .99))}" for r in results]),
        ]
    return rows

