"""torch's packed int4 CPU form of a linear's weight: 4-bit codes (Int4Cpu, with a dense read-back for
calls with many rows) and 5/6/8-bit codes as two nibbles each (Int4x2Cpu, below).

`torch.ops.aten._weight_int4pack_mm_for_cpu` multiplies bf16 activations by 4-bit codes (torch's own
packed layout) with a bf16 scale/zero per group: y = x @ ((q - 8) * scale + zero)^T. It is the fastest
path for decode rows, but from a few hundred rows on (prefill chunks, big mixed batches) it loses to
reading the codes back once per call as a dense weight (a transient in reused buffers, never resident)
and running a plain GEMM: bf16 where the CPU has native bf16 dot products (AVX-512-BF16, AMX), fp32
where bf16 is emulated (AVX2; torch's bf16 GEMM is then ~30x slower). Measured per linear at 256 and
512 rows, 2 threads, idle machine (2026-12-01 06:45 UTC, a /tmp script): AVX-512-BF16, kernel vs
read-back + bf16 GEMM, 3.37 vs 2.53 and 6.20 vs 4.10 ms (1536 x 576), 5.68 vs 4.86 and 11.21 vs
7.62 ms (3072 x 576); AVX2, kernel vs read-back + fp32 GEMM, 6.43 vs 4.52 and 9.42 vs 7.45 ms (1536 x
576), 15.67 vs 11.41 and 28.03 vs 12.22 ms (3072 x 576). scripts/bench_cpu_ops.py prints these rows
(docs/results/cpu-ops-*.txt). The fp32 read-back is more exact than the kernel (no bf16 rounding of x);
the bf16 one rounds the weight to bf16 on top of the kernel's bf16 activations.

The packed layout is torch's, not a public format: rows are packed in blocks of BLOCK_N (64 on
AVX-512, 32 on AVX2 in torch 2.13), and for each k the block's first BLOCK_N / 2 rows sit in the low
nibbles, the rest in the high ones. It is probed at first use by packing a known matrix; if no
block size reproduces it (another torch version), the read-back is simply not used.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from kvcli.model.row_route import ONE_ROUTE, RowRoute
from kvcli.native.scratch import scratch

if TYPE_CHECKING:
    from kvcli.model.quant import QuantTensor


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
    """Packed [n, k / 2] uint8 -> codes [k, n] uint8 (the transposed weight, the order addmm wants), in
    a reused scratch buffer: valid until the next unpack of the same shape."""
    blocks = packed.view(n // bn, k, bn // 2)
    nib = _scratch("nibbles", (n // bn, k, bn), torch.uint8)
    torch.bitwise_and(blocks, 0x0F, out=nib[..., :bn // 2])
    torch.bitwise_right_shift(blocks, 4, out=nib[..., bn // 2:])
    return _scratch("codes", (k, n // bn, bn), torch.uint8).copy_(nib.permute(1, 0, 2)).view(k, n)


def _scale_zero(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Per-group scale and zero [N, groups] -> the kernel's bf16 [groups, N, 2]."""
    return torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)


