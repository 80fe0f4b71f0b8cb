"""Which matmul a call of a given row count takes: below `dense_min_rows` (or always, when None) the form's own
kernel; from it a float GEMM, and from `int8_min_rows` (4-bit codes, CPUs without AMX) kvcli's integer GEMM with one
int8 level of activations. The weight plan (model/weight_plan.py) chooses a route per weight; the kernels'
wrappers (int8dot_cpu.py, int4_cpu.py) follow it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowRoute:
    """`gemm` = "fp32-gemm" (kvcli's fused GEMM over panels dequantized on the fly), "amx-bf16-gemm" (the same in
    bf16 on AMX tiles: the read-back's numbers without the read-back) or "read-back" (the weight
    read back into a reused buffer in `dense_dtype`, then torch's GEMM)."""

    dense_min_rows: int | None = None
    gemm: str = "read-back"
    dense_dtype: torch.dtype = torch.float32
    int8_min_rows: int | None = None  # 4-bit codes from here: kvq_gemm_i8 instead of `gemm` (never below dense_min_rows)

    def __post_init__(self) -> None:
        if self.int8_min_rows is not None and (self.dense_min_rows is None or self.int8_min_rows < self.dense_min_rows):
            raise ValueError("a route's int8 GEMM starts at or after its float GEMM")

    def describe(self) -> str:
        if self.dense_min_rows is None:
            return "one kernel at every row count"
        what = {"fp32-gemm": "kvcli's fp32 GEMM", "amx-bf16-gemm": "kvcli's bf16 GEMM on AMX tiles"}.get(
            self.gemm, f"{str(self.dense_dtype)[6:]} read-back + GEMM")
        text = f"{what} from {self.dense_min_rows} rows"
        if self.int8_min_rows is not None:
            text += (f", kvcli's int8 GEMM (one activation level, two in outlier blocks) from {self.int8_min_rows} "
                     "rows for 4-bit codes")
        return text


ONE_ROUTE = RowRoute()
