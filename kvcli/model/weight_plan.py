"""How every weight runs, decided once at load: the one place that chooses.

From the weights' forms (QuantTensor kinds, plain dtypes, bitsandbytes 4-bit), the device, the compute
dtype, the CPU's capabilities (kvcli/native/capabilities.py) and which C kernels loaded
(kvcli/native/registry.py), `plan_model` returns a WeightPlan: for every layer linear its form and its
row-count route, the vocabulary projection's form, the embedding's, and whether a decode step runs every
layer in one C call. The model (llama.py) builds exactly what the plan says and never decides again;
`kvcli inspect` prints the plan.

The engine asks for a tier, from the file and the flags:
  "dense"  `--dequantize`, or nothing packed in the file: every weight in the compute dtype (exact)
  "nf4"    a dense checkpoint quantized by bitsandbytes at load (`--quant nf4`)
  "cpu"    the best CPU forms: kvcli's int8 kernel where it builds, else torch's int4 kernel
  "int4-cpu"  torch's int4 kernel even where kvcli's builds (tests and A/B runs)
  "triton" the Triton GEMMs (CUDA, or Triton's interpreter)
  "exact"  anything else (CUDA without Triton): codes dequantized per call, exact and slow
Each linear then takes one form (FORMS). Where a tier's kernel does not take a weight (a shape, a group
size, a code width it has no loop for), the weight takes the next form down the same tier, ending at
"dequant-torch": codes dequantized per call in plain torch, exact, resident as in the file.

The torch int4 tier ("int4-cpu" / "int4x2-cpu") runs only where kvcli's C kernels do not: no C compiler
(slim containers ship none), `KVCLI_NATIVE=0`, or non-x86 CPUs whose plain C build fails. It is kept:
without it such machines would decode through "dequant-torch", which expands every weight per call
(docs/architecture.md, "How a weight runs", has the measured gap).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch

from kvcli.model.bnb_4bit import Bnb4bitWeight
from kvcli.model.int4_cpu import KERNEL_GROUPS, packed_block_n
from kvcli.model.quant import QuantTensor
from kvcli.model.row_route import ONE_ROUTE, RowRoute
from kvcli.native.capabilities import CpuCapabilities
from kvcli_kernels.cpu_decode_layers import MAX_PARTS as NATIVE_DECODE_MAX_PARTS  # parts the C loop holds

FORMS = {
    "int8dot-cpu": "kvcli's CPU kernel: int8 activations x the file's 4/5/6/8-bit codes (model/int8dot_cpu.py)",
    "int4-cpu": "torch's packed int4 CPU kernel, bf16 activations (model/int4_cpu.py)",
    "int4x2-cpu": "5/6/8-bit codes as two nibbles through torch's int4 kernel (model/int4_cpu.py)",
    "triton": "kvcli_kernels.int4_matmul on 4-bit codes (CUDA)",
    "triton-int8": "kvcli_kernels.int4_matmul on 5/6/8-bit codes held as int8 (CUDA)",
    "dequant-torch": "codes dequantized per call in plain torch: exact, slow, resident as in the file",
    "half-torch": "an fp16/bf16 weight kept half precision, upcast per call",
    "dense": "the weight in the compute dtype",
    "nf4": "bitsandbytes NF4/FP4 (matmul_4bit)",
}
TIERS = ("dense", "nf4", "cpu", "int4-cpu", "triton", "exact")

# int8dot-cpu from this many rows runs a float GEMM instead (scripts' op benchmarks,
# docs/results/int8dot-ops*.txt, 2 threads, AMD EPYC, 2026-12-01): with native bf16 a read-back + torch's
# GEMM is as fast as the integer kernel from ~256 rows; with bf16 emulated (fp32 read-back) likewise.
INT8DOT_DENSE_MIN_ROWS = 256
# Not lowered on AMX CPUs, although read-back + torch's bf16 GEMM on AMX tiles ties the integer kernel from 32
# rows there (`git show 0c702f3:docs/results/int8dot-ops-1b.txt`): bf16 activations on 32-255-row prompts put the
# Q4_0 variant of tests/conformance past its bound against llama.cpp (3.7e-2 vs 3.0e-2 + 1e-3), 2026-12-05.
# On AMX-BF16 CPUs these calls take kvcli's bf16 GEMM on AMX tiles (kvq_gemm_bf16: the read-back's bf16 numbers,
# its weight panels dequantized on the fly, no 32-134 MB read-back buffer re-packed by oneDNN each call), from the
# same row count for the same precision reason.
# On the AVX2 build under torch's AVX2 kernels, kvcli's fused fp32 GEMM beats the integer kernel from 16-64
# rows (docs/results/int8dot-ops-avx2*.txt): at 16 rows 0.97-1.13x its time, at 64 rows 0.60-0.94x.
GEMM_F32_MIN_ROWS = 32
# On CPUs with AMX-INT8 the integer kernel computes its sums on tiles (cpu_int8dot.c: the same sums, bit for bit,
# so no rule here changes a result) from this many rows and rows x K activations per call. Interleaved in-engine
# A/B of verify-like steps (a cached 512-token context + n rows; 2-core Xeon, 2026-12-05, with the loop's
# prefetching): 1B shape (K 2048 / 8192) tiles 1.02x the loop's step time at 6 rows, 0.86x at 8, 0.76x at 12;
# SmolLM2-135M (K 576 / 1536) 1.28x at 6, 1.03x at 12, 0.88x at 16: too little work per block at small K for the
# tiles' overheads, hence the activation count. Per linear: python -m kvcli.bench int8dot-ops-1b.
INT8DOT_AMX_MIN_ROWS = 8
INT8DOT_AMX_MIN_ELEMS = 9216
# 8-bit codes (Q8_0: the vocabulary table of most GGUFs, Q8_0 files' linears) from 3 rows at any K: their dpbusd
# loop costs twice the 4-bit one's per product (sign moves, two levels over twice the bytes), and the tiles took
# 0.89-0.97x its time at 3 rows, 0.66-0.78x at 4, 0.51-0.65x at 6 on SmolLM2's and the 1B shape's linear shapes,
# 1.08-1.26x at 2 (2-core Xeon, 2026-12-07, ad hoc per-linear timings); the vocabulary table in
# docs/results/int8dot-ops.txt. A verification step's rows (speculation: logits for every row) take them.
INT8DOT_AMX_MIN_ROWS_8BIT = 3
# 4-bit codes take kvq_gemm_i8 from this many rows, on AMX CPUs only below INT8DOT_DENSE_MIN_ROWS (dense_over_int8)
# (activations at one int8 level per block, a second in blocks holding an outlier: cpu_int8dot.c), where the float
# GEMMs above ran: on the 1B shape's linears at 256-512 rows 0.72-0.87x the bf16 read-back's time on AVX-512-VNNI
# and 0.74-0.86x the fused fp32 GEMM's on the AVX2 build,
# 0.39-0.76x from 32 to 64 rows (AMD EPYC, 2026-12-06; python -m kvcli.bench int8-gemm-1b, int8-gemm-1b-avx2).
# Not lower in general: from 32 rows the Q4_K variant of tests/conformance went past its bound against llama.cpp
# (5.2e-2 vs the exact model's 4.2e-2 + 1e-3, 2026-12-06: llama.cpp rounds Q4_K's activations per 256, not per 32),
# the same reason the float GEMMs start at 256 where bf16 runs.
INT8_GEMM_MIN_ROWS = 256
# ... but from 32 rows for 4-bit codes with one scale (and min) per group of 32, no sub-scales or zero points (the
# Q4_0 / Q4_1 forms, kvcli's own int4): llama.cpp rounds these forms' activations to one int8 level per 32 itself
# (Q8_0 / Q8_1), as kvq_gemm_i8 does outside outlier blocks, and with the int8 GEMM from 32 rows the Q4_0 / Q4_1
# variants came closer to llama.cpp, not farther (2.45e-2 / 2.47e-2 against the exact model's 2.98e-2 / 3.15e-2,
# 2026-12-06). Where batched decode steps of 32-64 rows run (the 64-request trace), that is 0.39-0.76x the time of
# the float GEMMs above (the tables named above). On the AVX2 build from 32 (the fp32 GEMM's own threshold there);
# on AVX-512-VNNI from 9, below that the small-row kernel, which rounds these forms the same way (one_level in
# int8dot_route) and gives a row the same bits, so where the switch lies is a matter of speed alone. Its 16-column
# loop unpacks a block once for up to 8 rows (ONE_LEVEL_M in cpu_int8dot.c), with no panels packed per call: on the
# 1B shape's linears 0.69x kvq_gemm_i8's time at 6 rows, 0.97x at 12, 1.19x at 24; on SmolLM2's 0.93x at 6, 0.97x
# at 8, 1.16x at 12 (2-core Xeon with AMX, 2026-12-07, ad hoc per-linear timings). Before that loop (8 columns, 4
# rows a pass) the switch was at 6 rows (AMD EPYC, 2026-12-07). Held to AVX2 the small-row kernel stayed ahead on
# the 1B shape up to 16 rows (AMD EPYC, 2026-12-07).
INT8_GEMM_BLOCK32_MIN_ROWS = 32
INT8_GEMM_BLOCK32_MIN_ROWS_VNNI = 9
INT4_DENSE_MIN_ROWS = 256  # torch's int4 kernel: from about here on a read-back + GEMM beats it (both ISAs)
TRITON_INT8_GROUPS = (16, 32, 64, 128)




@dataclass(frozen=True)
class Native:
    """Which of kvcli's C kernels loaded (kvcli/native/registry.py), for the planner's choices."""

    int8dot: bool = False
    rmsnorm: bool = False
    swiglu: bool = False
    decode_layers: bool = False
    build_isa: str = "generic"
    int8_tiles: "TileRule | None" = None  # when the int8 kernel's sums run on AMX tiles (None: never)

    @staticmethod
    def here(device: torch.device, dtype: torch.dtype) -> "Native":
        """What loads on this machine for a model on `device` computing in `dtype` (C kernels read fp32 rows
        on the CPU only)."""
        from kvcli.native import registry
        from kvcli.native.capabilities import build_isa

        if device.type != "cpu" or not registry.enabled():
            return Native()
        from kvcli.native.capabilities import capabilities

        fp32 = dtype == torch.float32
        lib = registry.library("int8dot")
        tiles = int8dot_tiles_on(lib, capabilities()) if lib is not None else None
        return Native(int8dot=lib is not None, int8_tiles=tiles,
                      rmsnorm=fp32 and registry.library("rmsnorm") is not None,
                      swiglu=fp32 and registry.library("swiglu") is not None,
                      decode_layers=fp32 and registry.library("decode_layers") is not None, build_isa=build_isa())


@dataclass(frozen=True)
class LinearPlan:
    """One matmul of the model: the weights it is made of (in output order), its form and its route."""

    names: tuple[str, ...]
    form: str
    route: RowRoute = ONE_ROUTE
    bias: bool = False

    def describe(self) -> str:
        return self.form if self.route.first_other_rows is None else f"{self.form} ({self.route.describe()})"


@dataclass(frozen=True)
class ProjectionPlan:
    """A fused projection of one layer (qkv, o, gate_up, down): one LinearPlan, or several side by side
    (a LinearGroup: parts whose layouts cannot be concatenated, e.g. Q4_K_M's q/k in Q4_K and v in Q6_K)."""

    name: str
    parts: tuple[LinearPlan, ...]
    bias: bool = False  # one bias over the whole output (held by the group when there are several parts)

    @property
    def grouped(self) -> bool:
        return len(self.parts) > 1


@dataclass(frozen=True)
class HeadPlan:
    """The vocabulary projection: "int8dot-cpu" (the quantized table multiplied as stored) or "dense" (the
    table expanded once into `dtype`); `fp32_slices`: from 4 rows a dense bf16 table is multiplied in fp32
    1024-row slices (CPUs where bf16 is emulated)."""

    form: str
    dtype: torch.dtype
    tied: bool
    route: RowRoute = ONE_ROUTE
    fp32_slices: bool = False

    def describe(self) -> str:
        src = "the embedding table" if self.tied else "lm_head"
        if self.form == "int8dot-cpu":
            extra = "" if self.route.first_other_rows is None else f", {self.route.describe()}"
            return f"int8dot-cpu ({src} as stored{extra})"
        slices = ", fp32 slices from 4 rows" if self.fp32_slices else ""
        return f"{str(self.dtype)[6:]} GEMM ({src}{slices})"


@dataclass(frozen=True)
class WeightPlan:
    tier: str
    device: str
    dtype: torch.dtype
    layers: tuple[tuple[ProjectionPlan, ...], ...]  # per layer: qkv, o, gate_up, down
    head: HeadPlan
    embedding: str
    native_norms: bool  # RMSNorm through kvcli's C kernel
    native_swiglu: bool
    native_decode: bool  # a decode step's layers in one C call (model/native_decode.py)
    native_decode_why: str  # why not, or what it covers
    native_decode_max_rows: int | None  # steps of fewer rows only (the linears' float-GEMM threshold)
    row_invariant: bool
    notes: tuple[str, ...] = field(default_factory=tuple)
    int8_tiles: TileRule | None = None  # when int8dot-cpu's integer sums run on AMX tiles

    @property
    def kvcli_quantized(self) -> bool:
        """Whether layer linears take kvcli's own quantized forms (not dense, half or bitsandbytes' nf4): what
        the KV dtype's auto rule asks."""
        return any(p.form not in ("dense", "half-torch", "nf4") for p in self.linears())

    @property
    def has_row_routes(self) -> bool:
        """Whether some matmul takes another path from some row count on (what row invariance turns off)."""
        return self.head.fp32_slices or self.head.route.first_other_rows is not None or any(
            p.route.first_other_rows is not None for p in self.linears())

    def linears(self) -> Iterable[LinearPlan]:
        for layer in self.layers:
            for proj in layer:
                yield from proj.parts

    def forms(self) -> str:
        """The forms the layer linears take, e.g. "int8dot-cpu" or "int4-cpu+int4x2-cpu"."""
        return "+".join(dict.fromkeys(p.form for p in self.linears()))

    def by_projection(self) -> dict[str, dict[str, int]]:
        """Projection name (q_proj, ...) -> {form: layers}: what inspect shows."""
        out: dict[str, dict[str, int]] = {}
        for p in self.linears():
            for name in p.names:
                proj = name.rsplit(".", 2)[-2]
                counts = out.setdefault(proj, {})
                counts[p.form] = counts.get(p.form, 0) + 1
        return out

    def describe(self) -> list[tuple[str, str]]:
        """(what, how) rows for `kvcli inspect`."""
        rows = []
        routes: dict[str, set[str]] = {}
        for p in self.linears():
            routes.setdefault(p.form, set()).add(p.route.describe())
        for form, rs in routes.items():
            rows.append((f"linears {form}", f"{FORMS[form]}; {', '.join(sorted(rs))}"))
        rows.append(("vocabulary projection", self.head.describe()))
        if self.int8_tiles is not None:
            rows.append(("int8 tiles", self.int8_tiles.describe()))
        rows.append(("embedding", self.embedding))
        rows.append(("one-call decode", ("yes: " if self.native_decode else "no: ") + self.native_decode_why))
        if self.row_invariant:
            rows.append(("row-invariant", "one matmul path at every row count (--attention-backend invariant)"))
        rows.extend(("note", n) for n in self.notes)
        return rows


# --- one weight -------------------------------------------------------------------------------------------

def int8dot_takes(weight: QuantTensor, rows: int | None = None) -> bool:
    """Whether kvcli's int8 kernel has a loop for this weight's shape and groups."""
    n, k = weight.shape
    n = rows or n
    g = weight.group_size
    # Groups of 16 (Q6_K) for 5/6/8-bit codes without mins: the kernel splits each block of 32 in two.
    groups_ok = g % 32 == 0 or (g == 16 and weight.kind != "q4" and weight.group_mins() is None)
    return n % 8 == 0 and k % 32 == 0 and k % g == 0 and groups_ok


def rounds_per_32(weight: QuantTensor) -> bool:
    """4-bit codes with one scale (and min) per group of 32, no sub-scales or zero points: the forms llama.cpp
    itself multiplies with activations rounded to one int8 level per 32 (Q4_0 / Q4_1, kvcli's own int4)."""
    return weight.kind == "q4" and weight.group_size == 32 and weight.sub_scale is None and \
        weight.sub_min is None and weight.zero is None


def int8_gemm_min_rows(weight: QuantTensor, build_isa: str) -> int | None:
    """From how many rows kvq_gemm_i8 may take this weight on a CPU without AMX (None: never; it takes 4-bit codes
    only): INT8_GEMM_BLOCK32_MIN_ROWS(_VNNI) for the forms rounded per 32 (rounds_per_32), INT8_GEMM_MIN_ROWS for
    the others (see both)."""
    if weight.kind != "q4":
        return None
    if not rounds_per_32(weight):
        return INT8_GEMM_MIN_ROWS
    return INT8_GEMM_BLOCK32_MIN_ROWS_VNNI if build_isa == "avx512vnni" else INT8_GEMM_BLOCK32_MIN_ROWS


def int8dot_route(caps: CpuCapabilities, row_invariant: bool = False, weight: QuantTensor | None = None) -> RowRoute:
    """The row route of an int8dot-cpu weight (without `weight`: never the int8 GEMM, as for the vocabulary
    table)."""
    if row_invariant:
        return ONE_ROUTE
    dense_dtype = torch.bfloat16 if caps.native_bf16 else torch.float32
    int8_ok = weight is not None and caps.build_isa in ("avx2", "avx512vnni")
    int8 = int8_gemm_min_rows(weight, caps.build_isa) if int8_ok else None
    # Where the int8 GEMM takes a form rounded per 32, the small-row kernel rounds and sums as it does: one
    # activation level outside outlier blocks at every row count (half the two-level loop's dot products), a
    # row's result the same whichever kernel its call takes (speculation's verification rows against plain decode).
    one_level = int8_ok and rounds_per_32(weight)
    if caps.amx_bf16:  # the read-back's numbers, on AMX tiles without the read-back (a read-back where refused)
        # from INT8DOT_DENSE_MIN_ROWS, where it takes 0.33-0.40x the int8 GEMM's time (the 1B shape's linears at 256
        # and 512 rows, docs/results/int8dot-ops-1b.txt, a Xeon with AMX, 2026-12-07). Below it the forms rounded per
        # 32 take the int8 GEMM and one level as elsewhere (with the 16-column small-row loop: the bundled model's
        # decode 1.10x, a 6-row verification step's ratio to a 1-row one 0.81x the two-level tree's on that Xeon,
        # docs/results/ab-amx-one-level*.txt), the others two levels (on int8 tiles, int8dot_tiles).
        if not one_level:
            return RowRoute(INT8DOT_DENSE_MIN_ROWS, "amx-bf16-gemm", torch.bfloat16)
        return RowRoute(INT8DOT_DENSE_MIN_ROWS, "amx-bf16-gemm", torch.bfloat16, int8, True, dense_over_int8=True)
    if caps.fp32_gemm_preferred:
        return RowRoute(GEMM_F32_MIN_ROWS, "fp32-gemm", dense_dtype, int8, one_level)
    return RowRoute(INT8DOT_DENSE_MIN_ROWS, "read-back", dense_dtype, int8, one_level)


@dataclass(frozen=True)
class TileRule:
    """int8dot-cpu's integer sums on AMX tiles for calls of at least `min_rows` rows and `min_elems` activations
    (rows x K), of 8-bit codes from `min_rows_8bit` rows; the dpbusd loop otherwise."""
    min_rows: int
    min_elems: int
    min_rows_8bit: int

    def args(self) -> tuple[int, int, int]:
        """kvq_amx_enable's arguments."""
        return self.min_rows, self.min_elems, self.min_rows_8bit

    def describe(self) -> str:
        return (f"AMX tiles from {self.min_rows} rows and {self.min_elems} activations (rows x K) a call, 8-bit codes "
                f"from {self.min_rows_8bit} rows: int8dot-cpu's integer sums, the same bit for bit")


def int8dot_tiles(caps: CpuCapabilities) -> TileRule | None:
    """When the int8 kernel runs its integer sums on AMX tiles here (None: never)."""
    return TileRule(INT8DOT_AMX_MIN_ROWS, INT8DOT_AMX_MIN_ELEMS, INT8DOT_AMX_MIN_ROWS_8BIT) if caps.amx_int8 else None


def int8dot_tiles_on(lib, caps: CpuCapabilities) -> TileRule | None:
    """int8dot_tiles' rule turned on in the loaded int8 library (once per process: kvcli/native/tiles.py), or None
    where there is no rule or Linux or the build refuse the tiles."""
    from kvcli.native.tiles import turn_on

    rule = int8dot_tiles(caps)
    return rule if rule is not None and turn_on(lib, *rule.args()) else None


def int4_route(caps: CpuCapabilities, row_invariant: bool = False) -> RowRoute:
    """torch's int4 kernel; from INT4_DENSE_MIN_ROWS a read-back (None where torch's packed layout is not
    recognised: model/int4_cpu.py probes it)."""
    if row_invariant or packed_block_n() is None:
        return ONE_ROUTE
    return RowRoute(INT4_DENSE_MIN_ROWS, "read-back", torch.bfloat16 if caps.native_bf16 else torch.float32)


def plan_linear(weight: QuantTensor | Bnb4bitWeight | torch.Tensor, tier: str, dtype: torch.dtype,
                caps: CpuCapabilities, native: Native, *, row_invariant: bool = False,
                names: tuple[str, ...] = (), bias: bool = False, rows: int | None = None) -> LinearPlan:
    """The form and route of one weight under `tier`; `rows`: its output features once fused with its
    neighbours of the same layout (the decision reads only the layout and the shape)."""
    if tier not in TIERS:
        raise ValueError(f"unknown weight tier {tier!r} (one of {', '.join(TIERS)})")
    mk = lambda form, route=ONE_ROUTE: LinearPlan(names, form, route, bias)  # noqa: E731
    if isinstance(weight, Bnb4bitWeight):  # a bitsandbytes 4-bit checkpoint: its own bytes, as saved
        return mk("dense" if tier == "dense" else "nf4")
    if not isinstance(weight, QuantTensor):
        if tier == "nf4":
            return mk("nf4")
        half = weight.dtype in (torch.float16, torch.bfloat16) and weight.dtype != dtype and weight.dim() == 2
        return mk("half-torch" if half and tier != "dense" else "dense")
    if tier in ("dense", "nf4"):
        return mk("dense")
    n = rows or weight.shape[0]
    if tier == "cpu":
        if native.int8dot and int8dot_takes(weight, n):
            return mk("int8dot-cpu", int8dot_route(caps, row_invariant, weight))
        tier = "int4-cpu"
    if tier == "int4-cpu":
        if weight.kind != "q4":
            if n % 16 == 0 and 2 * weight.group_size in KERNEL_GROUPS:
                return mk("int4x2-cpu")
        elif n % 16 == 0 and weight.offset == 0:
            return mk("int4-cpu", int4_route(caps, row_invariant))
    if tier == "triton":
        if weight.kind != "q4":
            if weight.group_size in TRITON_INT8_GROUPS:
                return mk("triton-int8")
        elif weight.with_float_min().plain_groups:
            return mk("triton")
    return mk("dequant-torch")  # CPU rows not a multiple of 16, a layout the kernel does not read, "exact"


# --- the model ----------------------------------------------------------------------------------------------

def fuse_runs(parts: list) -> list[list[int]]:
    """Indices of neighbouring parts that can be concatenated into one matmul (quantized of one layout, or
    tensors of one dtype; a bitsandbytes weight never is)."""
    def key(p) -> object:
        if isinstance(p, QuantTensor):
            return ("quant", p.layout())
        if isinstance(p, torch.Tensor):
            return ("tensor", p.dtype)
        return object()

    runs: list[list[int]] = []
    last = None
    for i, p in enumerate(parts):
        k = key(p)
        if runs and k == last:
            runs[-1].append(i)
        else:
            runs.append([i])
        last = k
    return runs


PROJECTIONS = (("qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")), ("o", ("self_attn.o_proj",)),
               ("gate_up", ("mlp.gate_proj", "mlp.up_proj")), ("down", ("mlp.down_proj",)))


