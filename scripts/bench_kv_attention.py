"""Decode attention alone, per KV format, at a long context: the torch backend's forward for one
decode row over --layers separate caches (SmolLM2-135M's shape by default: 3 KV heads, 9 q heads,
head_dim 64), against the previous read path (dequantize the whole context to fp32, then SDPA) that
the backend still has as TorchAttentionBackend._read + attend. Interleaved rounds, medians: meant for
a shared machine where the load changes between formats. No model: seconds, not minutes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--kv-dtypes", default="fp32,fp16,bf16,int8,fp8")
    a = ap.parse_args()

    from kvcli.attention.base import AttentionMetadata
    from kvcli.attention.torch_backend import TorchAttentionBackend, attend
    from kvcli.bench.machine import machine_line
    from kvcli.kvcache.kv_cache import LayerKV
    from kvcli.kvcache.kv_dtype import kv_dtype_of, quantize

    kvh, hq, d, bs = 3, 9, 64, 16
    nblk = -(-a.context // bs)
    gen = torch.Generator().manual_seed(0)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([a.context - 1]), cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([a.context], dtype=torch.int32),
        block_tables=torch.arange(1, nblk + 1, dtype=torch.int32)[None], max_seqlen_q=1, max_seq_len=a.context,
        seq_lens_list=(a.context,), query_lens_list=(1,))
    q = torch.randn(1, hq, d, generator=gen)
    caches: dict[str, list[LayerKV]] = {}
    for name in a.kv_dtypes.split(","):
        fmt = kv_dtype_of(name)
        layers = []
        for _ in range(a.layers):
            k, v = (torch.randn(nblk + 1, bs, kvh, d, generator=gen) for _ in range(2))
            if fmt.quantized:
                (kc, ks), (vc, vs) = quantize(k, fmt.storage), quantize(v, fmt.storage)
                layers.append(LayerKV(kc, vc, ks, vs))
            else:
                layers.append(LayerKV(k.to(fmt.storage), v.to(fmt.storage)))
        caches[name] = layers
    backend = TorchAttentionBackend()

    def new(layers: list[LayerKV]) -> None:
        for c in layers:
            backend.forward(q, c, meta, d**-0.5)

    def old(layers: list[LayerKV]) -> None:  # the read path before the scratch buffers and scale folding
        blocks = backend._blocks(meta, 0, bs)
        for c in layers:
            k = backend._read(c.k, c.k_scale, blocks, a.context, q.dtype)
            v = backend._read(c.v, c.v_scale, blocks, a.context, q.dtype)
            attend(q[0:1].transpose(0, 1), k, v, d**-0.5)

    runs = [(f"{n} {kind}", fn, layers) for n, layers in caches.items() for kind, fn in (("new", new), ("old", old))
            if not (kind == "old" and n == "fp32")]  # fp32 reads views either way
    times: dict[str, list[float]] = {r[0]: [] for r in runs}
    for fn_name, fn, layers in runs:
        fn(layers)  # warm-up (scratch buffers, lazy init)
    for _ in range(a.rounds):
        for label, fn, layers in runs:
            t = time.perf_counter()
            fn(layers)
            times[label].append((time.perf_counter() - t) * 1e3)
    print(f"# decode attention, {a.layers} layers x 1 row at context {a.context}, {kvh} KV heads x {d}, "
          f"GQA {hq // kvh}; {a.rounds} interleaved rounds, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"# {machine_line()}")
    base = times.get("fp16 new")
    # Per-round ratios: a round's load hits every format alike, so their median is the robust figure.
    print("| KV dtype, path | ms per step (all layers), median | min | median per-round ratio vs fp16 new |")
    print("|---|---:|---:|---:|")
    for label, t in times.items():
        rel = f"{statistics.median(x / y for x, y in zip(t, base)):.2f}x" if base else "-"
        print(f"| {label} | {statistics.median(t):.1f} | {min(t):.1f} | {rel} |")

if __name__ == "__main__":
    main()
