#!/usr/bin/env python
"""Per-call time of kvcli's int8dot kernel for each GGML weight form against Q4_1, same shape.

Random well-formed blocks of each type (kvcli.model.kquant_encode.random_blocks, decoded by kvcli's
GGUF decoders), one [N, K] weight each, x of M rows; the forms' calls run round by round (a slow phase
of a shared VM weighs on all alike), best of --rounds. Prints the resident bytes per weight and the time
ratio to Q4_1's: what a file of that type costs per matmul on this CPU. The C kernels follow torch's ISA
(ATEN_CPU_CAPABILITY=avx2 measures the AVX2 build).
"""

from __future__ import annotations

import argparse
import time
from datetime import datetime, timezone

import numpy as np
import torch

TYPES = ("Q4_1", "Q4_0", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", type=int, default=768)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=200, help="calls per timed round")
    a = ap.parse_args()

    from kvcli.bench.machine import machine_line
    from kvcli.model import int8dot_cpu
    from kvcli.model.gguf_loader import _DECODERS
    from kvcli.model.kquant_encode import random_blocks

    print(f"# probe_int8dot_forms {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"# {machine_line()}")
    if int8dot_cpu.native_library() is None:
        raise SystemExit(f"int8dot kernel unavailable: {int8dot_cpu.native_status()}")
    rng = np.random.default_rng(0)
    lins = {}
    for t in TYPES:
        q = _DECODERS[t](torch.from_numpy(random_blocks(t, a.n, a.k, rng, scale=0.02).copy()), a.n, a.k)
        lins[t] = int8dot_cpu.Int8DotCpu(q)
        lins[t].dense_min_rows = None  # the integer kernel at every row count
    print(f"weight [{a.n}, {a.k}]; {a.rounds} rounds of {a.calls} calls, best round")
    for threads in a.threads:
        torch.set_num_threads(threads)
        for m in a.rows:
            x = torch.randn(m, a.k)
            best = {t: float("inf") for t in TYPES}
            for _ in range(a.rounds):
                for t, lin in lins.items():
                    t0 = time.perf_counter()
                    for _ in range(a.calls):
                        lin(x)
                    best[t] = min(best[t], (time.perf_counter() - t0) / a.calls)
            print(f"\n{threads} thread(s), {m} row(s)")
            print("| type | form | resident bytes / weight | us per call | vs Q4_1 |")
            print("|---|---|---:|---:|---:|")
            for t, lin in lins.items():
                print(f"| {t} | {lin.form} | {lin.nbytes / (a.n * a.k):.4f} | {best[t] * 1e6:.1f} | "
                      f"{best[t] / best['Q4_1']:.2f}x |")


if __name__ == "__main__":
    main()
