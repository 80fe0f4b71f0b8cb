"""Throughput on one request trace: kvcli (paged KV cache, continuous batching, the whole trace submitted at
once) against transformers on the same GGUF weights, the same prompts and the same per-request output lengths
(`--compare hf`): `generate` one request at a time, static batches of --batch-size with left padding, and
continuous batching (`generate_batch`'s machinery) where the installed transformers has it.

Every request yields exactly its drawn max_tokens (EOS ignored on both sides, token counts checked). Output
tok/s = useful output tokens / wall time of the generation, model load excluded on both sides; static batches
also compute tokens past a request's max_tokens (the batch runs to its longest request), which are not counted.
Prints a markdown table with kvcli's speed-up over each baseline and one line per goal.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import sys
import time
from datetime import datetime, timezone

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from kvcli.bench.shapes import SHAPES, shape_file  # noqa: E402

GOALS = {"sequential": 10.0, "static": 2.0, "generate_batch": 3.0}
LABELS = {
    "sequential": "transformers `generate`, one request at a time",
    "static": "transformers `generate`, static batches of {bs} (left padding)",
    "generate_batch": "transformers continuous batching (`generate_batch`)",
}


def progress(mode: str, done: int, total: int) -> None:
    if sys.stderr.isatty():
        print(f"\r  {mode}: {done}/{total} requests", end="\n" if done == total else "", file=sys.stderr, flush=True)
    elif done == total or done % 16 == 0:
        print(f"  {mode}: {done}/{total} requests", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES),
                    help="a random-weight GGUF of a real shape (kvcli/bench/shapes.py) instead of the bundled model; "
                         "the transformers baselines are then off unless --compare hf asks for them")
    ap.add_argument("--kind", default="Q4_0", help="the shape file's tensor types (shapes.py KINDS; default Q4_0)")
    ap.add_argument("--workload", default="alpaca", help="sharegpt | alpaca | uniform | FILE.jsonl (default alpaca)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=16, help="static-batch size for transformers (default 16)")
    ap.add_argument("--modes", default="sequential,static,generate_batch",
                    help="comma-separated transformers baselines (default: all three)")
    ap.add_argument("--kv-budget", default="256MiB",
                    help="KV pool for kvcli and for transformers' continuous-batching cache (default 256MiB)")
    ap.add_argument("--compare", choices=("hf", "none"), default=None,
                    help="hf: run the transformers baselines (default for the bundled model); none: kvcli and "
                         "llama.cpp only (default with --shape)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads for both sides (default: torch's default, one per core)")
    ap.add_argument("--llama-cpp", choices=("auto", "none"), default="auto",
                    help="auto: also run llama.cpp with --parallel sequences where scripts/build_llama_cpp.sh built it")
    ap.add_argument("--parallel", type=int, default=16, help="llama.cpp sequences in flight (default 16)")
    ap.add_argument("--json", metavar="FILE", help="also write the numbers to FILE as JSON")
    a = ap.parse_args(argv)
    if a.threads is not None:
        if a.threads < 1:
            ap.error("--threads must be >= 1")
        torch.set_num_threads(a.threads)

    from kvcli import workloads
    from kvcli.config import SamplingParams
    from kvcli.bench.machine import cpu_isa, cpu_name, machine_line
    from kvcli.options import parse_bytes
    from kvcli.llm import LLM
    from kvcli.model.loader import bundled_gguf_path, load_config

    compare = a.compare or ("none" if a.shape else "hf")
    modes = [m.strip() for m in a.modes.split(",") if m.strip()] if compare == "hf" else []
    bad = [m for m in modes if m not in GOALS]
    if bad:
        ap.error(f"unknown mode(s) {', '.join(bad)} (choose from {', '.join(GOALS)})")
    try:
        kv_bytes = parse_bytes(a.kv_budget)
        trace = workloads.load(a.workload, a.num_requests, a.max_model_len, seed=a.seed)
        path = shape_file(a.shape, a.kind) if a.shape else bundled_gguf_path()
    except ValueError as e:
        ap.error(str(e))
    model_name = (f"random-weight {a.shape} llama shape, {a.kind} ({path.name})" if a.shape
                  else "SmolLM2-135M-Instruct Q4_1 GGUF")

    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None

    # --- kvcli: the whole trace at once ---------------------------------------------------------------------
    t = time.perf_counter()
    # No prefix caching: transformers has none, and shared prompt prefixes would skew the comparison.
    llm = LLM(str(path), max_model_len=a.max_model_len, kv_budget=a.kv_budget, max_num_batched_tokens=512, max_num_seqs=256,
              prefix_caching=False)
    load_s = time.perf_counter() - t
    prompts = workloads.prompt_ids(trace, llm.tokenizer, seed=a.seed)
    max_tokens = [r.max_tokens for r in trace.requests]
    mean_prompt = sum(len(p) for p in prompts) / len(prompts)
    mean_output = sum(max_tokens) / len(max_tokens)
    print(f"kvcli: loaded in {load_s:.1f} s ({llm.engine.linear_mode} weights); running {len(prompts)} requests",
          file=sys.stderr, flush=True)

    llm.generate([prompts[0]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up, untimed
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    kv_wall = time.perf_counter() - t
    wrong = [(i, len(o.token_ids), m) for i, (o, m) in enumerate(zip(outs, max_tokens)) if len(o.token_ids) != m]
    if wrong:
        print(f"error: kvcli produced the wrong number of tokens for {len(wrong)} request(s), e.g. request "
              f"{wrong[0][0]}: {wrong[0][1]} instead of {wrong[0][2]}", file=sys.stderr)
        return 1
    kv_tokens = sum(len(o.token_ids) for o in outs)
    kv_rate = kv_tokens / kv_wall
    preemptions = sum(o.num_preemptions for o in outs)
    linear_mode = llm.engine.linear_mode
    print(f"kvcli: {kv_tokens} tokens in {kv_wall:.2f} s ({kv_rate:.1f} tok/s)", file=sys.stderr, flush=True)
    del llm, outs
    gc.collect()

    # --- transformers, same weights, same prompts and lengths ---------------------------------------------------
    hf: dict = {}
    if modes:
        import transformers

        from kvcli.bench.hf_baselines import load_hf_reference, run_hf_baselines

        model = load_hf_reference(path)
        print(f"transformers {transformers.__version__}: running {', '.join(modes)}", file=sys.stderr, flush=True)
        hf = run_hf_baselines(model, prompts, max_tokens, batch_size=a.batch_size, modes=modes, progress=progress,
                              kv_budget_bytes=kv_bytes)

    # --- llama.cpp, same file, same token ids, --parallel sequences in one unified KV pool of the same bytes ------
    llama: dict | None = None
    llama_note = llama_build = ""
    if a.llama_cpp == "auto":
        from kvcli.bench.engines import LlamaCppEngine

        # f16 K and V for every layer and KV head: llama.cpp's default cache type.
        c = load_config(str(path))
        per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 2
        print(f"llama.cpp: running {len(prompts)} requests, {a.parallel} in parallel", file=sys.stderr, flush=True)
        lc = LlamaCppEngine(path=path)
        if lc.available:
            res = lc.trace(prompts, max_tokens, a.parallel, kv_bytes // per_token)
            llama = None if res is None else {"trace": res, "llama_cpp_version": res["llama_cpp_version"]}
        llama_note = lc.note
        llama_build = lc.version
        if llama is not None and llama["trace"]["output_tokens"] != kv_tokens:
            llama_note = f"llama.cpp produced {llama['trace']['output_tokens']} tokens instead of {kv_tokens}; not counted"
            llama = None

    # --- report -------------------------------------------------------------------------------------------------
    import transformers

    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    now = datetime.now(timezone.utc)
    command = "python -m kvcli.bench throughput" + ("" if not argv else " " + shlex.join(argv))
    print(f"# throughput benchmark — {now:%Y-%m-%d %H:%M} UTC")
    print(f"{machine_line()}; transformers {transformers.__version__}")
    if load_before is not None:
        busy = max(load_before, load_after) > (os.cpu_count() or 1)
        print(f"load average (1 min): {load_before:.2f} at start, {load_after:.2f} at end"
              + (" — more than one runnable task per core: other work shared the CPU, timings are not clean"
                 if busy else ""))
    print(f"command: {command}")
    print(f"trace: {trace.name}, {len(prompts)} requests, seed {a.seed}, all submitted at t=0; realised mean prompt "
          f"{mean_prompt:.1f} tokens, mean output {mean_output:.1f} tokens (EOS ignored), {kv_tokens} output tokens")
    print(f"model: {model_name}; kvcli {linear_mode} weights, KV pool {a.kv_budget}, "
          f"max_num_batched_tokens 512, max_num_seqs 256 ({preemptions} preemptions)"
          + ("; transformers fp32 (dequantized by its GGUF loader)" if modes else "") + ", greedy")
    if llama_build:
        print(llama_build)
    print()
    print("| engine | wall s | output tok/s | kvcli speed-up |")
    print("|---|---:|---:|---:|")
    print(f"| kvcli, whole trace at once (paged KV, continuous batching) | {kv_wall:.2f} | {kv_rate:.1f} | — |")
    ratios: dict[str, float | None] = {}
    for mode, r in hf.items():
        label = LABELS[mode].format(bs=a.batch_size)
        if r.tokens_per_s:
            ratios[mode] = kv_rate / r.tokens_per_s
            print(f"| {label} | {r.wall_seconds:.2f} | {r.tokens_per_s:.1f} | {ratios[mode]:.2f}x |")
        else:
            ratios[mode] = None
            print(f"| {label} | — | — | — |")
    if llama is not None:
        lt = llama["trace"]
        ratios["llama.cpp"] = kv_rate / lt["tok_s"]
        print(f"| llama.cpp {llama['llama_cpp_version']}, {lt['parallel']} parallel sequences, same file "
              f"(f16 KV) | {lt['wall_s']:.2f} | {lt['tok_s']:.1f} | {ratios['llama.cpp']:.2f}x |")
    notes = [(m, r.note) for m, r in hf.items() if r.note] + ([("llama.cpp", llama_note)] if llama_note else [])
    if notes:
        print()
        for mode, note in notes:
            print(f"- {mode}: {note}")
    print()
    goals = {}
    for mode, target in GOALS.items():
        if mode not in hf:
            status = "not run"
        elif ratios[mode] is None:
            status = f"not measured ({hf[mode].note})"
        else:
            status = f"{'met' if ratios[mode] >= target else 'missed'} (measured {ratios[mode]:.2f}x)"
        goals[mode] = {"target": target, "ratio": ratios.get(mode), "status": status}
        print(f"goal >= {target:g}x {mode}: {status}")
    if a.llama_cpp == "auto":
        r = ratios.get("llama.cpp")
        status = "not measured" if r is None else f"{'met' if r >= 2.0 else 'missed'} (measured {r:.2f}x)"
        goals["llama.cpp"] = {"target": 2.0, "ratio": r, "status": status}
        print(f"goal >= 2x llama.cpp parallel decoding: {status}")

    if a.json:
        report = {
            "date_utc": now.isoformat(timespec="seconds"),
            "machine": {"cpu": cpu_name(), "isa": cpu_isa(), "arch": platform.machine(), "cores": os.cpu_count(),
                        "torch_threads": torch.get_num_threads(), "loadavg_1min_start": load_before,
                        "loadavg_1min_end": load_after},
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
            "command": command,
            "trace": {"name": trace.name, "num_requests": len(prompts), "seed": a.seed,
                      "mean_prompt_tokens": mean_prompt, "mean_output_tokens": mean_output,
                      "prompt_lens": [len(p) for p in prompts], "max_tokens": max_tokens},
            "kvcli": {"wall_seconds": kv_wall, "output_tokens": kv_tokens, "tokens_per_s": kv_rate,
                      "linear_mode": linear_mode, "kv_budget": a.kv_budget, "preemptions": preemptions,
                      "load_seconds": load_s},
            "hf": {m: {"wall_seconds": r.wall_seconds, "output_tokens": r.output_tokens,
                       "computed_tokens": r.computed_tokens, "tokens_per_s": r.tokens_per_s, "note": r.note,
                       "kvcli_speedup": ratios[m]} for m, r in hf.items()},
            "llama_cpp": None if llama is None else {**llama["trace"], "version": llama["llama_cpp_version"]},
            "goals": goals,
        }
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 0
