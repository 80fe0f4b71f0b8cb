"""Decode attention alone (kernels/cpu_attention.c, fp16 KV) on a model shape's heads, by the order of a request's
blocks in the pool, and where the cache lies: what a decode step's attention over a long context costs, and why.

One decode row of a request of --context tokens, over --layers caches of the shape's KV heads (the 1B shape: 8 KV
heads, 32 q heads, head_dim 64, 16-token blocks), head-major storage as KVCache allocates it. The request's block
table is ascending (blocks 1, 2, ...), descending, or a random permutation. "memory": enough layers that the caches
(--layers x the context's KV) are far past the last-level cache, each call's rows read from memory; "hot": one layer
of --hot-context tokens, called again and again, so its rows sit in the cores' L2 (the kernel's arithmetic alone).
GB/s is the cache bytes read per second (K and V, fp16). Every order and place runs once a round, --rounds
rounds, medians, on torch's threads. The C read-bandwidth probe (kernels/cpu_probe.c, the roofline figure's) runs
in the same process, best of 5, for comparison.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvcli.bench.harness import busy_note, load1
from kvcli.bench.shapes import SHAPES


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcli.bench attention-order", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=64, help="caches of the memory runs (64 x 8k x 1B: 1 GiB)")
    ap.add_argument("--hot-context", type=int, default=1024, help="the hot run's context (its K/V: 2 MiB on 1B)")
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args(argv)
    from kvcli.bench.internals import native_attention
    from kvcli.bench.roofline import bandwidth_method, read_bandwidth

    lib = native_attention()
    if lib is None:
        print("kvcli's decode-attention kernel is not built here (no C compiler, or KVCLI_NATIVE=0): nothing to time")
        return 1
    from kvcli_kernels.cpu_attention import CacheView, DecodeStep, run

    shape, bs = SHAPES[a.shape], 16
    kvh, hq, d = shape.kv_heads, shape.heads, shape.hidden // shape.heads
    gen = torch.Generator().manual_seed(0)
    load_before = load1()

    def caches(context: int, layers: int) -> list[CacheView]:
        blocks = context // bs + 1  # block 0: the null block, as in the pool
        return [CacheView(*(torch.randn(kvh, blocks, bs, d, generator=gen).half() for _ in range(2)))
                for _ in range(layers)]

    def steps(context: int) -> dict[str, DecodeStep]:
        n = context // bs
        tables = {"ascending": torch.arange(1, n + 1), "descending": torch.arange(n, 0, -1),
                  "random": torch.randperm(n, generator=gen) + 1}
        lens = torch.tensor([context], dtype=torch.int32)
        return {k: DecodeStep(t.to(torch.int32).view(1, n), lens, hq, d ** -0.5) for k, t in tables.items()}

    places = {"memory": (caches(a.context, a.layers), steps(a.context), 2),
              "hot": (caches(a.hot_context, 1), steps(a.hot_context), 400)}
    q = torch.randn(1, hq, d, generator=gen)
    out = torch.empty_like(q)
    nt = torch.get_num_threads()
    samples: dict[tuple[str, str], list[float]] = {}
    for _ in range(a.rounds):
        for place, (views, by_order, calls) in places.items():
            for order, step in by_order.items():
                t = time.perf_counter()
                for _ in range(calls):
                    for view in views:
                        run(lib, step, view, q, out, nt)
                seconds = (time.perf_counter() - t) / (calls * len(views))
                samples.setdefault((place, order), []).append(seconds)
    bandwidth = read_bandwidth()
    print(busy_note(load_before, load1()))
    print(f"{a.shape} shape's attention: {kvh} KV heads, {hq} q heads, head_dim {d}, {bs}-token blocks, fp16 KV, one "
          f"decode row, {nt} threads; memory: {a.layers} layers x {a.context} tokens "
          f"({a.layers * a.context * kvh * d * 4 / 2**30:.2f} GiB of K/V); hot: one layer x {a.hot_context} tokens; "
          f"median of {a.rounds} rounds")
    print(f"read bandwidth ({bandwidth_method()} over 1 GiB, every thread, best of 5): {bandwidth / 1e9:.1f} GB/s\n")
    print("| K/V in | block order | us per layer | GB/s | vs ascending | vs the read probe |")
    print("|---|---|---:|---:|---:|---:|")
    for place, (views, by_order, _) in places.items():
        context = a.context if place == "memory" else a.hot_context
        nbytes = context * kvh * d * 2 * 2
        base = statistics.median(samples[(place, "ascending")])
        for order in by_order:
            s = statistics.median(samples[(place, order)])
            print(f"| {place} | {order} | {s * 1e6:.1f} | {nbytes / s / 1e9:.1f} | {s / base:.2f}x | "
                  f"{nbytes / s / bandwidth:.0%} |")
    return 0