def plan_model(config, weights: dict, *, tier: str, dtype: torch.dtype, device: torch.device,
               head_dtype: torch.dtype, caps: CpuCapabilities, native: Native,
               row_invariant: bool = False) -> WeightPlan:
    """The plan for a llama-family model's weights (HF names), read without being changed."""
    layers = []
    for i in range(config.num_layers):
        projs = []
        for proj, names in PROJECTIONS:
            full = [f"model.layers.{i}.{n}.weight" for n in names]
            parts = [weights[n] for n in full]
            # q/k/v's by the config (Qwen2 always); o's where the file has one (transformers' Llama, Qwen3 and Gemma
            # give o_proj a bias under attention_bias, Qwen2 does not)
            bias = (proj == "qkv" and bool(config.attention_bias)) or (
                proj == "o" and f"model.layers.{i}.self_attn.o_proj.bias" in weights)
            if tier == "dense" and len(fuse_runs(parts)) > 1:  # one dense matmul after all
                runs = [list(range(len(parts)))]
            else:
                runs = fuse_runs(parts)
            plans = tuple(plan_linear(parts[run[0]], tier, dtype, caps, native, row_invariant=row_invariant,
                                      names=tuple(full[j] for j in run), bias=bias and len(runs) == 1,
                                      rows=sum(parts[j].shape[0] for j in run)) for run in runs)
            projs.append(ProjectionPlan(proj, plans, bias))
        layers.append(tuple(projs))

    # The file's own lm_head when it has one, tie_word_embeddings or not (transformers 5 keeps a checkpoint's
    # lm_head.weight too; a file saved tied holds none, or the same values)
    tied = "lm_head.weight" not in weights
    table = weights["model.embed_tokens.weight"] if tied else weights["lm_head.weight"]
    if tier == "cpu" and isinstance(table, QuantTensor) and native.int8dot and int8dot_takes(table):
        route = int8dot_route(caps, row_invariant)
        # Never a read-back for the whole vocabulary (a 57-113 MB transient): the fused GEMM, or one kernel; never
        # the int8 GEMM's one activation level either (the logits perplexity scores).
        head = HeadPlan("int8dot-cpu", torch.float32, tied, route if route.gemm == "fp32-gemm" else ONE_ROUTE)
    else:
        slices = (device.type == "cpu" and head_dtype == torch.bfloat16 and not caps.native_bf16
                  and not row_invariant)
        head = HeadPlan("dense", head_dtype, tied, fp32_slices=slices)

    emb = weights["model.embed_tokens.weight"]
    if isinstance(emb, QuantTensor) and tied and head.form == "int8dot-cpu":
        embedding = f"{emb.kind} table held once, by the vocabulary projection: rows read back per lookup"
    elif isinstance(emb, QuantTensor):
        embedding = f"{emb.kind} table as stored, rows dequantized per lookup"
    else:
        embedding = f"{str(emb.dtype if emb.dtype in (torch.float16, torch.bfloat16) else dtype)[6:]} table"

    plan = WeightPlan(tier=tier, device=str(device), dtype=dtype, layers=tuple(layers), head=head, embedding=embedding,
                      native_norms=native.rmsnorm, native_swiglu=native.swiglu and native.build_isa != "generic",
                      native_decode=False, native_decode_why="", native_decode_max_rows=None,
                      row_invariant=row_invariant)
    if tier == "cpu" and native.int8_tiles is not None and (
            head.form == "int8dot-cpu" or any(p.form == "int8dot-cpu" for p in plan.linears())):
        plan = replace(plan, int8_tiles=native.int8_tiles)
    ok, why, max_rows = _native_decode(plan, native)
    return replace(plan, native_decode=ok, native_decode_why=why, native_decode_max_rows=max_rows)


