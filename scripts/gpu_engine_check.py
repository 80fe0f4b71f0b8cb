"""Sections (g), (d) and (h) of gpu_check.py: the kvcli engine end to end on a CUDA GPU, random weights of
real architectures drawn on the GPU (no model files, as vLLM's load_format=dummy).

  (g) graphs       decode with and without CUDA graphs on llama-3-8b shapes (random INT4): batch 1 and
                   batch 32, 512-token prompts, 128 new tokens; decode tok/s and ms per step.
  (d) engine       correctness: triton vs torch attention backend on the same weights in fp32 (teacher-forced
                   logits over a chunked prompt, greedy tokens of a ragged batch; smollm2-135m shapes), paged
                   vs contiguous KV layout (greedy tokens, bf16), a decode step replayed from a CUDA graph vs
                   the same step eager, and greedy generation with and without graphs (fp32).
                   speed: 64 ShareGPT-shaped requests through one KV budget, paged vs contiguous max-len
                   reservations (`kvcli profile`'s run_trace, llama-3-8b shapes), the KV memory breakdown, a
                   capture of the live view (NVML, torch allocator, block map) during the paged run.
  (h) transformers random bf16 weights of the same llama-3-8b config: `generate` decode at batch 1, then the
                   same trace three ways (one request at a time, static batches of 16, its continuous
                   batching), each mode time-limited (its rate is over what finished; the note says how much).

Imports kvcli from this checkout (nothing has to be pip-installed); its engine needs torch and numpy, and
transformers is needed only for (h) (reported as skipped without it).
"""

from __future__ import annotations

import io
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
Record = Callable[[str, str, Any, float, float], None]  # (kernel, case, dtype, err, tol)
MODEL = "llama-3-8b"
TRACE = dict(workload="sharegpt", requests=64, max_len=2048, seed=0, budget="4GiB")  # (d) and (h) share it
# (h): per-mode time limits, in the order run; static batches of HF_BATCH (a batch always runs to its end: the
# first GPU run's batch of 16 alone outlasted the section's cap)
HF_SECONDS = {"sequential": 10.0, "generate_batch": 20.0, "static": 10.0}
HF_BATCH = 4


class Deadline:
    """Stops long sections early (run_trace treats KeyboardInterrupt as 'report what finished')."""

    def __init__(self, seconds: float) -> None:
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()

    def check(self, *_: Any) -> None:
        if self.left() <= 0:
            raise KeyboardInterrupt


def _import_kvcli() -> None:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


def kvcli_missing() -> str | None:
    """The module kvcli lacks here, if any: the kernel sections need only torch and triton, and these
    are skipped (not failed) where kvcli's own dependencies are not installed."""
    _import_kvcli()
    try:
        import kvcli.llm  # noqa: F401
        import kvcli.profile  # noqa: F401
    except ModuleNotFoundError as e:
        return e.name or str(e)
    return None


def _config(name: str, smoke: bool) -> dict[str, Any]:
    """The preset's config, or in --cpu-smoke a 2-layer, 512-token-vocabulary cut of it (the interpreter is slow)."""
    from kvcli.config import PRESETS

    return dict(PRESETS[name], num_hidden_layers=2, vocab_size=512) if smoke else dict(PRESETS[name])


def _model_spec(name: str, smoke: bool, tmp: Path) -> str:
    """dummy:NAME, or in --cpu-smoke dummy:<the cut's config.json>."""
    if not smoke:
        return f"dummy:{name}"
    f = tmp / f"{name}-tiny.json"
    f.write_text(json.dumps(_config(name, smoke)))
    return f"dummy:{f}"


def _loaded(name: str, smoke: bool) -> Any:
    """Random INT4 weights of `name` drawn on the GPU (seconds for 8B; the CPU takes ~15 s), as dummy:NAME."""
    import torch

    from kvcli.config import ModelConfig
    from kvcli.model.loader import LoadedWeights, dummy_weights
    from kvcli.model.tokenizer import ByteTokenizer

    t = time.perf_counter()
    config = ModelConfig.from_hf_dict(_config(name, smoke), name=f"dummy:{name}")
    weights = dummy_weights(config, device="cuda" if torch.cuda.is_available() and not smoke else "cpu")
    print(f"  random INT4 weights of {name}: {time.perf_counter() - t:.1f} s", flush=True)
    return LoadedWeights(config, weights, ByteTokenizer(), f"dummy:{name}", {"random-int4": 1})


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------ correctness


