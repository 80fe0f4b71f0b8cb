"""The "int8dot-cpu" form of a linear: the file's codes kept at 4 or 8 bits, multiplied by activations
quantized to int8 per block of 32 with integer dot products (kvcli_kernels/cpu_int8dot.c).

This is what llama.cpp does on CPUs (Q4 x Q8): the weights are read once per call as 4-bit codes, with
no bf16 conversion of the activations (emulated, and slow, without AVX-512-BF16) and no dequantized
copy. Resident per weight: 4-bit codes + an fp16 scale and min per group (the GGUF Q4_0/Q4_1 bytes) or
fp32 ones where fp16 would round them (two-level K-quant scales, AWQ / GPTQ zero points); 5/6/8-bit
codes as int8 (q - offset), interleaved by 8 rows (kvcli_kernels/cpu_int8dot.c). Where the CPU has
native bf16 dot products, calls with many rows (prefill chunks) read the weight back into a reused
buffer and run a bf16 GEMM instead (as int4-cpu); elsewhere the integer kernel is faster at every size.

Not bit-exact with the exact path: each activation is rounded to int8 per block of 32 (relative error
about 1/254 of the block's largest value), the weights themselves are exact.
The native library is built at first use (a C compiler is needed); without one, or with
KVCLI_NATIVE=0, linears take torch's int4 kernel (int4-cpu / int4x2-cpu) instead.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvcli.model.int4_cpu import _scratch
from kvcli_kernels.cpu_int8dot import groups_x8, pack_x8

if TYPE_CHECKING:
    import ctypes

    from kvcli.model.quant import QuantTensor

# From this many rows a read-back + bf16 GEMM is as fast as the integer dot products where the CPU has
# native bf16 (1.57 vs 1.61 ms at 512 rows of 960 x 576, 6.58 vs 5.59 of 3072 x 576); with bf16 emulated
# the fp32 GEMM never catches up (8.32 vs 11.42 ms at 512 rows, 15.45 vs 20.62 at 1024 of 3072 x 576).
# 2 threads, AMD EPYC, 2026-12-01 09:20 UTC, scripts/bench_cpu_ops.py.
DENSE_MIN_ROWS_NATIVE_BF16 = 512


def native_isa() -> str:
    """Which build of the kernel fits: follows the ISA torch's kernels use, so ATEN_CPU_CAPABILITY=avx2
    measures the AVX2 build on an AVX-512 machine."""
    import platform

    from kvcli.bench.machine import cpu_flags, torch_isa

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "generic"
    flags = cpu_flags()
    if not {"avx2", "fma", "f16c"} <= flags:
        return "generic"
    if torch_isa().upper().startswith("AVX512") and {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
        return "avx512vnni"
    return "avx2"


@functools.lru_cache(maxsize=1)
def native_library() -> "ctypes.CDLL | None":
    """The compiled kernel, or None (KVCLI_NATIVE=0, no compiler, a failed build: see native_status)."""
    if os.environ.get("KVCLI_NATIVE", "1") == "0":
        return None
    from kvcli.model.tokenizer import cache_dir
    from kvcli_kernels.cpu_int8dot import load

    return load(native_isa(), str(cache_dir() / "native"))


def native_status() -> str:
    """One line for `kvcli inspect` and the benchmarks: which build runs, or why none does."""
    if os.environ.get("KVCLI_NATIVE", "1") == "0":
        return "off (KVCLI_NATIVE=0)"
    from kvcli_kernels.cpu_int8dot import load_error

    if native_library() is None:
        return f"unavailable: {load_error(native_isa())}"
    return f"{native_isa()} build"


def supports(weight: "QuantTensor") -> bool:
    n, k = weight.shape
    return (n % 8 == 0 and weight.group_size % 32 == 0 and k % weight.group_size == 0
            and native_library() is not None)


def _exact_f16(*ts: torch.Tensor | None) -> bool:
    return all(t is None or torch.equal(t.to(torch.float16).float(), t.float()) for t in ts)


class Int8DotCpu:
    """A weight [N, K] as 4-bit (per-32-block nibble order) or int8 codes, a scale and a min per group."""

    def __init__(self, weight: "QuantTensor") -> None:
        lib = native_library()
        assert lib is not None, "int8dot-cpu needs the native library (see native_status)"
        self.lib = lib
        n, k = weight.shape
        self.out_features, self.in_features, self.group_size = n, k, weight.group_size
        scale = weight.group_scales()
        mins = weight.group_mins()
        if weight.kind == "q4":
            self.bits = 4
            q = weight.unpack_codes()
            if weight.offset:  # s (q - o) + m == s q + (m - s o)
                mins = (mins if mins is not None else torch.zeros_like(scale)) - scale * weight.offset
        else:  # 5/6/8-bit codes minus their offset fit int8 (Q6_K: -32..31)
            self.bits = 8
            q = weight.unpack_codes()
            q = (q.to(torch.int16) - weight.offset).to(torch.int8) if weight.kind != "q8" else q.view(torch.int8)
        self.codes = pack_x8(q, self.bits)
        dtype = torch.float16 if _exact_f16(scale, mins) else torch.float32
        self.scale = groups_x8(scale.to(dtype))
        self.mins = None if mins is None else groups_x8(mins.to(dtype))
        from kvcli.model.vocab_head import cpu_has_native_bf16

        native_bf16 = cpu_has_native_bf16()
        self.dense_dtype = torch.bfloat16 if native_bf16 else torch.float32
        self.dense_min_rows: int | None = DENSE_MIN_ROWS_NATIVE_BF16 if native_bf16 else None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.mins) if t is not None)

    def dense(self, dtype: torch.dtype, first_row: int = 0, rows: int | None = None) -> torch.Tensor:
        """Rows first_row .. + rows of the weight [N, K] as `dtype` (fp32 or bf16) in a reused buffer:
        valid until the next read-back of the same shape."""
        from kvcli_kernels.cpu_int8dot import int8dot_dequant

        rows = self.out_features - first_row if rows is None else rows
        out = _scratch("int8dot-dense", (rows, self.in_features), dtype)
        return int8dot_dequant(self.lib, self.codes, self.bits, self.scale, self.mins, self.group_size, out,
                               first_row)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N] in x's dtype."""
        if self.dense_min_rows is not None and x.shape[0] >= self.dense_min_rows:
            return F.linear(x.to(self.dense_dtype), self.dense(self.dense_dtype)).to(x.dtype)
        from kvcli_kernels.cpu_int8dot import int8dot_linear

        y = int8dot_linear(self.lib, x.float().contiguous(), self.codes, self.bits, self.scale, self.mins,
                           self.group_size, self.out_features)
        return y.to(x.dtype)
