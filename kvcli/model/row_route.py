"""Which matmul a call of a given row count takes: below `dense_min_rows` (or always, when None) the form's own
kernel; from it a float GEMM, and from `int8_min_rows` (4-bit codes) kvcli's integer GEMM with one int8 level of
activations, at every row count from there or (`dense_over_int8`) until the float GEMM's. The weight plan
(model/weight_plan.py) chooses a route per weight; the kernels' wrappers (int8dot_cpu.py, int4_cpu.py) follow it."""

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
    # From dense_min_rows the float GEMM even where the int8 GEMM takes the rows below (AMX: kvq_gemm_bf16 on tiles
    # outruns it there); False: the int8 GEMM at every row count from int8_min_rows
    dense_over_int8: bool = False

    def takes_int8(self, rows: int) -> bool:
        """Whether a call of `rows` rows takes the int8 GEMM."""
        return self.int8_min_rows is not None and rows >= self.int8_min_rows and not (
            self.dense_over_int8 and self.dense_min_rows is not None and rows >= self.dense_min_rows)

    def takes_dense(self, rows: int) -> bool:
        """Whether a call of `rows` rows takes the float GEMM (or the read-back)."""
        return self.dense_min_rows is not None and rows >= self.dense_min_rows and not self.takes_int8(rows)

    @property
    def first_other_rows(self) -> int | None:
        """The fewest rows a call takes another path than the form's own kernel with (None: never)."""
        rows = [r for r in (self.dense_min_rows, self.int8_min_rows) if r is not None]
        return min(rows) if rows else None

    @property
    def first_float_rows(self) -> int | None:
        """The fewest rows a call takes a float GEMM with (None: never; the integer kernels at every row count,
        the one-call C decode's: it follows the int8 GEMM's route, not the float GEMMs')."""
        if self.dense_min_rows is None or not self.takes_dense(self.dense_min_rows):
            return None
        return self.dense_min_rows

    def describe(self) -> str:
        if self.first_other_rows is None:
            return "one kernel at every row count"
        parts = []
        if self.first_float_rows is not None:
            what = {"fp32-gemm": "kvcli's fp32 GEMM", "amx-bf16-gemm": "kvcli's bf16 GEMM on AMX tiles"}.get(
                self.gemm, f"{str(self.dense_dtype)[6:]} read-back + GEMM")
            parts.append(f"{what} from {self.dense_min_rows} rows")
        if self.int8_min_rows is not None:
            bounded = self.dense_over_int8 and self.first_float_rows is not None
            upto = f" to {self.dense_min_rows - 1}" if bounded else ""
            parts.append(f"kvcli's int8 GEMM (one activation level, two in outlier blocks) from {self.int8_min_rows}"
                         f"{upto} rows" + (" (the same rounding below)" if self.one_level else ""))
        return ", ".join(parts)  # (no float GEMM named where the int8 GEMM takes every row count it would)


ONE_ROUTE = RowRoute()