def check_engine_correctness(record: Record, smoke: bool) -> None:
    import torch

    _import_kvcli()
    from kvcli.config import SamplingParams
    from kvcli.llm import LLM
    from kvcli.step import ScheduledChunk, SchedulerOutput

    with tempfile.TemporaryDirectory() as tmp:
        spec = _model_spec("smollm2-135m", smoke, Path(tmp))
        vocab = 512 if smoke else 49152
        n_prompt, chunk, new = (45, 20, 4) if smoke else (700, 256, 48)
        ids = [(i * 7919) % (vocab - 3) + 3 for i in range(n_prompt)]
        # Ragged prompts with no common prefix: prefix-cache hits would change batch shapes between runs.
        lens = (19, 3, 33) if smoke else (700, 17, 301, 64)
        prompts = [[(i * p + 11 * j + 1) % (vocab - 3) + 3 for i in range(n)]
                   for j, (n, p) in enumerate(zip(lens, (104729, 7907, 15485863, 32452843)))]
        budget = "64MiB" if smoke else "2GiB"

        logits, greedy = {}, {}
        for backend in ("torch", "triton"):
            # On CPU the INT4 matmul runs in bf16, whose rounding would swamp attention differences.
            llm = LLM(spec, kv_budget=budget, attention_backend=backend, dtype="fp32",
                      max_num_batched_tokens=chunk, dequantize=smoke)
            eng = llm.engine
            rows = []
            for pos in range(0, n_prompt, chunk):  # chunks that end mid-block, on top of a cached prefix
                part = ids[pos:pos + chunk]
                assert eng.kv.allocate("tf", pos + len(part), pos)
                step = SchedulerOutput([ScheduledChunk("tf", part, pos, eng.kv.block_table("tf"), True)])
                rows.append(eng.runner.execute(step, all_logits=True).logits.float().cpu())
            eng.kv.free("tf")
            logits[backend] = torch.cat(rows)
            greedy[backend] = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True))]
            del llm, eng
        ref = logits["torch"]
        err = float((logits["triton"] - ref).abs().max() / ref.abs().max())
        record("engine", f"logits triton vs torch backend, {n_prompt} tokens in chunks of {chunk}", torch.float32,
               err, 1e-3)
        mismatch = sum(a != b for a, b in zip(greedy["triton"], greedy["torch"]))
        record("engine", f"greedy tokens triton vs torch, {len(prompts)} prompts x {new}", torch.float32,
               float(mismatch), 0.0)

        # Default dtype (bf16 on a GPU), Triton backend; a budget big enough that both layouts run the
        # same batches, so the same kernels see the same inputs and only the block ids differ.
        outs = {}
        for layout in ("paged", "contiguous"):
            llm = LLM(spec, kv_budget=budget, kv_layout=layout, max_model_len=1024, max_num_batched_tokens=chunk)
            outs[layout] = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True))]
            dtype = llm.engine.kv_dtype.storage
            del llm
        mismatch = sum(a != b for a, b in zip(outs["paged"], outs["contiguous"]))
        record("engine", f"greedy tokens paged vs contiguous layout, {len(prompts)} prompts x {new}", dtype,
               float(mismatch), 0.0)
        check_graphs_correctness(record, spec, prompts, new, chunk, budget, smoke)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def check_graphs_correctness(record: Record, spec: str, prompts: list[list[int]], new: int, chunk: int,
                             budget: str, smoke: bool) -> None:
    """A decode step of 3 requests replayed from a CUDA graph (bucket 4: one padding row) against the same step
    eager, then greedy generation with and without graphs; fp32, Triton backend. In --cpu-smoke the graph
    path's static buffers run eagerly under the interpreter (nothing is captured)."""
    import torch

    from kvcli.config import SamplingParams
    from kvcli.kvcache.interface import blocks_for
    from kvcli.llm import LLM
    from kvcli.runner.cuda_graphs import DecodeGraphs
    from kvcli.runner.model_runner import build_metadata
    from kvcli.step import ScheduledChunk, SchedulerOutput

    opts = dict(kv_budget=budget, attention_backend="triton", dtype="fp32", max_num_batched_tokens=chunk,
                dequantize=smoke, max_model_len=1024)
    llm = LLM(spec, **opts)
    eng = llm.engine
    graphs = eng.runner.graphs
    if graphs is None:
        if torch.cuda.is_available():
            raise RuntimeError(f"the engine built no CUDA graphs: {eng.cuda_graphs}")
        graphs = DecodeGraphs(eng.model, eng.kv_cache, eng.backend, 8, blocks_for(1024, 16), capture=False)
        eng.runner.graphs = graphs
    rids = ["a", "b", "c"]
    for rid, p in zip(rids, prompts):
        p = p[:chunk]
        assert eng.kv.allocate(rid, len(p) + 1, 0)
        eng.runner.execute(SchedulerOutput([ScheduledChunk(rid, p, 0, eng.kv.block_table(rid), False)]))
    chunks = [ScheduledChunk(r, [100 + i], len(p[:chunk]), eng.kv.block_table(r), True)
              for i, (r, p) in enumerate(zip(rids, prompts))]
    got = graphs.run(chunks)
    if got is None:
        raise RuntimeError(f"the decode step did not run on a graph: {graphs.status}")
    got = got.clone()
    ids, pos, meta, rows = build_metadata(SchedulerOutput(chunks), eng.kv_cache.block_size, eng.device)
    want = eng.model.forward(ids, pos, eng.kv_cache, meta, eng.backend, torch.tensor(rows, device=eng.device))
    err = float((got - want).abs().max() / want.abs().max())
    record("cuda graphs", "decode step of 3 requests (bucket 4), graph vs eager logits", torch.float32, err, 1e-4)
    for r in rids:
        eng.kv.free(r)
    del llm, eng, graphs
    outs = {}
    for on in (True, False):
        llm = LLM(spec, cuda_graphs=on, **opts)
        outs[on] = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True))]
        print(f"  graphs {'on ' if on else 'off'}: {llm.engine.cuda_graphs}", flush=True)
        del llm
    mismatch = sum(a != b for a, b in zip(outs[True], outs[False]))
    record("cuda graphs", f"greedy tokens with vs without graphs, {len(prompts)} prompts x {new}", torch.float32,
           float(mismatch), 0.0)


