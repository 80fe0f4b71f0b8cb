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
    int8_min_rows: int | None = None  # 4-bit codes from here: kvq_gemm_i8 instead of the form's kernel or `gemm`
    # The form's kernel rounds activations as kvq_gemm_i8 does (one int8 level, two in outlier blocks) at every row
    # count, so that a row's result is the same bit for bit in both: 4-bit codes with one scale per 32 where the
    # int8 GEMM runs (weight_plan.int8dot_route)
    one_level: bool = False

    @property
    def first_other_rows(self) -> int | None:
        """The fewest rows a call takes another path than the form's own kernel with (None: never)."""
        rows = [r for r in (self.dense_min_rows, self.int8_min_rows) if r is not None]
        return min(rows) if rows else None

    @property
    def first_float_rows(self) -> int | None:
        """The fewest rows a call takes a float GEMM with (None: never; the integer kernels at every row count,
        the one-call C decode's: it follows the int8 GEMM's route, not the float GEMMs')."""
        if self.dense_min_rows is None or (self.int8_min_rows is not None and self.int8_min_rows <= self.dense_min_rows):
            return None
        return self.dense_min_rows

    def describe(self) -> str:
        if self.first_other_rows is None:
            return "one kernel at every row count"
        int8 = f"kvcli's int8 GEMM (one activation level, two in outlier blocks) from {self.int8_min_rows} rows"
        if self.one_level:
            int8 += " (the same rounding below)"
        if self.dense_min_rows is None or (self.int8_min_rows is not None and self.int8_min_rows <= self.dense_min_rows):
            return int8  # (the float GEMM only where the build has no int8 GEMM)
        what = {"fp32-gemm": "kvcli's fp32 GEMM", "amx-bf16-gemm": "kvcli's bf16 GEMM on AMX tiles"}.get(
            self.gemm, f"{str(self.dense_dtype)[6:]} read-back + GEMM")
        text = f"{what} from {self.dense_min_rows} rows"
        return text if self.int8_min_rows is None else f"{text}, {int8}"


ONE_ROUTE = RowRoute()
