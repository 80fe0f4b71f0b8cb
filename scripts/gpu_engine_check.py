"""Section (d) of gpu_check.py: the kvcli engine end to end on a CUDA GPU, random INT4 weights of
real architectures (no model files, as vLLM's load_format=dummy).

  correctness  triton vs torch attention backend on the same weights in fp32: teacher-forced logits
               over a chunked prompt and greedy tokens of a ragged batch (smollm2-135m shapes:
               GQA 3, head_dim 64, 30 layers); paged vs contiguous KV layout in the default bf16:
               identical greedy tokens.
  speed        decode tok/s at batch 1 (512-token prompt, 128 new tokens) on llama-3-8b shapes:
               kvcli INT4 (Triton GEMV + paged attention) against transformers `generate` with
               random bf16 weights of the same config; then 64 ShareGPT-shaped requests through
               the same KV budget, paged vs contiguous max-len reservations (`kvcli profile`).

Imports kvcli from this checkout (nothing has to be pip-installed); its engine needs torch and
numpy, and transformers is used only for the baseline (reported as skipped without it).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
Record = Callable[[str, str, Any, float, float], None]  # (kernel, case, dtype, err, tol)


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
    """The module kvcli lacks here, if any: the kernel sections need only torch and triton, and this
    one is skipped (not failed) where kvcli's own dependencies are not installed."""
    _import_kvcli()
    try:
        import kvcli.llm  # noqa: F401
        import kvcli.profile  # noqa: F401
    except ModuleNotFoundError as e:
        return e.name or str(e)
    return None


def _model_spec(name: str, smoke: bool, tmp: Path) -> str:
    """dummy:NAME, or in --cpu-smoke a 2-layer, 512-token-vocabulary cut of it (the interpreter is slow)."""
    if not smoke:
        return f"dummy:{name}"
    from kvcli.config import PRESETS

    f = tmp / f"{name}-tiny.json"
    f.write_text(json.dumps(dict(PRESETS[name], num_hidden_layers=2, vocab_size=512)))
    return f"dummy:{f}"


def check_engine_correctness(record: Record, smoke: bool) -> None:
    import torch

    _import_kvcli()
    from kvcli.config import SamplingParams
    from kvcli.step import ScheduledChunk, SchedulerOutput
    from kvcli.llm import LLM

    with tempfile.TemporaryDirectory() as tmp:
        spec = _model_spec("smollm2-135m", smoke, Path(tmp))
        vocab = 512 if smoke else 49152
        n_prompt, chunk, new = (45, 20, 4) if smoke else (700, 256, 48)
        ids = [(i * 7919) % (vocab - 3) + 3 for i in range(n_prompt)]
        # Ragged prompts with no common prefix: prefix-cache hits would change batch shapes between runs.
        lens = (19, 3, 33) if smoke else (700, 17, 301, 64)
        prompts = [[(i * p + 11 * j + 1) % (vocab - 3) + 3 for i in range(n)]
                   for j, (n, p) in enumerate(zip(lens, (104729, 7907, 15485863, 32452843)))]

        logits, greedy = {}, {}
        for backend in ("torch", "triton"):
            # On CPU the INT4 matmul runs in bf16, whose rounding would swamp attention differences.
            llm = LLM(spec, kv_budget="64MiB" if smoke else "2GiB", attention_backend=backend, dtype="fp32",
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
            llm = LLM(spec, kv_budget="64MiB" if smoke else "2GiB", kv_layout=layout, max_model_len=1024,
                      max_num_batched_tokens=chunk)
            outs[layout] = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True))]
            dtype = llm.engine.kv_dtype.storage
            del llm
        mismatch = sum(a != b for a, b in zip(outs["paged"], outs["contiguous"]))
        record("engine", f"greedy tokens paged vs contiguous layout, {len(prompts)} prompts x {new}", dtype,
               float(mismatch), 0.0)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _decode_tok_s(generate: Callable[[int], Any], new: int, repeats: int) -> tuple[float, float]:
    """(decode tok/s, prefill s): (N - 1) / (t_N - t_1), best of `repeats`, prefill excluded, the
    method of the decode figure (kvcli/bench/batch1.py; its timer is the benchmark harness's)."""
    from kvcli.bench.harness import best

    generate(new)  # warm-up: compiles, allocator
    t1, tn = best(lambda: generate(1), repeats), best(lambda: generate(new), repeats)
    return (new - 1) / (tn - t1), t1


