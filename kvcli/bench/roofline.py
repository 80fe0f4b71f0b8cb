"""Batch 1 on models of real size against the machine's own limits: kvcli and llama.cpp on the same random-weight
GGUF of a 1B (default) or 3B shape (kvcli/bench/shapes.py), prefill and decode at 512 and 8k tokens of context,
rounds interleaved, and the two bounds measured in the same run:

  read bandwidth  kernels/cpu_probe.c streaming a 1 GiB buffer on every thread with the vector loads kvcli's
                  kernels use, best of 5 passes, measured at the start of every round (this VM's bandwidth moves
                  between minutes: 33 and 55 GB/s within one minute on the AMD EPYC); the bound takes the best
                  round, as the engines' figures do. The decode bound at context n is bandwidth / (weight bytes +
                  KV bytes read at n), per engine (its resident weights, its KV format: kvcli's default here,
                  llama.cpp's f16). torch's sum over the buffer where the probe is not built.
  matrix peak     the larger of torch's best GEMM at 2048^3 (bf16 or fp32; oneDNN's AMX tiles where the CPU has
                  them) and kernels/cpu_probe.c's register-only loop of the int8 dot-product instruction kvcli's
                  int8 GEMM issues (vpdpbusd, or vpmaddubsw on AVX2): measured ceilings, not the datasheet's.
                  Prefill MACs per token = the linear weights' count (attention's share excluded, so the prefill
                  share is a lower bound at 8k)

prefill tok/s = N / time to the first token from an empty cache; decode tok/s = tokens / time after the first,
best of --rounds rounds after a warm-up (llama.cpp's worker warms up on each context itself).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

from kvcli.bench.batch1 import best_rounds
from kvcli.bench.engines import KvcliEngine, LlamaCppEngine
from kvcli.bench.harness import busy_note, load1, sample_text
from kvcli.bench.shapes import SHAPES, shape_file

GIB = 2**30


def _probe():
    """kvcli's probe library (kernels/cpu_probe.c), or None where this build has none."""
    from kvcli.native.registry import library

    return library("probe")


BANDWIDTH_PASSES = 5


def read_bandwidth(passes: int = BANDWIDTH_PASSES) -> float:
    """Bytes per second reading a 1 GiB buffer on every thread (best pass): the C probe's vector loads, or
    torch's sum over it where the probe is not built."""
    import torch

    lib = _probe()
    x = _bandwidth_buffer()
    if lib is not None:
        from kvcli_kernels.cpu_probe import read_pass

        runs = [read_pass(lib, x, torch.get_num_threads()) for _ in range(passes)]
        return max(done / seconds for seconds, done, _ in runs)
    best = float("inf")
    for _ in range(passes):
        t = time.perf_counter()
        x.view(torch.float32).sum()
        best = min(best, time.perf_counter() - t)
    return x.nbytes / best


def bandwidth_method() -> str:
    return "C probe, vector loads" if _probe() is not None else "torch sum"


