"""The output (vocabulary) projection: hidden states -> logits over the whole vocabulary.

It is the largest single matmul of a decode step for small models (SmolLM2-135M: 49152 x 576, 56 MB
in bf16). Where the table is quantized (GGUF files store it as Q8_0 most often) and kvcli's CPU kernel
builds, it is multiplied as stored, int8 codes against int8 activations (model/int8dot_cpu.py): 0.51 vs
3.20 ms per token for the bf16 GEMM on AVX-512-BF16, 0.77 vs 2.12 ms on AVX2 (scripts/bench_int8dot.py,
docs/results/int8dot-ops-*.txt; at 64 rows 21.9 vs 11.3 ms on AVX-512, 32.5 vs 93.9 on AVX2).
Otherwise it is a dense table, and how to run it best depends on the processor, measured by
scripts/bench_cpu_ops.py (docs/results/cpu-ops-*.txt):
  - CPUs with native bf16 dot products (AVX-512-BF16, AMX): torch's bf16 GEMM, at every batch size.
  - CPUs without (AVX2): bf16 is emulated. One row is still fastest as a bf16 GEMV, but from 4 rows up
    the table is converted to fp32 one 1024-row slice at a time (the slice stays in cache) and each
    slice is an fp32 GEMM: several times faster than the emulated bf16 GEMM at 16 and 64 rows (the
    "fp32 slices" rows of the op benchmark), no extra resident bytes, and more exact.
The table is stored once, in `dtype`; which path ran is visible as `path`.
"""

from __future__ import annotations

import os

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from kvcli.model.int8dot_cpu import Int8DotCpu

SLICE_ROWS = 1024
MIN_ROWS_FOR_FP32_SLICES = 4


def cpu_has_native_bf16() -> bool:
    """True when torch's CPU kernels may use bf16 dot-product instructions here: the CPU has them and
    neither ATEN_CPU_CAPABILITY nor ONEDNN_MAX_CPU_ISA holds torch below AVX-512."""
    from kvcli.bench.machine import cpu_flags, torch_isa

    flags = cpu_flags()
    if not ({"avx512_bf16", "amx_bf16"} & flags):
        return False
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if onednn and "512" not in onednn and "AMX" not in onednn and onednn != "ALL":
        return False
    return torch_isa().upper().startswith("AVX512")


class VocabHead:
    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        self.int8dot: Int8DotCpu | None = None
        self.weight = weight.to(dtype).contiguous()
        cpu_bf16 = self.weight.device.type == "cpu" and dtype == torch.bfloat16
        # Slicing to fp32 only pays where bf16 arithmetic is emulated.
        self.fp32_slices = cpu_bf16 and not cpu_has_native_bf16()
        self.path = "bf16 GEMV, fp32 slices from 4 rows" if self.fp32_slices else f"{str(dtype)[6:]} GEMM"

    @classmethod
    def int8dot(cls, table: "Int8DotCpu") -> "VocabHead":
        """The quantized table through kvcli's int8 kernel, or from GEMM_F32_MIN_ROWS rows its fused fp32
        GEMM where that is faster (AVX2 builds): never a read-back, which for the whole vocabulary would be
        a 57-113 MB transient (the fused GEMM dequantizes 16-row panels)."""
        from kvcli.model.int8dot_cpu import GEMM_F32_MIN_ROWS

        head = cls.__new__(cls)
        if not table.gemm_f32:
            table.dense_min_rows = None
        head.int8dot, head.weight, head.fp32_slices = table, None, False
        head.path = f"int8dot-cpu ({table.form})"
        if table.gemm_f32:
            head.path += f", fp32 GEMM from {GEMM_F32_MIN_ROWS} rows"
        return head

    def make_row_invariant(self) -> None:
        """One path whatever the row count (a row's logits then do not depend on its batch)."""
        self.fp32_slices = False
        if self.int8dot is None:
            self.path = f"{str(self.weight.dtype)[6:]} GEMM"
        elif self.int8dot.dense_min_rows is not None:
            self.int8dot.dense_min_rows = None
            self.path = f"int8dot-cpu ({self.int8dot.form})"

    @property
    def nbytes(self) -> int:
        if self.int8dot is not None:
            return self.int8dot.nbytes
        return self.weight.numel() * self.weight.element_size()

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h [M, hidden] -> fp32 logits [M, vocab]."""
        if self.int8dot is not None:
            return self.int8dot(h.float())
        if not (self.fp32_slices and h.shape[0] >= MIN_ROWS_FOR_FP32_SLICES):
            return F.linear(h.to(self.weight.dtype), self.weight).float()
        x = h.float()
        out = torch.empty(h.shape[0], self.weight.shape[0], dtype=torch.float32, device=h.device)
        for s in range(0, self.weight.shape[0], SLICE_ROWS):
            torch.matmul(x, self.weight[s:s + SLICE_ROWS].float().t(), out=out[:, s:s + SLICE_ROWS])
        return out