# ------------------------------------------------------------------------------------------- (g) graphs


def _decode_tok_s(generate: Callable[[int], Any], new: int, repeats: int, batch: int = 1) -> tuple[float, float]:
    """(decode tok/s over the batch, prefill s): batch (N - 1) / (t_N - t_1), best of `repeats`, prefill
    excluded, the method of the decode figure (kvcli/bench/batch1.py; its timer is the benchmark harness's)."""
    from kvcli.bench.harness import best

    def timed(n: int) -> Callable[[], Any]:
        return lambda: (generate(n), _sync())

    timed(new)()  # warm-up: compiles, graph captures, allocator
    t1, tn = best(timed(1), repeats), best(timed(new), repeats)
    return batch * (new - 1) / (tn - t1), t1


def bench_graphs(smoke: bool, out: dict[str, Any] | None = None, progress: Callable[[], None] = lambda: None
                 ) -> dict[str, Any]:
    """Decode tok/s with and without CUDA graphs at batch 1 and 32, one engine each over the same weights,
    measured back to back per batch. Fills `out` step by step (progress() after each)."""
    _import_kvcli()
    from kvcli.config import SamplingParams
    from kvcli.engine.llm_engine import EngineOptions, LLMEngine
    from kvcli.llm import LLM

    prompt_len, new = (24, 6) if smoke else (512, 128)
    batches = (1, 4) if smoke else (1, 32)
    out = {} if out is None else out
    out.update(model=MODEL, prompt_len=prompt_len, new=new, rows=[], repeats=1 if smoke else 2)
    progress()
    loaded = _loaded(MODEL, smoke)
    backend = "torch" if smoke else "auto"  # --cpu-smoke walks the code; the interpreter would take minutes
    opts = dict(kv_budget="64MiB" if smoke else "6GiB", max_model_len=2048, attention_backend=backend,
                max_num_seqs=max(batches))
    on = LLMEngine(loaded, EngineOptions(**opts))
    off = LLMEngine(loaded, EngineOptions(cuda_graphs=False, **opts), model=on.model)
    out["weight_bytes"] = sum(on.weight_bytes().values())
    out["linears"] = f"{on.linear_mode} linears, {on.backend.name} attention"
    for batch in batches:
        prompts = [[(i * 7919 + 131 * b) % 500 + 3 for i in range(prompt_len)] for b in range(batch)]
        for label, eng in (("graphs", on), ("eager", off)):
            llm = LLM.from_engine(eng)
            tok_s, prefill = _decode_tok_s(
                lambda n: llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True)), new, out["repeats"],
                batch)
            out["rows"].append(dict(batch=batch, mode=label, tok_s=tok_s, step_ms=1e3 * batch / tok_s,
                                    prefill_s=prefill, status=eng.cuda_graphs))
            print(f"  decode batch {batch:<3d} {label:6s}: {tok_s:8.1f} tok/s ({1e3 * batch / tok_s:.2f} ms/step), "
                  f"{eng.cuda_graphs}", flush=True)
            progress()
    return out


