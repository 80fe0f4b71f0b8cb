"""Batch-1 generation on the bundled model, two figures from one module (the former scripts/bench_decode.py
and scripts/bench_cpu.py, whose kvcli and transformers sides were the same code):

  decode   kvcli INT4 resident, kvcli --dequantize (fp32) and transformers `generate` on the same GGUF
           weights at a 512-token prompt. Wall time of a greedy generation of 1 token and of N tokens from
           the same prompt; decode tok/s = (N - 1) / (t_N - t_1), so prefill is excluded. Best of --repeats
           after a warm-up.
  cpu      prefill and decode at 512 and 4k tokens of context: kvcli (INT4 resident), transformers and
           llama.cpp (the same Q4_1 file) on the same token ids. prefill tok/s = N / time to the first
           token from an empty cache; decode tok/s = (M - 1) / time from the first token to the last, both
           inside one generation. Rounds: each round runs every engine once per context (a slow phase of a
           shared VM then weighs on every engine alike); best of --repeats rounds after a warm-up.
           `cpu-avx2` is the same with torch, kvcli's C kernels and llama.cpp held to AVX2.
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Callable

from kvcli.bench.engines import HFEngine, KvcliEngine, LlamaCppEngine
from kvcli.bench.harness import best, busy_note, interleaved, load1, sample_text


def decode(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcli.bench decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engines", default="kvcli,kvcli-dequantize,transformers")
    a = ap.parse_args(argv)
    engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    sample = sample_text("keepers-log.txt")
    rows = []
    ids: list[int] = []

    def measure(eng) -> tuple[float, float]:
        eng.generate(ids, a.new_tokens)  # warm-up
        t1 = best(lambda: eng.generate(ids, 1), a.repeats)
        tn = best(lambda: eng.generate(ids, a.new_tokens), a.repeats)
        # t_N <= t_1 only in noise (a handful of new tokens on a loaded machine): no rate, rather than a negative one.
        return ((a.new_tokens - 1) / (tn - t1) if tn > t1 else float("nan")), t1

    labels = {"kvcli": ("kvcli, INT4 resident (default)", {}),
              "kvcli-dequantize": ("kvcli, --dequantize (fp32)", {"dequantize": True})}
    for name in engines:
        if name in labels:
            label, opts = labels[name]
            eng = KvcliEngine(name, **opts)
            if not ids:
                ids = eng.encode(sample)[: a.prompt_tokens]
        elif name == "transformers":
            label = "transformers generate (fp32, dequantized by its GGUF loader)"
            if not ids:
                from kvcli.llm import LLM

                ids = LLM(prefix_caching=False).tokenizer.encode(sample)[: a.prompt_tokens]
            eng = HFEngine()
        else:
            ap.error(f"unknown engine {name!r}")
        rate, t1 = measure(eng)
        rows.append((label, rate, t1, eng.weight_bytes()))
        del eng
        gc.collect()

    ref = rows[-1][1] if engines[-1] == "transformers" else None
    print(f"workload: SmolLM2-135M-Instruct Q4_1 GGUF, batch 1, {len(ids)}-token prompt, {a.new_tokens} new "
          "tokens, greedy\n")
    print("| engine | decode tok/s | vs transformers | time to 1st token (s) | weight bytes |")
    print("|---|---:|---:|---:|---:|")
    for label, rate, t1, wb in rows:
        vs = f"{rate / ref:.2f}x" if ref else "—"
        print(f"| {label} | {rate:.1f} | {vs} | {t1:.3f} | {wb / 2**20:.1f} MiB |")
    return 0


_EACH_ROUND = "(each round)"


def best_rounds(engines: dict, ids: list[int], contexts: list[int], new_tokens: int, rounds: int,
                notes: list[str], each_round: Callable[[], object] | None = None
                ) -> dict[str, dict[int, tuple[float, float]]]:
    """{engine: {context: (prefill tok/s, decode tok/s)}}, the best of `rounds` interleaved rounds (each engine
    once per round, every context; llama.cpp's worker one process per round). An engine whose every round
    failed (llama.cpp's worker) is left out, its note appended to `notes`. each_round, when given, runs first in
    every round (the roofline's bandwidth probe: a bound measured beside the runs it bounds, on a machine whose
    bandwidth moves between minutes)."""
    def measure(name: str, _round: int):
        if name == _EACH_ROUND:
            return each_round()
        eng = engines[name]
        if name == "llama.cpp":
            return eng.timed_many(ids, contexts, new_tokens)
        return {n: eng.timed(ids[:n], new_tokens) for n in contexts}

    results: dict[str, dict[int, tuple[float, float]]] = {}
    names = ([_EACH_ROUND] if each_round is not None else []) + list(engines)
    for name, samples in interleaved(names, rounds, measure).samples.items():
        if name == _EACH_ROUND:
            continue
        samples = [s for s in samples if s is not None]
        if not samples:
            notes.append(engines[name].note)
            continue
        decoded = new_tokens if name == "llama.cpp" else new_tokens - 1  # llama.cpp times m decode calls
        results[name] = {n: (n / min(s[n][0] for s in samples), decoded / min(s[n][1] for s in samples))
                         for n in contexts}
    return results


def cpu(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcli.bench cpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="512,4096", help="prompt lengths in tokens (default 512,4096)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--engines", default="kvcli,transformers,llama.cpp")
    a = ap.parse_args(argv)
    contexts = [int(x) for x in a.contexts.split(",")]
    names = [e.strip() for e in a.engines.split(",")]
    load_before = load1()
    max_len = max(contexts) + a.new_tokens + 16
    kv = KvcliEngine(max_model_len=max_len, max_num_batched_tokens=512, kv_budget="512MiB")
    text = sample_text("heldout-gpl-3.0.txt")
    ids_all = kv.encode(text * (1 + max(contexts) * 5 // len(text)))
    if len(ids_all) < max(contexts):
        print(f"error: the sample text has only {len(ids_all)} tokens", file=sys.stderr)
        return 1
    engines: dict[str, object] = {}
    if "kvcli" in names:
        engines["kvcli"] = kv
    if "transformers" in names:
        engines["transformers"] = HFEngine()
    llama = LlamaCppEngine() if "llama.cpp" in names else None
    notes: list[str] = []
    if llama is not None and not llama.available:
        notes.append(llama.note)
    elif llama is not None:
        engines["llama.cpp"] = llama

    for n in contexts:  # warm-ups (llama.cpp's worker warms up on each context itself)
        if "kvcli" in engines:
            kv.timed(ids_all[:n], a.new_tokens)
        if "transformers" in engines:
            engines["transformers"].timed(ids_all[:n], 2)

    results = best_rounds(engines, ids_all, contexts, a.new_tokens, a.repeats, notes)
    if llama is not None and llama.version:
        notes.append(llama.version)

    print(busy_note(load_before, load1()))
    print(f"model: SmolLM2-135M-Instruct Q4_1 GGUF; kvcli {kv.linear_mode} weights, fp32 activations, "
          f"{kv.kv_dtype} KV (default --kv-dtype); transformers fp32; {a.new_tokens} new tokens, greedy, batch 1\n")
    print("| context | engine | prefill tok/s | decode tok/s | kvcli prefill ratio | kvcli decode ratio |")
    print("|---:|---|---:|---:|---:|---:|")
    for n in contexts:
        k = results.get("kvcli", {}).get(n)
        for name, res in results.items():
            p, d = res[n]
            rp = f"{k[0] / p:.2f}x" if k and name != "kvcli" else "—"
            rd = f"{k[1] / d:.2f}x" if k and name != "kvcli" else "—"
            print(f"| {n} | {name} | {p:.1f} | {d:.1f} | {rp} | {rd} |")
    print()
    for note in notes:
        print(f"- {note}")
    k = results.get("kvcli")
    if k:
        for n in contexts:
            if "llama.cpp" in results:
                r = k[n][1] / results["llama.cpp"][n][1]
                print(f"goal decode >= 1.0x llama.cpp at {n}: {'met' if r >= 1 else 'missed'} ({r:.2f}x)")
            if "transformers" in results:
                r = k[n][0] / results["transformers"][n][0]
                print(f"goal prefill >= 1.0x transformers at {n}: {'met' if r >= 1 else 'missed'} ({r:.2f}x)")
    return 0