def _native_decode(plan: WeightPlan, native: Native) -> tuple[bool, str, int | None]:
    """Whether every layer runs on kvcli's C kernels, so a decode step can take them all in one C call."""
    if not native.decode_layers or native.build_isa == "generic":
        return False, "the one-call decode library is not available (kvcli C kernels off, not built, or plain C)", None
    if plan.dtype != torch.float32 or not plan.device.startswith("cpu"):
        return False, "fp32 compute on the CPU only", None
    if not (plan.native_norms and plan.native_swiglu):
        return False, "RMSNorm / SwiGLU kernels not available", None
    for layer in plan.layers:
        for proj in layer:
            if proj.bias and proj.name != "qkv":  # (the C loop adds q/k/v's, Qwen2's)
                return False, f"{proj.name} has a bias", None
            if len(proj.parts) > NATIVE_DECODE_MAX_PARTS:
                return False, f"{proj.name} has {len(proj.parts)} parts (the C loop holds {NATIVE_DECODE_MAX_PARTS})", None
            for p in proj.parts:
                if p.form != "int8dot-cpu":
                    return False, f"{proj.name} runs {p.form}", None
    rows = [p.route.first_float_rows for p in plan.linears() if p.route.first_float_rows is not None]
    max_rows = min(rows) if rows else None
    return True, f"every layer, steps of one token per request{f' and under {max_rows} rows' if max_rows else ''}", \
        max_rows


