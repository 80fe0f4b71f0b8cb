"""The CPU matmuls a decode step is made of, by kernel and dtype, at the bundled model's shapes: what a
"CPU path chosen by the processor's features" has to choose between. One thread, CPU time of the
calling thread (time.thread_time), median of --repeats: figures that stay comparable while other work
shares the machine. Run it twice to see both ISAs on an AVX-512 machine:

  python scripts/bench_cpu_ops.py
  ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python scripts/bench_cpu_ops.py

Rows: INT4 linears (torch's packed int4 kernel with bf16 activations, as kvcli runs them; with fp32
activations; and the same weights dense) and the vocabulary projection (49152 x 576, tied to the
embedding) in bf16 / fp16 / fp32 and as kvcli runs it where bf16 is emulated (bf16 table, fp32
slices), with its max abs error against float64 on random data.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import datetime, timezone

import torch
import torch.nn.functional as F


def median_ms(fn, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t = time.thread_time()
        fn()
        ts.append(time.thread_time() - t)
    ts.sort()
    return ts[len(ts) // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--rows", default="1,16,64,512", help="activation rows M (decode batch sizes; 512: a prefill chunk)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    from kvcli.bench.machine import machine_line
    from kvcli.model.int4_cpu import DENSE_MIN_ROWS
    from kvcli.model.layers import Linear
    from kvcli.model.quant import quantize_q4
    from kvcli.model.vocab_head import MIN_ROWS_FOR_FP32_SLICES as MIN_ROWS, VocabHead

    rows = [int(m) for m in a.rows.split(",")]
    print(f"# CPU op benchmark — {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(machine_line())
    print(f"load average (1 min): {os.getloadavg()[0]:.2f} (CPU time of one thread: contention inflates it less than wall time)")
    print(f"command: python scripts/bench_cpu_ops.py --repeats {a.repeats} --rows {a.rows}\n")
    print("| op | shape N x K | M | ms | vs first row of its group |")
    print("|---|---|---:|---:|---:|")
    for n, k in [(1536, 576), (576, 1536)]:
        lin = Linear(quantize_q4(torch.randn(n, k) * 0.02), None, "int4-cpu", torch.float32)
        wd = quantize_q4(torch.randn(n, k) * 0.02).dequantize()
        rb = lin.int4.dense_dtype or torch.float32  # what kvcli reads back in on this ISA
        for m in rows:
            x = torch.randn(m, k)
            base = median_ms(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(torch.bfloat16), lin.int4.packed, 32, lin.int4.scale_zero), a.repeats)
            variants = [
                ("int4 packed, bf16 activations (kvcli)", base),
                ("int4 packed, fp32 activations", median_ms(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
                    x, lin.int4.packed, 32, lin.int4.scale_zero.float()), max(3, a.repeats // 3))),
                (f"int4 codes read back as {str(rb)[6:]} per call + {str(rb)[6:]} GEMM (kvcli from "
                 f"{DENSE_MIN_ROWS} rows)", median_ms(lambda: torch.mm(x.to(rb), lin.int4.dense_t(rb)), a.repeats)),
                ("dense fp32 (8x the bytes)", median_ms(lambda: F.linear(x, wd), a.repeats)),
                ("dense bf16 (4x the bytes)", median_ms(lambda: F.linear(x.bfloat16(), wd.bfloat16()), a.repeats)),
            ]
            for label, ms in variants:
                print(f"| {label} | {n} x {k} | {m} | {ms:.3f} | {ms / base:.2f}x |")
    n, k = 49152, 576
    w = torch.randn(n, k) * 0.05
    for m in rows:
        x = torch.randn(m, k) * 3
        ref = F.linear(x.double(), w.double())
        first = None
        for label, dt in [("vocab projection bf16", torch.bfloat16), ("vocab projection fp16", torch.float16),
                          ("vocab projection fp32", torch.float32)]:
            wt = w.to(dt)
            ms = median_ms(lambda: F.linear(x.to(dt), wt), a.repeats)
            err = (F.linear(x.to(dt), wt).double() - ref).abs().max().item()
            first = first or ms
            print(f"| {label} (max abs error {err:.4f}) | {n} x {k} | {m} | {ms:.3f} | {ms / first:.2f}x |")
        # kvcli's path where bf16 is emulated (model/vocab_head.py): the bf16 table in fp32 slices.
        head = VocabHead(w, torch.bfloat16)
        head.fp32_slices = True
        ms = median_ms(lambda: head(x), a.repeats)
        err = (head(x).double() - ref).abs().max().item()
        print(f"| vocab projection, bf16 table in fp32 slices from {MIN_ROWS} rows (kvcli without native bf16; "
              f"max abs error {err:.4f}) | {n} x {k} | {m} | {ms:.3f} | {ms / first:.2f}x |")


if __name__ == "__main__":
    main()
