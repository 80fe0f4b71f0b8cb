"""The "int8dot-cpu" form of a linear: the file's codes kept at their 4, 5, 6 or 8 bits, multiplied by activations
quantized to int8 per block of 32 with integer dot products (kvcli_kernels/cpu_int8dot.c).

This is what llama.cpp does on CPUs (Q4 x Q8): the weights are read once per call as 4-bit codes, with
no bf16 conversion of the activations (emulated, and slow, without AVX-512-BF16) and no dequantized
copy. Resident per weight: 4-bit codes + an fp16 scale (and min) per group (the GGUF Q4_0 / Q4_1 bytes:
Q4_0's code offset 8 taken off in the integer sum instead of a min) or
the file's own compact forms the kernel reads directly: K-quants' 8-bit multipliers of an fp16 value per
super-block, AWQ / GPTQ zero points (fp32 only where nothing else holds a value exactly); 5/6-bit codes
as nibbles + their high bits, the offset (Q5_0's 16, Q6_K's 32) taken off in the integer sum; Q8_0's
int8 codes; codes interleaved by 8 rows (kvcli_kernels/cpu_int8dot.c).
Calls with many rows (prefill chunks, big decode batches) run a float GEMM instead, with the weights
exact: on the AVX2 build (torch's kernels AVX2, bf16 emulated) from 32 rows kvcli's own fp32 GEMM over
weight panels dequantized on the fly (kvq_gemm_f32: with two int8 levels the integer kernel's ceiling
is below an fp32 GEMM's there, scripts/probe_int8_throughput.py); on AMX-BF16 CPUs from 256 rows the same in
bf16 on AMX tiles (kvq_gemm_bf16); elsewhere from 256 rows a read-back of the weight into a reused buffer and
torch's GEMM, bf16 where the CPU has native bf16 dot products. 4-bit codes take kvcli's integer GEMM instead
(kvq_gemm_i8: activations at one int8 level per block, llama.cpp's, and a second level in blocks holding an
outlier; as close to the fp32 model as the bf16 read-back it replaces, measured in cpu_int8dot.c) from 256 rows, or
from 9-32 rows in Q4_0 / Q4_1 forms (weight_plan.int8_gemm_min_rows); on AMX CPUs only below the bf16 GEMM's 256.

Not bit-exact with the exact path, but close: the weights are exact, and each activation is held as two
int8 levels per block of 32 (x ~ d (q1 + q2 / 256), d = max|x| / 127: ~15 bits, finer than bf16), except for
4-bit codes with one scale (and min) per 32 (Q4_0 / Q4_1, kvcli's own int4) where the int8 GEMM takes them: there
every row count rounds as kvq_gemm_i8 does, one level outside outlier blocks (the route's one_level; a row gets the
same bits from either kernel, and the small-row loop issues half the dot products). The bundled model (Q4_1) then
agrees with transformers' fp32 at 0.992 of 1,024 teacher-forced positions, kvcli's pick always inside the
reference's top 2 (tests/test_vs_transformers.py, 2026-12-07). Before, with two levels everywhere: on
the bundled model, teacher-forced over 1,024 positions (a /tmp probe like test_vs_transformers'
agreement test, 2026-12-01 ~09:00 UTC): top-1 agreement with transformers' fp32 0.999 and largest
logit error 0.03 (0.992 with prefill chunks read back to bf16); torch's int4 kernel with bf16
activations: 0.97, 0.8; llama.cpp's single int8 level (a first version of this kernel): 0.93, 3.1.
The native library is built at first use (a C compiler is needed); without one, or with
KVCLI_NATIVE=0, linears take torch's int4 kernel (int4-cpu / int4x2-cpu) instead.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvcli.native import registry
from kvcli.native.scratch import scratch
from kvcli_kernels.cpu_int8dot import (F16, F32, NEG_SUB, NONE, SUB, SUB_I8, ZERO, Groups, groups_x8, int8dot_dequant,
                                       int8dot_gemm_bf16, int8dot_gemm_f32, int8dot_gemm_i8, int8dot_linear,
                                       pack_x8_native, weight_args)

if TYPE_CHECKING:
    from kvcli.model.quant import QuantTensor
    from kvcli.model.weight_plan import TileRule
    from kvcli.model.row_route import RowRoute


def native_library():
    """The compiled kernel, or None (KVCLI_NATIVE=0, no compiler, a failed build: registry.unavailable); its
    AMX tiles turned on where the weight plan says (tile_rule)."""
    lib = registry.library("int8dot")
    if lib is not None:
        _tiles(lib)
    return lib


@functools.lru_cache(maxsize=None)
def _tiles(lib) -> "TileRule | None":
    """The weight plan's AMX rule, turned on in the library (weight_plan.int8dot_tiles_on), once per library."""
    from kvcli.model.weight_plan import int8dot_tiles_on
    from kvcli.native.capabilities import capabilities

    return int8dot_tiles_on(lib, capabilities())


