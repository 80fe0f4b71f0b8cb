"""`kvcli profile --endpoint URL [--endpoint URL2 ...]`: the profile trace sent to running
OpenAI-compatible servers, one after the other (on one machine they would compete for it), measured
at the client and through each server's /metrics, side by side in one report."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvcli.commands.common import Fail
from kvcli.inputs import InputError, write_text_file
from kvcli.model.loader import ModelLoadError, load_tokenizer
from kvcli.profile import percentile
from kvcli.remote.loadgen import EndpointError, EndpointRun, model_id, run_endpoint
from kvcli.view.figure_file import save_figure
from kvcli.workloads import Trace, prompt_ids

MAX_CONCURRENCY = 1024


def server_summary(run: EndpointRun) -> dict:
    """What the server's own metrics said over the run."""
    s = run.timeline.samples
    first, last = (s[0], s[-1]) if s else (None, None)

    def peak(attr: str) -> float | None:
        vals = [getattr(x, attr) for x in s if getattr(x, attr) is not None]
        return max(vals) if vals else None

    def delta(attr: str) -> float | None:
        if first is None or getattr(first, attr) is None or getattr(last, attr) is None:
            return None
        return getattr(last, attr) - getattr(first, attr)

    out: dict = {"flavor": last.flavor if last else None, "samples": len(s), "scrape_errors": run.scrape_errors,
                 "peak_kv_usage": peak("kv_usage"), "peak_running": peak("running"), "peak_waiting": peak("waiting"),
                 "preemptions": delta("preemptions"), "kv_usage_after": last.kv_usage if last else None,
                 "blocks_used_after": last.blocks_used if last else None}
    q, h = delta("prefix_queries"), delta("prefix_hits")
    out["prefix_hit_rate"] = h / q if q and h is not None else None
    busy = [x.detail.kv for x in s if x.detail is not None and x.detail.kv.allocated_bytes]
    if busy:
        alloc = sum(k.allocated_bytes for k in busy)
        out["kv_token_share_of_allocated"] = sum(k.token_bytes for k in busy) / alloc
        out["kv_internal_share_of_allocated"] = sum(k.internal_bytes for k in busy) / alloc
        wi = [x.detail.whatif for x in s if x.detail is not None and x.detail.whatif is not None
              and x.detail.whatif.allocated_bytes]
        if wi:
            walloc = sum(k.allocated_bytes for k in wi)
            out["whatif_token_share_of_allocated"] = sum(k.token_bytes for k in wi) / walloc
    return out


def run_to_dict(run: EndpointRun, timeline: bool = True) -> dict:
    d = {"url": run.url, "model": run.model, "num_requests": len(run.results), "completed": run.completed,
         "failures": run.failures, "output_tokens": run.output_tokens, "wall_seconds": round(run.wall_s, 4),
         "output_tokens_per_s": round(run.tokens_per_s, 2),
         "ttft_s": {"p50": percentile(run.ttft, 0.5), "p99": percentile(run.ttft, 0.99)},
         "itl_s": {"p50": percentile(run.itl, 0.5), "p99": percentile(run.itl, 0.99)},
         "errors": sorted({r.error for r in run.results if r.error})[:10],
         "server_metrics": server_summary(run)}
    if timeline:
        d["timeline"] = run.timeline.series
    return d