@functools.lru_cache(maxsize=1)
def _bandwidth_buffer():
    """1 GiB of random bits, kept for the run: no page is shared or zero (a fresh zero page can read from one
    frame)."""
    import torch

    return torch.randint(-2**62, 2**62, (GIB // 8,), dtype=torch.int64)


def matrix_peak(n: int = 2048, passes: int = 5) -> tuple[float, str]:
    """(MAC/s, what) of the fastest of torch's GEMMs at n^3 and kvcli's int8 dot-product loop here."""
    import torch

    out = []
    for dtype in (torch.bfloat16, torch.float32):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b
        best = float("inf")
        for _ in range(passes):
            t = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t)
        out.append((n**3 / best, f"torch {str(dtype)[6:]} GEMM {n}^3"))
    int8 = int8_peak(passes)
    if int8 is not None:
        out.append(int8)
    return max(out)


def int8_peak(passes: int = 5) -> tuple[float, str] | None:
    """(multiply-adds per second, what) of the int8 dot-product instruction kvcli's kernels issue, on registers on
    every thread (kernels/cpu_probe.c); None where the probe is not built."""
    import torch

    lib = _probe()
    if lib is None:
        return None
    from kvcli_kernels.cpu_probe import int8_peak_instruction, int8_peak_pass

    runs = [int8_peak_pass(lib, 1 << 22, torch.get_num_threads()) for _ in range(passes)]
    return max(macs / seconds for seconds, macs, _ in runs), f"int8 {int8_peak_instruction(lib)} on registers"


def fp32_peak(passes: int = 5) -> tuple[float, str] | None:
    """(fp32 multiply-adds per second, what) of the widest vector FMA, on registers on every thread
    (kernels/cpu_probe.c); None where the probe is not built."""
    import torch

    lib = _probe()
    if lib is None:
        return None
    from kvcli_kernels.cpu_probe import fp32_peak_instruction, fp32_peak_pass

    runs = [fp32_peak_pass(lib, 1 << 22, torch.get_num_threads()) for _ in range(passes)]
    return max(fmas / seconds for seconds, fmas, _ in runs), f"fp32 {fp32_peak_instruction(lib)} on registers"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcli.bench roofline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    ap.add_argument("--kind", default="Q4_0", help="the file's tensor types (kvcli/bench/shapes.py KINDS)")
    ap.add_argument("--contexts", default="512,8192")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args(argv)
    contexts = [int(x) for x in a.contexts.split(",")]
    try:
        path = shape_file(a.shape, a.kind)
    except ValueError as e:
        ap.error(str(e))
    load_before = load1()

    peak, peak_what = matrix_peak()
    bandwidths: list[float] = []
    kv = KvcliEngine(model=str(path), max_model_len=max(contexts) + a.new_tokens + 16, max_num_batched_tokens=512,
                     kv_budget="2GiB")
    config = kv.llm.engine.config
    text = sample_text("heldout-gpl-3.0.txt")
    ids = kv.encode(text * (1 + max(contexts) * 5 // len(text)))[:max(contexts)]
    engines: dict[str, object] = {"kvcli": kv}
    llama = LlamaCppEngine(path=path)
    notes = []
    if llama.available:
        engines["llama.cpp"] = llama
    else:
        notes.append(llama.note)
    for n in contexts:
        kv.timed(ids[:n], a.new_tokens)  # warm-up

    results = best_rounds(engines, ids, contexts, a.new_tokens, a.rounds, notes,
                          each_round=lambda: bandwidths.append(read_bandwidth()))
    bandwidth = max(bandwidths)
    if llama.version:
        notes.append(llama.version)

    file_bytes = path.stat().st_size
    weights = {"kvcli": kv.weight_bytes(), "llama.cpp": file_bytes}
    kv_token = {"kvcli": config.kv_bytes_per_token(kv.kv_dtype), "llama.cpp": config.kv_bytes_per_token("fp16")}
    macs = config.layer_linear_macs()
    print(busy_note(load_before, load1()))
    print(f"model: random-weight {a.shape} llama shape, {a.kind} ({path.name}, {file_bytes / GIB:.2f} GiB; hidden "
          f"{config.hidden_size}, {config.num_layers} layers, ffn {config.intermediate_size}, heads "
          f"{config.num_heads}/{config.num_kv_heads}); kvcli {kv.linear_mode} weights, {kv.kv_dtype} KV; "
          f"{a.new_tokens} new tokens, greedy, batch 1")
    rounds_gbs = ", ".join(f"{b / 1e9:.1f}" for b in bandwidths)
    print(f"read bandwidth ({bandwidth_method()} over 1 GiB, every thread, best of {BANDWIDTH_PASSES} at each "
          f"round's start): {bandwidth / 1e9:.1f} GB/s (rounds: {rounds_gbs}); matrix peak ({peak_what}): "
          f"{peak / 1e12:.3f} TMAC/s; linear MACs per token: {macs / 1e9:.2f} G\n")
    print("| context | engine | weight MiB | prefill tok/s | prefill share of peak | decode tok/s | decode bound "
          "tok/s | decode share of bound | kvcli decode ratio | kvcli prefill ratio |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in contexts:
        k = results["kvcli"][n]
        for name, res in results.items():
            p, d = res[n]
            bound = bandwidth / (weights[name] + kv_token[name] * n)
            rd = f"{k[1] / d:.2f}x" if name != "kvcli" else "—"
            rp = f"{k[0] / p:.2f}x" if name != "kvcli" else "—"
            print(f"| {n} | {name} | {weights[name] / 2**20:.0f} | {p:.1f} | {p * macs / peak:.1%} | {d:.1f} | "
                  f"{bound:.1f} | {d / bound:.1%} | {rd} | {rp} |")
    print()
    for note in notes:
        print(f"- {note}")
    for n in contexts:
        bound = bandwidth / (weights["kvcli"] + kv_token["kvcli"] * n)
        share = results["kvcli"][n][1] / bound
        print(f"goal decode >= 80% of the bandwidth bound at {n}: {'met' if share >= 0.8 else 'missed'} ({share:.0%})")
        if "llama.cpp" in results:
            r = results["kvcli"][n][1] / results["llama.cpp"][n][1]
            print(f"goal decode >= 1.3x llama.cpp at {n}: {'met' if r >= 1.3 else 'missed'} ({r:.2f}x)")
            r = results["kvcli"][n][0] / results["llama.cpp"][n][0]
            print(f"goal prefill >= 1.5x llama.cpp at {n}: {'met' if r >= 1.5 else 'missed'} ({r:.2f}x)")
    return 0