def restore_tiles(lib) -> None:
    """The library's AMX switch back to the plan's rule (after a benchmark or test set it by hand)."""
    rule = _tiles(lib)
    lib.kvq_amx_enable(*(rule.args() if rule else (0, 0, 0)))


def tile_rule() -> "TileRule | None":
    """When the loaded int8 kernel computes on AMX tiles (None: never, or no library)."""
    lib = native_library()
    return None if lib is None else _tiles(lib)


def _plain(t: torch.Tensor) -> Groups:
    """Float group values: fp16 where that holds them exactly (GGUF's own fp16 scales), else fp32."""
    t = t.float()
    half = t.to(torch.float16)
    return Groups(F16, groups_x8(half)) if torch.equal(half.float(), t) else Groups(F32, groups_x8(t))


def code_offset(weight: "QuantTensor") -> int:
    """The constant code offset o of a 4-bit weight held as w = d q + m with m = -o d in every group (Q4_0's
    w = d (q - 8), which the loader writes with a min), else 0. The kernel takes o off in the integer sum
    (o x the activations' integer sum), so no min is stored: the file's 18 bytes per 32 weights."""
    if weight.kind != "q4" or weight.min is None or weight.offset or weight.zero is not None \
            or weight.sub_scale is not None or weight.sub_min is not None or weight.min.shape != weight.scale.shape:
        return 0
    d, m = weight.scale.float(), weight.min.float()
    nonzero = d.nonzero()
    if len(nonzero) == 0:
        return 0
    o = -m[tuple(nonzero[0])] / d[tuple(nonzero[0])]
    if not (o == o.round() and 1 <= o <= 15):
        return 0
    return int(o) if torch.equal(m, -int(o) * d) else 0


def _groups(weight: "QuantTensor", offset: int = 0) -> tuple[Groups, Groups]:
    """Scales and mins in the kernel's forms, the file's own where the kernel reads it (exact either way:
    the kernel computes the same fp32 products as QuantTensor.group_scales / group_mins). offset: a 4-bit
    weight's code_offset, which the kernel takes off instead of a min."""
    sub = weight.sub_scale
    if sub is not None and sub.dtype in (torch.uint8, torch.int8) and weight.scale.dtype == torch.float16:
        # K-quants: d (fp16 per super-block) * sc (8-bit per group; Q6_K's are signed)
        per = sub.shape[1] // weight.scale.shape[1]
        scale = Groups(SUB if sub.dtype == torch.uint8 else SUB_I8, groups_x8(sub), groups_x8(weight.scale), per)
    else:
        scale = _plain(weight.group_scales())
    if offset:  # Q4_0: the offset taken off in the kernel, no min held
        return scale, Groups(NONE)
    if weight.kind == "q4" and weight.offset:  # s (q - o) + m == s q + (m - s o), multiplied out once
        return scale, _plain(weight.with_float_min().min)
    if weight.zero is not None and weight.zero.dtype == torch.uint8:  # AWQ / GPTQ: min = -(zero * scale)
        return scale, Groups(ZERO, groups_x8(weight.zero))
    if weight.sub_min is not None and weight.sub_min.dtype == torch.uint8 and weight.min is not None \
            and weight.min.dtype == torch.float16:  # K-quants: min = -(dmin * m)
        per = weight.sub_min.shape[1] // weight.min.shape[1]
        return scale, Groups(NEG_SUB, groups_x8(weight.sub_min), groups_x8(weight.min), per)
    mins = weight.group_mins()
    return scale, (Groups(NONE) if mins is None else _plain(mins))