def _table(runs: list[EndpointRun], trace: Trace, concurrency: int) -> Table:
    def sec(x: float | None) -> str:
        return "n/a" if x is None else f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"

    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.1%}"

    def num(x: float | None) -> str:
        return "n/a" if x is None else f"{x:,.0f}"

    t = Table(title=f"kvcli profile --endpoint · {trace.name}: {len(trace.requests)} requests, mean prompt "
                    f"{trace.mean_prompt:.0f} / output {trace.mean_output:.0f} tokens · concurrency <= {concurrency}",
              title_justify="left")
    t.add_column("metric")
    for r in runs:
        t.add_column(r.url, justify="right")
    sums = [server_summary(r) for r in runs]
    rows = [
        ("model", [r.model for r in runs]),
        ("completed / failed", [f"{r.completed}/{len(r.results)} · {r.failures}" for r in runs]),
        ("output tokens", [f"{r.output_tokens:,}" for r in runs]),
        ("wall time", [f"{r.wall_s:.2f} s" for r in runs]),
        ("output tokens/s", [f"{r.tokens_per_s:,.1f}" for r in runs]),
        ("TTFT p50 / p99", [f"{sec(percentile(r.ttft, .5))} / {sec(percentile(r.ttft, .99))}" for r in runs]),
        ("ITL p50 / p99", [f"{sec(percentile(r.itl, .5))} / {sec(percentile(r.itl, .99))}" for r in runs]),
        ("server (from /metrics)", [s["flavor"] or "no metrics" for s in sums]),
        ("peak KV usage", [pct(s["peak_kv_usage"]) for s in sums]),
        ("peak running / waiting", [f"{num(s['peak_running'])} / {num(s['peak_waiting'])}" for s in sums]),
        ("preemptions", [num(s["preemptions"]) for s in sums]),
        ("prefix-cache hit rate", [pct(s["prefix_hit_rate"]) for s in sums]),
        ("KV usage after the run", [pct(s["kv_usage_after"]) for s in sums]),
    ]
    if any("kv_token_share_of_allocated" in s for s in sums):
        rows += [("token states / allocated KV", [pct(s.get("kv_token_share_of_allocated")) for s in sums]),
                 ("internal fragmentation", [pct(s.get("kv_internal_share_of_allocated")) for s in sums]),
                 ("  contiguous what-if: token states", [pct(s.get("whatif_token_share_of_allocated")) for s in sums])]
    for name, cells in rows:
        t.add_row(name, *cells)
    return t


def plot_runs(runs: list[EndpointRun], path: str) -> None:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for r in runs:
        t = [x["t"] for x in r.timeline.series]
        axes[0].plot(t, [100 * (x["kv_usage"] or 0) for x in r.timeline.series], label=r.url)
        axes[1].plot(t, [x["tok_s"] or 0 for x in r.timeline.series], label=r.url)
    axes[0].set_ylabel("KV usage %")
    axes[1].set_ylabel("generated tok/s (server)")
    axes[1].set_xlabel("seconds since the trace began")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def run_endpoint_profile(endpoints: tuple[str, ...], concurrency: int, trace: Trace, model: str | None, seed: int,
                         json_path: Path | None, plot_path: Path | None, fail: Fail, api_key: str | None = None) -> int:
    if not 1 <= concurrency <= MAX_CONCURRENCY:
        fail(f"--concurrency must be in 1..{MAX_CONCURRENCY} (got {concurrency})")
    err = Console(stderr=True)
    models = {}
    for url in endpoints:  # every endpoint answers before the tokenizer loads and the first trace starts
        try:
            models[url] = model_id(url, api_key)
        except EndpointError as e:
            fail(str(e))
    try:
        tokenizer = load_tokenizer(model)
    except ModelLoadError as e:
        fail(str(e))
    prompts = prompt_ids(trace, tokenizer, seed)
    runs: list[EndpointRun] = []
    for url in endpoints:
        err.print(f"[dim]{url} ({models[url]}): {len(prompts)} requests, at most {concurrency} at once[/dim]")
        try:
            runs.append(asyncio.run(run_endpoint(url, trace, prompts, concurrency, model=models[url],
                                                 api_key=api_key)))
        except EndpointError as e:
            fail(str(e))
        except KeyboardInterrupt:
            fail("interrupted", 130)
    Console().print(_table(runs, trace, concurrency))
    if json_path is not None:
        report = {"trace": {"name": trace.name, "num_requests": len(trace.requests), "mean_prompt_tokens":
                            trace.mean_prompt, "mean_output_tokens": trace.mean_output, "seed": seed},
                  "concurrency": concurrency, "endpoints": [run_to_dict(r) for r in runs]}
        try:
            write_text_file(json_path, json.dumps(report, indent=1))
        except InputError as e:
            fail(str(e))
    if plot_path is not None:
        try:
            plot_runs(runs, str(plot_path))
        except OSError as e:
            fail(f"{plot_path}: cannot write ({e.strerror or e})")
    return 1 if any(r.failures for r in runs) else 0