class Int4Cpu:
    """A weight [N, K] in torch's packed int4 CPU form with per-group bf16 scale/zero."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor | None, group_size: int,
                 route: RowRoute | None = None) -> None:
        """codes uint8 [N, K] (0..15), scale / mins [N, K / group_size] (w = scale * q + min); route: from how
        many rows a read-back + GEMM runs instead, and in which dtype (the weight plan's,
        kvcli/model/weight_plan.py int4_route; default: the int4 kernel at every row count)."""
        self.out_features, self.in_features = codes.shape
        self.group_size = group_size
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2)
        # The kernel computes (q - 8) * scale + zero, so zero = min + 8 * scale.
        zero = (mins if mins is not None else torch.zeros_like(scale)) + 8.0 * scale
        self.scale_zero = _scale_zero(scale, zero)
        route = route or ONE_ROUTE
        self.dense_dtype = route.dense_dtype
        self.dense_min_rows = route.dense_min_rows

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale_zero))

    def dense_t(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as `dtype` [K, N] from the packed codes: scale * q + (zero - 8 * scale), the kernel's
        values (computed in fp32, then rounded to `dtype`). Written into reused scratch buffers: the
        result is valid until the next read-back of a weight of the same shape."""
        bn = packed_block_n()
        assert bn is not None
        k, n, g = self.in_features, self.out_features, self.group_size
        q = _unpack(self.packed, n, k, bn).view(k // g, g, n)
        sz = self.scale_zero.float()  # [K / G, N, 2]
        scale, zero = sz[..., 0].unsqueeze(1), sz[..., 1].unsqueeze(1)  # [K / G, 1, N]
        w = torch.addcmul(zero - 8.0 * scale, q, scale, out=_scratch("dense", (k // g, g, n), torch.float32))
        if dtype != torch.float32:  # rounded once, by a plain copy (addcmul writing bf16 is slower)
            w = _scratch(f"dense-{dtype}", (k // g, g, n), dtype).copy_(w)
        return w.view(k, n)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N] in x's dtype."""
        if self.dense_min_rows is not None and x.shape[0] >= self.dense_min_rows:
            return torch.mm(x.to(self.dense_dtype), self.dense_t(self.dense_dtype)).to(x.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self.packed, self.group_size, self.scale_zero).to(x.dtype)


SCRATCH_KEEP_BYTES = 64 << 20  # read-back buffers up to this size are kept between calls (page faults)


def _scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A reused buffer from the shared pool (kvcli/native/scratch.py): fresh multi-MB tensors per call cost
    page faults."""
    return scratch("int4-cpu:" + name, shape, dtype, keep_bytes=SCRATCH_KEEP_BYTES)


# -- 5/6/8-bit codes through the same kernel ("int4x2-cpu") --------------------------------------------

KERNEL_GROUPS = (32, 64, 128, 256)  # the group sizes torch's int4 CPU kernel accepts

# int4x2: the high part of a code is stored as hi + _HI_BIAS (a nibble 0..15: q5 hi 0..1, q6 0..3,
# q8 -8..7). The kernel then reads each code as q - P with P = 136 - 16 * bias (see int4x2_pack):
# 8 for q5 and q8, 24 for q6, the reachable P nearest each code range's middle (15.5, 31.5, -0.5),
# which keeps the per-group zero, and so its bf16 rounding, small.
_HI_BIAS = {"q5": 8, "q6": 7, "q8": 8}
_CODE_MID = {"q5": 15.5, "q6": 31.5, "q8": -0.5}


def int4x2_pack(weight: "QuantTensor") -> tuple[torch.Tensor, torch.Tensor]:
    """A 5/6/8-bit QuantTensor -> (packed int4 weight [N, K], bf16 scale/zero [K / G, N, 2]) for torch's
    int4 CPU kernel over a doubled reduction dimension.

    Each file group g of G codes becomes one kernel group of 2G: [lo of the G codes, hi + bias of the
    same G codes], against activations [x_g, 16 x_g]. The kernel computes, per group,
        sum_k x_k ((lo_k - 8) S + Z) + sum_k 16 x_k ((hi_k + bias - 8) S + Z)
          = S sum_k x_k (q_k - P) + 17 Z sum_k x_k,        P = 8 + 16 (8 - bias),
    and the file's weight is s (q - offset) + m (m: Q5_1 / Q5_K mins, else 0). So S = bf16(s) and
        17 Z = m + s (P - offset) + (S - s) (P - mid),
    the last term moving the error of S's rounding to (S - s) (q - mid), centred on the code range like
    the int4-cpu path's (q - 8), instead of (S - s) (q - P)."""
    n, k = weight.shape
    g = weight.group_size
    q = weight.unpack_codes().to(torch.int32)  # q8: signed, so >> 4 is the arithmetic high part
    bias = _HI_BIAS[weight.kind]
    lo, hi = (q & 15).view(n, k // g, 1, g), ((q >> 4) + bias).view(n, k // g, 1, g)
    codes = torch.cat([lo, hi], dim=2).reshape(n, 2 * k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
    p = 8 + 16 * (8 - bias)
    s = weight.group_scales()
    s_bf = s.to(torch.bfloat16).to(torch.float32)
    mins = weight.group_mins()
    c = s * float(p - weight.offset) + (s_bf - s) * (p - _CODE_MID[weight.kind])
    if mins is not None:
        c = c + mins
    return packed, _scale_zero(s, c / 17.0)


class Int4x2Cpu:
    """A 5/6/8-bit weight as two nibbles per code in torch's packed int4 CPU form (int4x2_pack)."""

    def __init__(self, weight: "QuantTensor") -> None:
        self.out_features, self.in_features = weight.shape
        self.group_size = weight.group_size
        self.packed, self.scale_zero = int4x2_pack(weight)

    nbytes = Int4Cpu.nbytes  # the same two resident tensors

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # [x_g, 16 x_g] per group of G: the lo and hi nibbles of group g meet their own activations
        # (16 x is exact in bf16). One cat per call, no loop over groups.
        xb = x.to(torch.bfloat16).reshape(x.shape[0], -1, self.group_size)
        x2 = torch.cat([xb, xb * 16], dim=-1).reshape(x.shape[0], -1)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2, self.packed, 2 * self.group_size, self.scale_zero).to(x.dtype)