def _head(title: str, perf: dict[str, Any]) -> tuple[list[str], bool]:
    """A section's heading and, where it did not finish, why: (lines, whether it was skipped altogether)."""
    lines = [f"## {title}", ""]
    if perf.get("skipped"):
        return lines + [f"Skipped: {perf['skipped']}", ""], True
    if perf.get("error"):
        lines += [f"**Not completed** (rows below were measured before it): {perf['error']}", ""]
    return lines, False


def render_graphs(perf: dict[str, Any]) -> list[str]:
    lines, skipped = _head(f"(g) decode with and without CUDA graphs (random INT4 weights of {perf.get('model', '?')})",
                           perf)
    if skipped:
        return lines
    if not perf.get("rows"):
        return lines + ["No rows measured.", ""]
    n = perf["new"]
    lines += [f"{perf.get('linears', '')}; {perf['prompt_len']}-token prompts, {n} new tokens per request; decode "
              f"tok/s = batch x {n - 1} / (t_{n} - t_1), best of {perf['repeats']} (prefill excluded); the two "
              "engines share the weights and run back to back per batch.", "",
              "| batch | decode | tok/s | ms per step | graphs / eager | CUDA graphs |", "| --- | --- | --- | --- | --- | --- |"]
    by = {(r["batch"], r["mode"]): r for r in perf["rows"]}
    for r in perf["rows"]:
        other = by.get((r["batch"], "eager"))
        ratio = f"{r['tok_s'] / other['tok_s']:.2f}x" if r["mode"] == "graphs" and other else ""
        lines.append(f"| {r['batch']} | {r['mode']} | {r['tok_s']:.1f} | {r['step_ms']:.2f} | {ratio} | {r['status']} |")
    return lines + [""]


# ------------------------------------------------------------------------------------------- (d) engine


