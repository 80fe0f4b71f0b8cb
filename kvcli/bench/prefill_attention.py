"""Causal attention of one prefill chunk: kvcli's C kernel (kernels/cpu_prefill_attention.c) against the
torch path it replaces (kvcli.attention.torch_backend.attend: torch's flash attention over the prefix
merged with causal flash attention over the chunk), on SmolLM2-135M's shape (9 q / 3 KV heads, head_dim
64), fp32, with the largest difference of each from a float64 reference. Run it twice for both ISAs:

  python -m kvcli.bench prefill-attention
  ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python -m kvcli.bench prefill-attention

Times: wall ms per call, best of --repeats after a warm-up, at the torch thread count.
"""

from __future__ import annotations

import argparse
from datetime import datetime, timezone

import torch

from kvcli.bench.harness import best_ms

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
CASES = ((512, 512), (512, 2048), (512, 4096))  # (chunk tokens, keys): a chunk alone, then after a prefix


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    t, length = q.shape[0], k.shape[1]
    g = HEADS // KV_HEADS
    s = q.double().transpose(0, 1) @ k.double().repeat_interleave(g, 0).transpose(1, 2) * scale
    s = s.masked_fill(torch.arange(length) > torch.arange(length - t, length).unsqueeze(1), float("-inf"))
    return (s.softmax(-1) @ v.double().repeat_interleave(g, 0)).transpose(0, 1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args(argv)
    from kvcli.bench.internals import attend, native_prefill_attention
    from kvcli.bench.machine import machine_line
    from kvcli_kernels.cpu_prefill_attention import prefill_attention

    print(f"# bench_prefill_attention {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC\n# {machine_line()}")
    lib = native_prefill_attention()
    if lib is None:
        print("kvcli's prefill attention kernel does not run here: nothing to compare")
        return
    print("\n| chunk | keys | kvcli ms | torch ms | torch / kvcli | kvcli max error | torch max error |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    scale = HEAD_DIM ** -0.5
    for t, length in CASES:
        q = torch.randn(t, HEADS, HEAD_DIM, generator=gen)
        k = torch.randn(KV_HEADS, length, HEAD_DIM, generator=gen)
        v = torch.randn(KV_HEADS, length, HEAD_DIM, generator=gen)
        out = torch.empty(t, HEADS, HEAD_DIM)
        t_ours = best_ms(lambda: prefill_attention(lib, q, k, v, scale, out), a.repeats)
        t_torch = best_ms(lambda: attend(q.transpose(0, 1), k, v, scale), a.repeats)
        ref = reference(q, k, v, scale)
        e_ours = (out.double() - ref).abs().max().item()
        e_torch = (attend(q.transpose(0, 1), k, v, scale).transpose(0, 1).double() - ref).abs().max().item()
        print(f"| {t} | {length} | {t_ours:.2f} | {t_torch:.2f} | {t_torch / t_ours:.2f}x | {e_ours:.1e} | {e_torch:.1e} |")