class Int8DotCpu:
    """A weight [N, K] as its file's codes, a scale and a min per group: 4-bit nibbles (per-32-block
    order); 5/6-bit codes as those nibbles plus their high bits (the file's bits, the code offset taken
    off by the kernel; 6-bit ones in Q6_K's layout of scales, else as int8); int8 (Q8_0). codes="i8" holds
    5/6-bit codes minus their offset as int8: the same products in more bytes, for tests and A/B runs."""

    def __init__(self, weight: "QuantTensor", codes: str = "packed", route: "RowRoute | None" = None) -> None:
        """route: from how many rows a float GEMM runs instead, and which (the weight plan's,
        kvcli/model/weight_plan.py; default: its choice for this machine)."""
        lib = native_library()
        assert lib is not None, f"int8dot-cpu needs the native library ({registry.unavailable('int8dot')})"
        self.lib = lib
        n, k = weight.shape
        self.out_features, self.in_features, self.group_size = n, k, weight.group_size
        offset = code_offset(weight)  # 4-bit weights only (0 otherwise); 5/6-bit offsets below
        self.scale, self.mins = _groups(weight, offset)
        if weight.kind == "q4":
            self.bits = 4
            q = weight.unpack_codes()
        elif codes == "packed" and weight.kind == "q5" and self.group_size % 32 == 0 or \
                codes == "packed" and weight.kind == "q6" and self.group_size == 16 and \
                (self.scale.kind, self.mins.kind) == (SUB_I8, NONE):  # the forms the kernel has loops for
            self.bits = 5 if weight.kind == "q5" else 6
            q, offset = weight.unpack_codes(), weight.offset  # 0 .. 31 / 0 .. 63
        else:  # Q8_0's codes as stored, or 5/6-bit codes minus their offset (Q6_K: -32..31)
            self.bits = 8
            q = weight.int8_codes()
        self.codes = pack_x8_native(lib, q, self.bits)
        if route is None:
            from kvcli.model.weight_plan import int8dot_route
            from kvcli.native.capabilities import capabilities

            route = int8dot_route(capabilities(), weight=weight)
        # Which kernel a call's row count takes: from route.int8_min_rows 4-bit codes take the integer GEMM with one
        # activation level (kvq_gemm_i8), from route.dense_min_rows a float GEMM (route.takes_int8 / takes_dense)
        self.route = route
        self.dense_dtype = route.dense_dtype
        # The float GEMM: a fused one (fp32, or bf16 on AMX tiles) where the route says, else (or where it is
        # refused) a read-back + torch's.
        self.gemm = {"fp32-gemm": int8dot_gemm_f32, "amx-bf16-gemm": int8dot_gemm_bf16}.get(route.gemm)
        # The integer kernel's rounding of the activations at every row count (the route's: one level where
        # kvq_gemm_i8 takes the weight, so that both kernels give a row the same bits).
        self.one_level = route.one_level
        self.args = weight_args(self.codes, self.bits, self.scale, self.mins, self.group_size, offset, self.one_level)

    def kernel_at_every_row_count(self) -> "Int8DotCpu":
        """Turn the row route off: the integer kernel at every row count, with the rounding it has (what benchmarks
        and tests time and check it by)."""
        from kvcli.model.row_route import RowRoute

        self.route = RowRoute(one_level=self.one_level)
        return self

    @property
    def dense_min_rows(self) -> int | None:
        return self.route.dense_min_rows

    @property
    def int8_min_rows(self) -> int | None:
        return self.route.int8_min_rows

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scale.nbytes + self.mins.nbytes

    @property
    def form(self) -> str:
        """How the codes are held, for `path` strings."""
        return f"{self.bits}-bit codes as stored"

    def dense(self, dtype: torch.dtype, first_row: int = 0, rows: int | None = None) -> torch.Tensor:
        """Rows first_row .. + rows of the weight [N, K] as `dtype` (fp32 or bf16) in a reused buffer:
        valid until the next read-back of the same shape."""
        rows = self.out_features - first_row if rows is None else rows
        out = scratch("int8dot-cpu:dense", (rows, self.in_features), dtype, keep_bytes=64 << 20)
        return int8dot_dequant(self.lib, self.args, out, first_row)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N] in x's dtype."""
        if self.route.takes_int8(x.shape[0]):
            y = int8dot_gemm_i8(self.lib, x.float().contiguous(), self.args, self.out_features)
            if y is not None:
                return y.to(x.dtype)
        if self.dense_min_rows is not None and x.shape[0] >= self.dense_min_rows:  # (or where the int8 GEMM refused)
            if self.gemm is not None:
                y = self.gemm(self.lib, x.float().contiguous(), self.args, self.out_features)
                if y is not None:
                    return y.to(x.dtype)
            return F.linear(x.to(self.dense_dtype), self.dense(self.dense_dtype)).to(x.dtype)
        if x.dtype != torch.float32 or not x.is_contiguous():
            return int8dot_linear(self.lib, x.float().contiguous(), self.args, self.out_features).to(x.dtype)
        return int8dot_linear(self.lib, x, self.args, self.out_features)