def _warm(engine: Any, n: int) -> None:
    """n short requests whose outputs end one after another (batches n down to 1): kernel compiles and the
    decode graphs of every batch bucket happen here, not in the timed trace."""
    from kvcli.config import SamplingParams

    for i in range(n):
        engine.add_request([(7 * i + j) % 250 + 3 for j in range(24)], SamplingParams(max_tokens=i + 2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    _sync()


def _live_capture(engine: Any, probe: Any) -> str:
    """The live view's panels for this moment of the run, as text (what `kvcli continue/profile --live` draws)."""
    from rich.console import Console

    from kvcli.view.dashboard import render_dashboard

    snap = engine.snapshot(probe.sample(engine.kv_pool_bytes, sum(engine.weight_bytes().values())), block_map=True)
    console = Console(file=io.StringIO(), width=120, record=True, force_terminal=True, color_system=None)
    console.print(render_dashboard(snap, width=118, map_rows=10))
    return console.export_text()


def bench_engine(smoke: bool, quick: bool, deadline: Deadline, out: dict[str, Any] | None = None,
                 progress: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """The trace through both layouts in one KV budget, a live-view capture and the memory probe. Fills `out`
    step by step (progress() after each), so an error or a kill at the section's cap keeps what was measured."""
    import torch

    _import_kvcli()
    from kvcli.engine.llm_engine import EngineOptions, LLMEngine
    from kvcli.metrics.memory import MemoryProbe
    from kvcli.profile import CATEGORIES, run_trace
    from kvcli.workloads import prompt_ids, synthetic

    n_req = 4 if smoke else 16 if quick else TRACE["requests"]
    max_len = 128 if smoke else TRACE["max_len"]
    budget = "64MiB" if smoke else TRACE["budget"]
    out = {} if out is None else out
    out.update(model=MODEL, max_len=max_len, profile=[], notes=[], budget=budget, requests=n_req)
    progress()
    loaded = _loaded(MODEL, smoke)
    backend = "torch" if smoke else "auto"
    trace = synthetic(TRACE["workload"], n_req, max_len, seed=TRACE["seed"])
    prompts = prompt_ids(trace, loaded.tokenizer, 0)  # windows of the bundled sample text, as `kvcli profile`
    out["trace"] = dict(prompt_tokens=sum(len(p) for p in prompts),
                        output_tokens=sum(r.max_tokens for r in trace.requests),
                        max_output=max(r.max_tokens for r in trace.requests))
    model = None
    probe = MemoryProbe("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    try:
        for layout in ("paged", "contiguous"):
            if deadline.left() < 15:
                out["notes"].append(f"{layout}: skipped, section time limit reached")
                continue
            eng = LLMEngine(loaded, EngineOptions(kv_budget=budget, max_model_len=max_len, kv_layout=layout,
                                                  attention_backend=backend, max_num_seqs=n_req), model=model)
            model = eng.model
            t = time.perf_counter()
            _warm(eng, min(n_req, 64))
            warm_s = time.perf_counter() - t
            stop = Deadline(deadline.left() / (2 if layout == "paged" else 1) - 5)
            captured: list[str] = []

            def on_step(e: Any, layout: str = layout, captured: list[str] = captured) -> None:
                stop.check()
                if layout == "paged" and not captured and e.scheduler.stats().num_running >= min(n_req, 48) \
                        and e.stats().decode_tokens > 4 * n_req:
                    captured.append(_live_capture(e, probe))

            res = run_trace(eng, trace, prompts, layout, on_step=on_step)
            d = res.to_dict(timeline=False)
            out["profile"].append(dict(layout=layout, blocks=eng.num_blocks, completed=res.completed,
                                       out_tokens=res.output_tokens, wall_s=res.wall_s, tok_s=res.tokens_per_s,
                                       peak=res.peak_running, preempt=res.preemptions, steps=res.steps,
                                       token_share=res.token_share_of_allocated,
                                       shares={c: d["kv_share_of_in_use"][c] for c in CATEGORIES},
                                       ttft_p50=d["ttft_s"]["p50"], itl_p50=d["itl_s"]["p50"], warm_s=warm_s,
                                       graphs=eng.cuda_graphs))
            if captured:
                out["live"] = captured[0]
            if layout == "paged":
                out["memory"] = _memory_line(eng, probe)
                print(f"  memory probe: {out['memory']}", flush=True)
            progress()
            r = out["profile"][-1]
            print(f"  profile {layout:10s}: {r['completed']}/{n_req} requests, {r['tok_s']:.0f} tok/s, peak "
                  f"{r['peak']} concurrent, token states {100 * r['token_share']:.1f}% of allocated KV "
                  f"(warm-up {warm_s:.1f} s; {r['graphs']})", flush=True)
            del eng
    finally:
        probe.close()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def _memory_line(engine: Any, probe: Any) -> str:
    """What the live view's memory panel reads (NVML + torch allocator on CUDA), with the engine resident."""
    m = probe.sample(kv_pool_bytes=engine.kv_pool_bytes, weight_bytes=sum(engine.weight_bytes().values()))

    def gib(x: int | None) -> str:
        return "n/a" if x is None else f"{x / 2**30:.2f} GiB"

    return (f"{m.device}: NVML {'found' if m.gpu_found else 'not found'}; device used {gib(m.device_used_bytes)} of "
            f"{gib(m.device_total_bytes)}, this process {gib(m.process_used_bytes)}, torch allocated "
            f"{gib(m.torch_allocated_bytes)} / reserved {gib(m.torch_reserved_bytes)}, KV pool {gib(m.kv_pool_bytes)}, "
            f"weights {gib(m.weight_bytes)}" + (f" ({m.note})" if m.note else ""))


def render(perf: dict[str, Any]) -> list[str]:
    lines = ["## (d) the engine end to end (random INT4 weights of " + perf.get("model", "?") + ")", ""]
    if perf.get("skipped"):
        return lines + [f"Skipped: {perf['skipped']}", ""]
    if "max_len" not in perf:  # failed before measuring anything
        return lines + [f"Not completed: {perf.get('error', 'no result')}", ""]
    if perf.get("error"):
        lines += [f"**Not completed** (the rows below were measured before it): {perf['error']}", ""]
    if perf["profile"]:
        t = perf.get("trace", {})
        lines += [f"{perf['requests']} ShareGPT-shaped requests (kvcli.workloads, seed {TRACE['seed']}: "
                  f"{t.get('prompt_tokens', 0):,} prompt and {t.get('output_tokens', 0):,} output tokens, the longest "
                  f"output {t.get('max_output', 0)}), all arriving at once, EOS ignored; max_model_len "
                  f"{perf['max_len']}, page 16, KV budget {perf['budget']} for both layouts (bf16 KV); contiguous "
                  "reserves max-len per request. Each engine first ran a short warm-up trace (compiles, graph "
                  "captures), not timed.", "",
                  "| layout | blocks | completed | output tokens | wall s | tok/s | peak concurrent | preemptions | "
                  "steps | TTFT p50 s | ITL p50 ms | CUDA graphs |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in perf["profile"]:
            ttft = f"{r['ttft_p50']:.2f}" if r.get("ttft_p50") is not None else "-"
            itl = f"{1e3 * r['itl_p50']:.1f}" if r.get("itl_p50") is not None else "-"
            lines.append(f"| {r['layout']} | {r['blocks']} | {r['completed']}/{perf['requests']} | {r['out_tokens']} | "
                         f"{r['wall_s']:.1f} | {r['tok_s']:.0f} | {r['peak']} | {r['preempt']} | {r['steps']} | "
                         f"{ttft} | {itl} | {r['graphs']} |")
        lines += ["", "KV memory in use, mean over the run's steps (the four-way breakdown of `kvcli profile`):", "",
                  "| layout | token states | reserved, not yet written | internal fragmentation | external "
                  "fragmentation | token states / allocated |", "| --- | --- | --- | --- | --- | --- |"]
        for r in perf["profile"]:
            s = r["shares"]
            lines.append(f"| {r['layout']} | {100 * s['token_bytes']:.1f}% | {100 * s['reserved_bytes']:.1f}% | "
                         f"{100 * s['internal_bytes']:.1f}% | {100 * s['external_bytes']:.1f}% | "
                         f"{100 * r['token_share']:.1f}% |")
        if len(perf["profile"]) == 2 and all(r["tok_s"] for r in perf["profile"]):
            a, b = perf["profile"]
            lines += ["", f"paged / contiguous: throughput {a['tok_s'] / b['tok_s']:.2f}x, "
                      f"peak concurrency {a['peak'] / max(b['peak'], 1):.1f}x."]
    if perf.get("memory"):
        lines += ["", f"Memory probe (the live view's source) with the paged engine resident: {perf['memory']}."]
    if perf.get("live"):
        lines += ["", "The live view during the paged run (rich, 120 columns, rendered from the engine's snapshot "
                  "with the NVML probe):", "", "```", perf["live"].rstrip(), "```"]
    lines += [f"- {n}" for n in perf["notes"]]
    return lines + [""]


# ------------------------------------------------------------------------------------- (h) transformers


def bench_hf(smoke: bool, out: dict[str, Any] | None = None, progress: Callable[[], None] = lambda: None
             ) -> dict[str, Any]:
    """transformers on the same shapes: batch-1 decode, then (d)'s trace three ways, each mode time-limited."""
    import torch

    _import_kvcli()
    from kvcli.bench.hf_baselines import run_hf_baselines
    from kvcli.model.tokenizer import ByteTokenizer
    from kvcli.options import parse_bytes
    from kvcli.workloads import prompt_ids, synthetic

    out = {} if out is None else out
    out.update(model=MODEL, decode=None, modes=[], seconds={m: 1.0 if smoke else s for m, s in HF_SECONDS.items()})
    progress()
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    except ImportError as e:
        out["skipped"] = f"transformers not importable: {e}"
        return out
    import transformers

    out["version"] = transformers.__version__
    device = "cpu" if smoke else "cuda"
    cfg = AutoConfig.for_model(**_config(MODEL, smoke))
    t = time.perf_counter()
    with torch.device(device):
        try:
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
        except TypeError:  # transformers < 4.56 names it torch_dtype
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16).eval()
    if next(model.parameters()).dtype != torch.bfloat16:  # an ignored keyword would time fp32 silently
        raise RuntimeError(f"transformers built the baseline in {next(model.parameters()).dtype}, not bfloat16")
    out["weight_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    out["attn"] = getattr(model.config, "_attn_implementation", "?")
    print(f"  transformers {transformers.__version__} {MODEL} bf16 random weights: {time.perf_counter() - t:.1f} s, "
          f"attn {out['attn']}", flush=True)

    prompt_len, new = (24, 6) if smoke else (512, 128)
    x = torch.tensor([[(i * 7919) % 500 + 3 for i in range(prompt_len)]], device=device)

    def gen(n: int) -> Any:
        gc = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        with torch.no_grad():
            return model.generate(x, attention_mask=torch.ones_like(x), generation_config=gc)

    tok_s, prefill = _decode_tok_s(gen, new, 1)
    out["decode"] = dict(tok_s=tok_s, prefill_s=prefill, prompt_len=prompt_len, new=new)
    print(f"  transformers decode batch 1: {tok_s:.1f} tok/s", flush=True)
    progress()

    n_req = 4 if smoke else TRACE["requests"]
    max_len = 128 if smoke else TRACE["max_len"]
    trace = synthetic(TRACE["workload"], n_req, max_len, seed=TRACE["seed"])
    prompts = prompt_ids(trace, ByteTokenizer(), 0)  # (d)'s prompts: the dummy model's tokenizer is ByteTokenizer
    budget = parse_bytes("64MiB" if smoke else TRACE["budget"])
    out["batch_size"] = HF_BATCH
    for mode in HF_SECONDS:
        limit = out["seconds"][mode]
        r = run_hf_baselines(model, prompts, [q.max_tokens for q in trace.requests], batch_size=HF_BATCH, modes=(mode,),
                             kv_budget_bytes=budget, page_size=16 if smoke else 256, max_batch_tokens=512,
                             warmup=False, seconds_per_mode=limit)[mode]
        done = sum(1 for ids, q in zip(r.token_ids, trace.requests) if len(ids) == q.max_tokens)
        out["modes"].append(dict(mode=mode, tok_s=r.tokens_per_s, wall_s=r.wall_seconds, tokens=r.output_tokens,
                                 done=done, note=r.note))
        print(f"  transformers {mode}: {r.tokens_per_s or 0:.1f} tok/s over {done}/{n_req} requests ({r.note[:120]})",
              flush=True)
        progress()
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def render_hf(perf: dict[str, Any]) -> list[str]:
    lines, skipped = _head(f"(h) transformers on the same shapes (random bf16 weights of {perf.get('model', '?')})", perf)
    if skipped:
        return lines
    if perf.get("decode"):
        d = perf["decode"]
        lines += [f"transformers {perf.get('version', '?')}, attention `{perf.get('attn', '?')}`, weights "
                  f"{perf.get('weight_bytes', 0) / 2**30:.1f} GiB. `generate` at batch 1, {d['prompt_len']}-token "
                  f"prompt: {d['tok_s']:.1f} decode tok/s ({d['new'] - 1} / (t_{d['new']} - t_1), one run).", ""]
    if perf.get("modes"):
        lines += [f"(d)'s trace (same prompts and output lengths), each mode stopped after its time limit (the first "
                  f"request or batch always runs; static batches of {perf.get('batch_size', '?')}); tok/s = useful "
                  "output tokens of what finished / wall time.", "",
                  "| mode | limit s | requests finished | output tokens | wall s | tok/s | note |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in perf["modes"]:
            rate = f"{r['tok_s']:.1f}" if r.get("tok_s") else "-"
            wall = f"{r['wall_s']:.1f}" if r.get("wall_s") else "-"
            lines.append(f"| {r['mode']} | {perf['seconds'].get(r['mode'], '')} | {r['done']} | {r['tokens']} | {wall} | "
                         f"{rate} | {r['note']} |")
    return lines + [""]


def engine_goals(g: dict[str, Any] | None, d: dict[str, Any] | None, h: dict[str, Any] | None) -> list[str]:
    """Issue #28's engine goals judged on (g), (d) and (h)'s rows; a goal whose rows are missing says so."""
    out = ["## engine goals (issue #28), judged on the rows above", ""]
    rows = {(r["batch"], r["mode"]): r for r in (g or {}).get("rows", [])}
    if (1, "graphs") in rows and (1, "eager") in rows:
        x = rows[(1, "graphs")]["tok_s"] / rows[(1, "eager")]["tok_s"]
        out.append(f"- CUDA graphs, batch-1 decode of the 8B-shaped model >= 1.5x without: {x:.2f}x -> "
                   f"{'met' if x >= 1.5 else 'NOT met'}")
    else:
        out.append("- CUDA graphs >= 1.5x at batch 1: not measured")
    hf_decode = (h or {}).get("decode")
    if (1, "graphs") in rows and hf_decode:
        out.append(f"- kvcli / transformers decode at batch 1 (INT4 with graphs vs bf16 `generate`): "
                   f"{rows[(1, 'graphs')]['tok_s'] / hf_decode['tok_s']:.2f}x")
    prof = {r["layout"]: r for r in (d or {}).get("profile", [])}
    paged = prof.get("paged")
    if paged and prof.get("contiguous") and prof["contiguous"]["tok_s"]:
        x = paged["tok_s"] / prof["contiguous"]["tok_s"]
        out.append(f"- paged throughput >= 2x contiguous max-len preallocation, same trace and KV budget: {x:.2f}x -> "
                   f"{'met' if x >= 2 else 'NOT met'}")
    else:
        out.append("- paged >= 2x contiguous: not measured")
    seq = {r["mode"]: r for r in (h or {}).get("modes", [])}
    for mode, goal in (("sequential", 10.0), ("static", None), ("generate_batch", None)):
        r = seq.get(mode)
        if paged and r and r.get("tok_s"):
            x = paged["tok_s"] / r["tok_s"]
            verdict = f" -> {'met' if x >= goal else 'NOT met'} (goal >= {goal:g}x)" if goal else ""
            out.append(f"- kvcli paged / transformers {mode}: {x:.2f}x{verdict}")
        elif goal:
            out.append(f"- paged >= {goal:g}x transformers {mode}: not measured")
    return out + [""]