def bench_engine(smoke: bool, quick: bool, deadline: Deadline, out: dict[str, Any] | None = None,
                 progress: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Fills `out` step by step (calling progress() after each), so a caller that catches an error
    here, or a process killed at its cap after a progress() call, keeps what was measured."""
    import torch

    _import_kvcli()
    from kvcli.config import PRESETS, SamplingParams
    from kvcli.engine.llm_engine import EngineOptions, LLMEngine
    from kvcli.llm import LLM
    from kvcli.model.loader import load_weights
    from kvcli.profile import run_trace
    from kvcli.workloads import prompt_ids, synthetic

    name = "llama-3-8b"
    prompt_len, new = (24, 6) if smoke else (512, 128)
    max_len = 128 if smoke else 2048
    out = {} if out is None else out
    out.update(model=name, prompt_len=prompt_len, new=new, max_len=max_len, decode=[], profile=[], notes=[],
               repeats=1 if smoke else 2)
    progress()
    with tempfile.TemporaryDirectory() as tmp:
        spec = _model_spec(name, smoke, Path(tmp))
        t = time.perf_counter()
        loaded = load_weights(spec)
        print(f"  random INT4 weights of {name}: {time.perf_counter() - t:.1f} s", flush=True)
        ids = [(i * 7919) % 500 + 3 for i in range(prompt_len)]

        # On CPU (--cpu-smoke) the speed part walks the code with the torch backend: the interpreter
        # would take minutes; the kernels were exercised by the correctness part.
        backend = "torch" if smoke else "auto"
        engine = LLMEngine(loaded, EngineOptions(kv_budget="64MiB" if smoke else "8GiB", max_model_len=2048,
                                                 attention_backend=backend))
        llm = LLM.from_engine(engine)  # weights loaded once, shared with the profile engines below

        def kv_gen(n: int) -> Any:
            return llm.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True))

        repeats = out["repeats"]
        tok_s, prefill = _decode_tok_s(kv_gen, new, repeats)
        wbytes = sum(engine.weight_bytes().values())
        out["decode"].append(dict(side=f"kvcli INT4 ({engine.linear_mode} linears, {engine.backend.name} attention)",
                                  tok_s=tok_s, prefill_s=prefill, weight_bytes=wbytes))
        print(f"  kvcli decode batch 1: {tok_s:.1f} tok/s (prefill {prompt_len} tokens {prefill * 1e3:.0f} ms), "
              f"weights {wbytes / 2**30:.2f} GiB", flush=True)
        progress()
        out["memory"] = _memory_line(engine)
        print(f"  memory probe: {out['memory']}", flush=True)
        progress()
        model = engine.model
        del llm, engine

        preset = dict(PRESETS[name], num_hidden_layers=2, vocab_size=512) if smoke else PRESETS[name]
        out["decode"].append(_hf_decode(preset, ids, new, "cpu" if smoke else "cuda", repeats))
        progress()

        # Same workload and KV budget through both layouts (weights shared between the two engines).
        n_req = 4 if smoke else 16 if quick else 64
        budget = "64MiB" if smoke else "4GiB"
        trace = synthetic("sharegpt", n_req, max_len, seed=0)
        prompts = prompt_ids(trace, loaded.tokenizer, 0)  # windows of the bundled sample text, as `kvcli profile`
        for layout in ("paged", "contiguous"):
            if deadline.left() < 20:
                out["notes"].append(f"{layout}: skipped, section time limit reached")
                continue
            eng = LLMEngine(loaded, EngineOptions(kv_budget=budget, max_model_len=max_len,
                                                  kv_layout=layout, attention_backend=backend), model=model)
            share = deadline.left() / (2 if layout == "paged" else 1)
            stop = Deadline(share)
            res = run_trace(eng, trace, prompts, layout, on_step=stop.check)
            out["profile"].append(dict(layout=layout, budget=budget, blocks=eng.num_blocks, requests=n_req,
                                       completed=res.completed, out_tokens=res.output_tokens, wall_s=res.wall_s,
                                       tok_s=res.tokens_per_s, peak=res.peak_running, preempt=res.preemptions,
                                       token_share=res.token_share_of_allocated))
            progress()
            r = out["profile"][-1]
            print(f"  profile {layout:10s}: {r['completed']}/{n_req} requests, {r['tok_s']:.0f} tok/s, peak "
                  f"{r['peak']} concurrent, token states {100 * r['token_share']:.1f}% of allocated KV", flush=True)
            del eng
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def _memory_line(engine: Any) -> str:
    """What the live view's memory panel reads (NVML + torch allocator on CUDA), with the engine resident."""
    from kvcli.metrics.memory import MemoryProbe

    probe = MemoryProbe(str(engine.device))
    try:
        m = probe.sample(kv_pool_bytes=engine.kv_pool_bytes, weight_bytes=sum(engine.weight_bytes().values()))
    finally:
        probe.close()

    def gib(x: int | None) -> str:
        return "n/a" if x is None else f"{x / 2**30:.2f} GiB"

    return (f"{m.device}: NVML {'found' if m.gpu_found else 'not found'}; device used {gib(m.device_used_bytes)} of "
            f"{gib(m.device_total_bytes)}, this process {gib(m.process_used_bytes)}, torch allocated "
            f"{gib(m.torch_allocated_bytes)} / reserved {gib(m.torch_reserved_bytes)}, KV pool {gib(m.kv_pool_bytes)}, "
            f"weights {gib(m.weight_bytes)}" + (f" ({m.note})" if m.note else ""))


def _hf_decode(preset: dict[str, Any], ids: list[int], new: int, device: str, repeats: int) -> dict[str, Any]:
    """transformers `generate`, greedy, random bf16 weights of the same config, same method."""
    import torch

    try:
        from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    except ImportError as e:
        return dict(side="transformers generate (bf16)", skipped=f"transformers not importable: {e}")
    try:
        cfg = AutoConfig.for_model(**preset)
        with torch.device(device):
            try:
                model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
            except TypeError:  # transformers < 4.56 names it torch_dtype
                model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16).eval()
        if next(model.parameters()).dtype != torch.bfloat16:  # an ignored keyword would time fp32 silently
            raise RuntimeError(f"transformers built the baseline in {next(model.parameters()).dtype}, not bfloat16")
        x = torch.tensor([ids], device=device)

        def gen(n: int) -> Any:
            gc = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)
            with torch.no_grad():
                return model.generate(x, attention_mask=torch.ones_like(x), generation_config=gc)

        tok_s, prefill = _decode_tok_s(gen, new, repeats)
        wbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001 - a baseline that cannot run is reported, not fatal
        return dict(side="transformers generate (bf16)", skipped=f"{type(e).__name__}: {e}"[:300])
    print(f"  transformers decode batch 1: {tok_s:.1f} tok/s, weights {wbytes / 2**30:.2f} GiB", flush=True)
    return dict(side="transformers generate (bf16, random weights)", tok_s=tok_s, prefill_s=prefill, weight_bytes=wbytes)


