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
The table is stored once; which path it takes is the weight plan's (kvcli/model/weight_plan.py), visible
as `path`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from kvcli.model.int8dot_cpu import Int8DotCpu
    from kvcli.model.weight_plan import HeadPlan

SLICE_ROWS = 1024
MIN_ROWS_FOR_FP32_SLICES = 4


class VocabHead:
    """Built from the weight plan's HeadPlan (kvcli/model/weight_plan.py): a dense table in plan.dtype, or a
    quantized one through kvcli's int8 kernel (`table`)."""

    def __init__(self, plan: "HeadPlan", weight: torch.Tensor | None = None, table: "Int8DotCpu | None" = None) -> None:
        self.plan = plan
        self.int8dot = table
        self.fp32_slices = plan.fp32_slices
        self.weight = None if weight is None else weight.to(plan.dtype).contiguous()
        self.path = plan.describe()

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
