"""`kvcli profile`: one trace, the same KV budget, paged against contiguous preallocation (and
against transformers), side by side."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvcli.commands.common import Fail, print_notes
from kvcli.engine.llm_engine import LLMEngine
from kvcli.engine.scheduler import KVBudgetTooSmall
from kvcli.options import ConfigError, EngineOptions
from kvcli.inputs import InputError, check_outputs, write_text_file
from kvcli.metrics.snapshot import draft_limit
from kvcli.model.loader import ModelLoadError, load_config, load_tokenizer, load_weights
from kvcli.profile import ProfileResult, breakdown_rows, plot_timeline, run_trace
from kvcli.view.figure_file import check_plot
from kvcli.workloads import WorkloadError, load as load_trace, prompt_ids


# A trace's requests and their prompts' token ids are built before the run and held in memory: ~1 KB and more a
# request, so tens of millions would exhaust a machine before the first step; a simulated 2,000 take seconds.
MAX_REQUESTS = 100_000


@dataclass(frozen=True)
class ProfileArgs:
    model: str | None
    workload: str
    num_requests: int
    request_rate: str
    seed: int
    compare: str  # none | contiguous | hf
    simulate: bool
    json_path: Path | None
    plot_path: Path | None
    quant: str
    live: bool
    options: EngineOptions
    kv_dtypes: tuple[str | None, ...] = (None,)  # --kv-dtype A,B: one run per format on the same trace
    endpoints: tuple[str, ...] = ()  # --endpoint URL: send the trace to these servers instead
    concurrency: int = 64  # --endpoint: most requests in flight per server
    api_key: str | None = None  # --endpoint: sent as a Bearer token


def parse_rate(text: str, fail: Fail) -> float:
    try:
        rate = float(text)
    except ValueError:
        fail(f"--request-rate: expected requests/s or inf (got {text!r})")
    if not rate > 0:  # inf (all at once) passes; 0, negatives, -inf and nan do not
        fail(f"--request-rate must be > 0 or inf (got {text})")
    return rate


def run_profile(a: ProfileArgs, fail: Fail) -> int:
    err = Console(stderr=True)
    options = a.options
    max_model_len = options.max_model_len or 2048
    rate = parse_rate(a.request_rate, fail)
    if a.compare not in ("none", "contiguous", "hf", "spec"):
        fail(f"--compare must be none, contiguous, hf or spec (got {a.compare})")
    if a.compare == "hf" and a.simulate:
        fail("--compare hf runs the model; it cannot be simulated")
    if a.num_requests <= 0:
        fail(f"--num-requests must be a positive integer (got {a.num_requests})")
    if a.num_requests > MAX_REQUESTS:
        fail(f"--num-requests {a.num_requests:,}: at most {MAX_REQUESTS:,} (every prompt's token ids are built before "
             f"the run and held in memory)")
    workload_file = Path(a.workload) if a.workload and Path(a.workload).is_file() else None
    check_plot(a.plot_path, fail)
    check_outputs((a.json_path, a.plot_path), fail, inputs=(workload_file,))
    if a.endpoints and (a.compare != "none" or a.simulate):
        fail("--endpoint sends the trace to running servers; it does not combine with --compare or --simulate")
    try:
        trace = load_trace(a.workload, a.num_requests, max_model_len, rate, a.seed)
    except WorkloadError as e:
        fail(str(e))
    if a.endpoints:
        from kvcli.commands.profile_endpoint import run_endpoint_profile

        return run_endpoint_profile(a.endpoints, a.concurrency, trace, a.model, a.seed, a.json_path, a.plot_path,
                                    fail, api_key=a.api_key)

    layout0 = options.kv_layout
    runs = [options]
    if a.compare == "contiguous":
        runs.append(replace(options, kv_layout="contiguous" if layout0 == "paged" else "paged"))
    elif a.compare == "spec":  # the same trace with speculation switched the other way
        runs.append(replace(options, speculate="ngram" if options.speculate == "none" else "none"))
    results: list[ProfileResult] = []
    try:
        with err.status("loading model…" if not a.simulate else "reading model config…", spinner="dots"):
            if a.simulate:
                config, loaded = load_config(a.model), None
            else:
                loaded = load_weights(a.model, quant=a.quant)
                config = loaded.config
        if loaded is not None:
            print_notes(loaded.notes)
        tokenizer = loaded.tokenizer if loaded is not None else (
            load_tokenizer(a.model) if any(r.prompt_text is not None for r in trace.requests) else None)
        prompts = prompt_ids(trace, tokenizer, a.seed)
        if options.kv_window is None and any(len(p) >= max_model_len for p in prompts):
            fail(f"a trace prompt has {max(map(len, prompts))} tokens; --max-model-len is {max_model_len}")
        model = None
        for base, dtype in [(base, d) for base in runs for d in a.kv_dtypes]:
            opts = base if dtype is None else replace(base, kv_dtype=dtype)
            layout = opts.kv_layout
            engine = LLMEngine(loaded, opts, config=config, model=model)
            model = engine.model
            kv_dtype = str(engine.kv_dtype)
            label = layout if layout == "paged" else f"contiguous ({options.reserve})"
            if len(a.kv_dtypes) > 1:
                label += f" {kv_dtype}"
            if opts.speculate != "none":
                limit = draft_limit(opts.num_speculative_tokens, opts.draft_length == "adaptive")
                label += f" + {opts.speculate} {limit}"
            err.print(f"[dim]{label}: {engine.num_blocks:,} blocks x {options.block_size} tokens = "
                      f"{engine.kv_pool_bytes / 2**20:,.1f} MiB KV ({engine.kv_dtype}) · {len(prompts)} requests"
                      f"{' · simulated' if a.simulate else ''}[/dim]")
            results.append(_run_one(engine, trace, prompts, label, a, err))
            del engine
    except (ModelLoadError, ConfigError, KVBudgetTooSmall) as e:
        fail(str(e))

    hf = None
    if a.compare == "hf":
        hf = _compare_hf(results[0], trace, prompts, a, err, fail)

    out = Console()
    out.print(_table(results, trace, a))
    if hf:
        out.print(hf)
    if a.json_path is not None:
        report = {"trace": {"name": trace.name, "num_requests": len(trace.requests),
                            "mean_prompt_tokens": trace.mean_prompt, "mean_output_tokens": trace.mean_output,
                            "request_rate": a.request_rate, "seed": a.seed},
                  "model": config.name, "max_model_len": max_model_len, "block_size": options.block_size,
                  "kv_dtype": kv_dtype if len(a.kv_dtypes) == 1 else ",".join(r.kv_dtype for r in results),
                  "runs": [r.to_dict() for r in results]}
        try:
            write_text_file(a.json_path, json.dumps(report, indent=1))
        except InputError as e:  # the table is already on stdout
            fail(str(e))
    if a.plot_path is not None:
        try:
            plot_timeline(results, str(a.plot_path))
        except OSError as e:
            fail(f"{a.plot_path}: cannot write ({e.strerror or e})")
    return 130 if any(r.completed < r.num_requests for r in results) else 0


def _run_one(engine: LLMEngine, trace, prompts, label: str, a: ProfileArgs, err: Console) -> ProfileResult:
    # A terminal gets the dashboard; a pipe or --no-live gets a plain log line every 2 s.
    use_live = a.live and err.is_terminal
    from kvcli.metrics.memory import MemoryProbe
    from kvcli.view.dashboard import LiveDashboard

    from kvcli.metrics.window import WindowTracker

    probe = MemoryProbe(str(engine.device))
    weights = sum(engine.weight_bytes().values())
    window = WindowTracker(engine)  # a bounded cache's recycled blocks, marked on the map
    last = [0.0]
    with LiveDashboard(err, live=use_live) as dash:
        def on_step(e: LLMEngine) -> None:
            window.observe()
            now = time.perf_counter()
            if now - last[0] >= 0.2:  # snapshots cost a block-map walk: a few per second is plenty
                last[0] = now
                dash.update(window.snapshot(probe.sample(e.kv_pool_bytes, weights), block_map=True))

        return run_trace(engine, trace, prompts, label, on_step=on_step)


def _table(results: list[ProfileResult], trace, a: ProfileArgs) -> Table:
    t = Table(title=f"kvcli profile · {trace.name}: {len(trace.requests)} requests, mean prompt "
                    f"{trace.mean_prompt:.0f} / output {trace.mean_output:.0f} tokens · max_model_len "
                    f"{a.options.max_model_len or 2048} · same KV budget" + (" · simulated" if a.simulate else ""),
              title_justify="left")
    t.add_column("% of KV memory in use / metric")
    for r in results:
        t.add_column(r.label, justify="right")
    for name, cells in breakdown_rows(results):
        t.add_row(name, *cells)
    if (len(results) == 2 and a.compare == "contiguous" and results[1].peak_running
            and results[0].kv_dtype == results[1].kv_dtype):
        t.add_row("peak concurrency ratio", f"{results[0].peak_running / results[1].peak_running:.1f}x", "1.0x")
    return t


def _compare_hf(result: ProfileResult, trace, prompts, a: ProfileArgs, err: Console, fail: Fail):
    try:
        from kvcli.bench.hf_baselines import load_hf_reference, run_hf_baselines
    except ImportError:
        fail("--compare hf needs kvcli.bench.hf_baselines")
    from kvcli.model.loader import bundled_gguf_path

    if a.model and not a.model.endswith(".gguf"):
        fail("--compare hf runs transformers on a GGUF (the bundled model or --model FILE.gguf)")
    path = Path(a.model) if a.model else bundled_gguf_path()
    with err.status("transformers baselines…", spinner="dots"):
        model = load_hf_reference(path)
        base = run_hf_baselines(model, prompts, [r.max_tokens for r in trace.requests])
    t = Table(title="throughput against transformers (same weights, same trace)", title_justify="left")
    for c in ("engine", "output tok/s", "kvcli speed-up"):
        t.add_column(c, justify="right" if c != "engine" else "left")
    t.add_row(f"kvcli ({result.label})", f"{result.tokens_per_s:,.1f}", "1.0x")
    for name, b in base.items():
        rate = b.tokens_per_s
        t.add_row(f"transformers {name}", "n/a" if not rate else f"{rate:,.1f}",
                  "n/a" if not rate else f"{result.tokens_per_s / rate:.1f}x")
    return t