def render(perf: dict[str, Any]) -> list[str]:
    lines = ["## (d) the engine end to end (random INT4 weights of " + perf.get("model", "?") + ")", ""]
    if perf.get("skipped"):
        return lines + [f"Skipped: {perf['skipped']}", ""]
    if "new" not in perf:  # failed before measuring anything
        return lines + [f"Not completed: {perf.get('error', 'no result')}", ""]
    if perf.get("error"):
        lines += [f"**Not completed** (the rows below were measured before it): {perf['error']}", ""]
    n = perf["new"]
    lines += [f"Decode at batch 1, {perf['prompt_len']}-token prompt, {n} new tokens; tok/s = {n - 1} / (t_{n} - t_1), "
              f"best of {perf['repeats']} (prefill excluded).", "",
              "| side | decode tok/s | prefill + 1 token (ms) | weights GiB |", "| --- | --- | --- | --- |"]
    base = None
    for r in perf["decode"]:
        if "skipped" in r:
            lines.append(f"| {r['side']} | skipped: {r['skipped']} | | |")
            continue
        lines.append(f"| {r['side']} | {r['tok_s']:.1f} | {r['prefill_s'] * 1e3:.0f} | {r['weight_bytes'] / 2**30:.2f} |")
        base = base or r
    hf = [r for r in perf["decode"] if "skipped" not in r and r["side"].startswith("transformers")]
    if base and hf:
        lines += ["", f"kvcli / transformers decode: {base['tok_s'] / hf[0]['tok_s']:.2f}x."]
    if perf["profile"]:
        p0 = perf["profile"][0]
        lines += ["", f"{p0['requests']} ShareGPT-shaped requests (kvcli.workloads), max_model_len {perf['max_len']}, page 16, "
                  f"KV budget {p0['budget']} for both layouts; contiguous reserves max-len per request.", "",
                  "| layout | blocks | completed | output tokens | wall s | tok/s | peak concurrent | preemptions | token states / allocated KV |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in perf["profile"]:
            lines.append(f"| {r['layout']} | {r['blocks']} | {r['completed']}/{r['requests']} | {r['out_tokens']} | "
                         f"{r['wall_s']:.1f} | {r['tok_s']:.0f} | {r['peak']} | {r['preempt']} | "
                         f"{100 * r['token_share']:.1f}% |")
        if len(perf["profile"]) == 2 and all(r["tok_s"] for r in perf["profile"]):
            a, b = perf["profile"]
            lines += ["", f"paged / contiguous: throughput {a['tok_s'] / b['tok_s']:.2f}x, "
                      f"peak concurrency {a['peak'] / max(b['peak'], 1):.1f}x."]
    if perf.get("memory"):
        lines += ["", f"Memory probe (the live view's source) with the {perf['model']} engine resident: {perf['memory']}."]
    lines += [f"- {n}" for n in perf["notes"]]
    return lines + [""]
