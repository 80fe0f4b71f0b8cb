"""torch's packed int4 CPU form of a linear's weight, and when to read it back as dense fp32 instead.

`torch.ops.aten._weight_int4pack_mm_for_cpu` multiplies bf16 activations by 4-bit codes (torch's own
packed layout) with a bf16 scale/zero per group: y = x @ ((q - 8) * scale + zero)^T. On CPUs with
native bf16 dot products (AVX-512-BF16, AMX) it is the fastest path at every batch size. Without them
(AVX2) bf16 is emulated, and from a few hundred rows on (prefill chunks, big mixed batches) it loses
to dequantizing the weight once per call to fp32 and running an fp32 GEMM: measured per linear at 512
rows, one thread (docs/results/cpu-ops-2026-12-01b.txt, scripts/bench_cpu_ops.py), torch's AVX2
kernels: 24.5 ms int4 kernel vs 16.7 ms read-back + fp32 GEMM for 1536 x 576, 18.0 vs 12.6 ms for
576 x 1536 (about even at 256 rows); AVX-512-BF16: 11.0 vs 14.1 ms, so not there. So on AVX2 a call with
at least DENSE_MIN_ROWS rows reads the packed codes back as a dense fp32 weight (a transient, not
resident) and runs `addmm`; decode rows keep the int4 kernel. The dense read-back is more exact than
the kernel (fp32 activations, no bf16 rounding of x), never less.

The packed layout is torch's, not a public format: rows are packed in blocks of BLOCK_N (64 on
AVX-512, 32 on AVX2 in torch 2.13), and for each k the block's first BLOCK_N / 2 rows sit in the low
nibbles, the rest in the high ones. It is probed at first use by packing a known matrix; if no
block size reproduces it (another torch version), the dense read-back is simply not used.
"""

from __future__ import annotations

import functools

import torch

DENSE_MIN_ROWS = 256  # AVX2: from about here on dequantize + fp32 GEMM beats the emulated-bf16 int4 kernel


@functools.lru_cache(maxsize=None)
def packed_block_n() -> int | None:
    """torch's row-block size of the packed int4 CPU layout on this machine (None: not recognised)."""
    n, k = 128, 64
    q = (torch.arange(n * k, dtype=torch.int64).view(n, k) * 7 % 16).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    for bn in (64, 32, 16):
        if packed.shape == (n, k // 2) and torch.equal(_unpack(packed, n, k, bn).t(), q.to(torch.uint8)):
            return bn
    return None


def _unpack(packed: torch.Tensor, n: int, k: int, bn: int) -> torch.Tensor:
    """Packed [n, k / 2] uint8 -> codes [k, n] uint8 (the transposed weight, the order addmm wants)."""
    blocks = packed.view(n // bn, k, bn // 2)
    codes = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1)  # [n / bn, k, bn]
    return codes.permute(1, 0, 2).reshape(k, n)


def dense_read_back_wanted() -> bool:
    """True where bf16 is emulated (so the int4 kernel is slow at many rows) and the layout is known."""
    from kvcli.model.vocab_head import cpu_has_native_bf16

    return not cpu_has_native_bf16() and packed_block_n() is not None


class Int4Cpu:
    """A weight [N, K] in torch's packed int4 CPU form with per-group bf16 scale/zero."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor | None, group_size: int) -> None:
        """codes uint8 [N, K] (0..15), scale / mins [N, K / group_size] (w = scale * q + min)."""
        self.out_features, self.in_features = codes.shape
        self.group_size = group_size
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2)
        # The kernel computes (q - 8) * scale + zero, so zero = min + 8 * scale.
        zero = (mins if mins is not None else torch.zeros_like(scale)) + 8.0 * scale
        self.scale_zero = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        self.dense_min_rows = DENSE_MIN_ROWS if dense_read_back_wanted() else None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale_zero))

    def dense_t(self) -> torch.Tensor:
        """The weight as fp32 [K, N] from the packed codes: (q - 8) * scale + zero, the kernel's values."""
        bn = packed_block_n()
        assert bn is not None
        k, n, g = self.in_features, self.out_features, self.group_size
        sz = self.scale_zero.float()  # [K / G, N, 2]
        scale, zero = sz[..., 0].unsqueeze(1), sz[..., 1].unsqueeze(1)  # [K / G, 1, N]
        q = _unpack(self.packed, n, k, bn).view(k // g, g, n)
        return torch.addcmul(zero - 8.0 * scale, q, scale).view(k, n)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N] in x's dtype."""
        if self.dense_min_rows is not None and x.shape[0] >= self.dense_min_rows:
            return torch.mm(x.float(), self.dense_t()).to(x.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self.packed, self.group_size, self.scale_zero).to(x.dtype)
