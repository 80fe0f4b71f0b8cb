"""Decode attention alone, per KV format, at a long context: the torch backend's forward for one
decode row over --layers separate caches (SmolLM2-135M's shape by default: 3 KV heads, 9 q heads,
head_dim 64), for the two storage layouts of the pool, same backend code: "head" = head-major storage
[kv_heads, blocks, block_size, head_dim] (what KVCache allocates), "token" = token-major storage
[blocks, block_size, kv_heads, head_dim] (the layout before 2026-12-01's change; the backend reads it
through the same indexing, each head's rows then strided). --batch N > 1 decodes N requests of that
context in one step through the batched path. Timed by this thread's CPU time with --threads torch
threads (default 1), interleaved rounds, median of per-round ratios: meant for a shared machine where
the load changes between formats. No model: seconds, not minutes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--kv-dtypes", default="fp32,fp16,bf16,int8,fp8")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    from kvcli.bench.internals import AttentionMetadata

    from kvcli.bench.internals import TorchAttentionBackend
    from kvcli.bench.internals import LayerKV
    from kvcli.bench.internals import kv_dtype_of, quantize

    kvh, hq, d, bs = 3, 9, 64, 16
    nb = a.batch
    nblk = -(-a.context // bs)
    gen = torch.Generator().manual_seed(0)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([(i + 1) * nblk * bs - 1 for i in range(nb)]),
        cu_seqlens_q=torch.arange(nb + 1, dtype=torch.int32), seq_lens=torch.full((nb,), a.context, dtype=torch.int32),
        block_tables=torch.arange(1, nb * nblk + 1, dtype=torch.int32).view(nb, nblk), max_seqlen_q=1,
        max_seq_len=a.context, seq_lens_list=(a.context,) * nb, query_lens_list=(1,) * nb)
    q = torch.randn(nb, hq, d, generator=gen)
    def stored(x: torch.Tensor, layout: str) -> torch.Tensor:
        """x indexed [blocks, bs, kvh(, D)], in the given storage layout (same indexing either way)."""
        return x.movedim(2, 0).contiguous().movedim(0, 2) if layout == "head" else x.contiguous()

    caches: dict[str, list[LayerKV]] = {}
    for name in a.kv_dtypes.split(","):
        fmt = kv_dtype_of(name)
        for layout in ("head", "token"):
            layers = []
            g = torch.Generator().manual_seed(0)  # the same values in both layouts
            for _ in range(a.layers):
                k, v = (torch.randn(nb * nblk + 1, bs, kvh, d, generator=g) for _ in range(2))
                if fmt.quantized:
                    (kc, ks), (vc, vs) = quantize(k, fmt.storage), quantize(v, fmt.storage)
                    layers.append(LayerKV(*(stored(t, layout) for t in (kc, vc, ks, vs))))
                else:
                    layers.append(LayerKV(stored(k.to(fmt.storage), layout), stored(v.to(fmt.storage), layout)))
            caches[f"{name} {layout}-major"] = layers
    backend = TorchAttentionBackend()

    def run(layers: list[LayerKV]) -> None:
        for c in layers:
            backend.forward(q, c, meta, d**-0.5)

    runs = [(label, run, layers) for label, layers in caches.items()]
    times: dict[str, list[float]] = {r[0]: [] for r in runs}
    for fn_name, fn, layers in runs:
        fn(layers)  # warm-up (scratch buffers, lazy init)
    for _ in range(a.rounds):
        for label, fn, layers in runs:
            t = time.thread_time()
            fn(layers)
            times[label].append((time.thread_time() - t) * 1e3)
    print(f"# decode attention, {a.layers} layers x {nb} row(s) at context {a.context}, {kvh} KV heads x {d}, "
          f"GQA {hq // kvh}; {a.rounds} interleaved rounds, thread CPU time, {a.threads} torch thread(s)")
    base = times.get("fp16 head-major")
    # Per-round ratios: a round's load hits every format alike, so their median is the robust figure.
    print("| KV dtype, path | CPU ms per step (all layers), median | min | median per-round ratio vs fp16 head-major |")
    print("|---|---:|---:|---:|")
    for label, t in times.items():
        rel = f"{statistics.median(x / y for x, y in zip(t, base)):.2f}x" if base else "-"
        print(f"| {label} | {statistics.median(t):.1f} | {min(t):.1f} | {rel} |")