def choose_tier(weights: dict, *, gguf_file: bool, dense_linears: str | None, dequantize: bool,
                device: torch.device, backend: str, dtype: torch.dtype) -> tuple[str, torch.dtype]:
    """The tier the engine asks for, and the vocabulary projection's dtype where it is a dense table.

    Packed: any quantized linear, or (GGUF only) fp16/bf16 linears, which stay half precision. On the CPU a
    file with quantized linears takes a bf16 dense vocabulary table (half of fp32's bytes) where its table
    is not multiplied as stored; without quantized linears (e.g. an F16 file) everything stays in the
    compute dtype."""
    projs = [w for name, w in weights.items() if name.endswith("proj.weight")]
    codes = any(isinstance(w, QuantTensor) for w in projs)
    has_packed = codes or (gguf_file and any(isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype in (
        torch.float16, torch.bfloat16) for w in projs))
    if dequantize or not (has_packed or dense_linears == "nf4"):
        return "dense", dtype
    if dense_linears == "nf4":
        return "nf4", dtype
    if device.type == "cpu":
        return "cpu", (torch.bfloat16 if codes else dtype)
    return ("triton" if backend == "triton" else "exact"), dtype


def plan_loaded(loaded, *, dequantize: bool, device: torch.device, dtype: torch.dtype, backend: str,
                caps: CpuCapabilities | None = None, native: Native | None = None) -> WeightPlan:
    """The plan for loaded weights (kvcli/model/loader.py LoadedWeights) on this machine; KeyError names a
    missing weight."""
    from kvcli.native.capabilities import capabilities

    tier, head_dtype = choose_tier(loaded.weights, gguf_file=any(k.startswith("gguf:") for k in loaded.formats),
                                   dense_linears=loaded.dense_linears, dequantize=dequantize, device=device,
                                   backend=backend, dtype=dtype)
    return plan_model(loaded.config, loaded.weights, tier=tier, dtype=dtype, device=device, head_dtype=head_dtype,
                      caps=caps or capabilities(), native=native or Native.here(device, dtype),
                      row_invariant=backend == "invariant")
