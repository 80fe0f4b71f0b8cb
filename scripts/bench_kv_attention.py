"""Decode attention alone, per KV format, at a long context: the torch backend's forward for one
decode row over --layers separate caches (SmolLM2-135M's shape by default: 3 KV heads, 9 q heads,
head_dim 64), against the previous read path (dequantize the whole context into a fresh tensor, then
SDPA: what every format but fp32 did before the scratch-buffer paths, and what prefill chunks still do)
that the backend keeps as TorchAttentionBackend._read + attend. --batch N > 1 decodes N requests of
that context in one step through the batched path; "old" is then the previous batched read (advanced
indexing cache[tables], dequantize into a fresh tensor, masked SDPA: module function _gather), which
was the batched path of fp32/fp16/bf16 caches (int8/fp8 already used scratch buffers there). Timed by this thread's CPU time
with --threads torch threads (default 1), interleaved rounds, median of per-round ratios: meant for a
shared machine where the load changes between formats. No model: seconds, not minutes.
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
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from kvcli.attention.base import AttentionMetadata
    import torch.nn.functional as F

    from kvcli.attention.torch_backend import TorchAttentionBackend, _gather, attend
    from kvcli.bench.machine import machine_line
    from kvcli.kvcache.kv_cache import LayerKV
    from kvcli.kvcache.kv_dtype import kv_dtype_of, quantize

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
    caches: dict[str, list[LayerKV]] = {}
    for name in a.kv_dtypes.split(","):
        fmt = kv_dtype_of(name)
        layers = []
        for _ in range(a.layers):
            k, v = (torch.randn(nb * nblk + 1, bs, kvh, d, generator=gen) for _ in range(2))
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
        if nb > 1:
            (_, rows, tables, mask), = backend._decode_batches(meta, bs, q.device)
            qg = q.index_select(0, rows).reshape(nb, kvh, hq // kvh, d)
            for c in layers:
                k, v = _gather(c.k, c.k_scale, tables, q.dtype), _gather(c.v, c.v_scale, tables, q.dtype)
                F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=d**-0.5)
            return
        blocks = backend._blocks(meta, 0, bs)
        for c in layers:
            k = backend._read(c.k, c.k_scale, blocks, a.context, q.dtype)
            v = backend._read(c.v, c.v_scale, blocks, a.context, q.dtype)
            attend(q[0:1].transpose(0, 1), k, v, d**-0.5)

    runs = [(f"{n} {kind}", fn, layers) for n, layers in caches.items() for kind, fn in (("new", new), ("old", old))
            if not (kind == "old" and n == "fp32" and nb == 1)]  # batch 1: fp32 reads views either way
    times: dict[str, list[float]] = {r[0]: [] for r in runs}
    for fn_name, fn, layers in runs:
        fn(layers)  # warm-up (scratch buffers, lazy init)
    for _ in range(a.rounds):
        for label, fn, layers in runs:
            t = time.thread_time()
            fn(layers)
            times[label].append((time.thread_time() - t) * 1e3)
    print(f"# decode attention, {a.layers} layers x {nb} row(s) at context {a.context}, {kvh} KV heads x {d}, "
          f"GQA {hq // kvh}; {a.rounds} interleaved rounds, thread CPU time, {a.threads} torch thread(s), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"# {machine_line()}")
    base = times.get("fp16 new")
    # Per-round ratios: a round's load hits every format alike, so their median is the robust figure.
    print("| KV dtype, path | CPU ms per step (all layers), median | min | median per-round ratio vs fp16 new |")
    print("|---|---:|---:|---:|")
    for label, t in times.items():
        rel = f"{statistics.median(x / y for x, y in zip(t, base)):.2f}x" if base else "-"
        print(f"| {label} | {statistics.median(t):.1f} | {min(t):.1f} | {rel} |")

if __name__ == "__main__":
    main()
