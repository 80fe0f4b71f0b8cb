"""kvcli's CPU kernel for quantized linears (int8dot-cpu, kernels/cpu_int8dot.c) against a plain torch
reference: x @ W^T in float64 with W the QuantTensor's exact dequantization.

Random weights of each code kind (4-bit with and without mins, fp16 and fp32 scales, groups of 32 and
128; int8; 5/6-bit as int8 with an offset) and random activations of ragged row counts, every build the
machine can run (the plain C one everywhere, AVX2, AVX-512-VNNI). The kernel holds activations as two
int8 levels per block of 32 (~15 bits): the error bound below is ~40x tighter than torch's bf16 int4
kernel reaches on the same data (test_int4_cpu.py), so a dropped level, a wrong block order or a
mis-signed code fails it.
"""

from __future__ import annotations

import pytest
import torch

from cpu_paths import runnable_isas
from kvcli.model import int8dot_cpu
from kvcli.model.int8dot_cpu import Int8DotCpu
from kvcli.model.quant import QuantTensor, pack_nibbles
from kvcli.native import registry
from kvcli.native.capabilities import capabilities

pytestmark = pytest.mark.skipif(int8dot_cpu.native_library() is None,
                                reason=f"native kernel: {registry.status()}")

REL_BOUND = 2e-4  # of the largest |y| per row; measured 2e-5 .. 5e-5 on these shapes


@pytest.fixture(params=runnable_isas())
def isa(request, monkeypatch):
    monkeypatch.setattr(registry, "build_isa", lambda: request.param)
    return request.param


def _q4(n: int, k: int, g: int, mins: bool, f32_scales: bool, gen: torch.Generator) -> QuantTensor:
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    scale = torch.rand(n, k // g, generator=gen) * 0.02 + 1e-3
    if f32_scales:  # like two-level K-quant scales multiplied out: not representable in fp16
        scale = scale * (1 + 1e-4)
    else:
        scale = scale.half()
    mn = (-(torch.rand(n, k // g, generator=gen) * 0.2)).to(scale.dtype) if mins else None
    return QuantTensor("q4", pack_nibbles(codes), scale, mn, g)


def _q8(n: int, k: int, gen: torch.Generator) -> QuantTensor:
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)  # -128 included
    scale = (torch.rand(n, k // 32, generator=gen) * 0.01 + 1e-4).half()
    return QuantTensor("q8", codes, scale, None, 32)


def _q6(n: int, k: int, gen: torch.Generator) -> QuantTensor:
    """6-bit codes 0..63 with offset 32 (Q6_K's), one plain scale per 32."""
    q = torch.randint(0, 64, (n, k), dtype=torch.uint8, generator=gen)
    hi = q >> 4
    hi_packed = (hi.view(n, k // 4, 4) << torch.tensor([0, 2, 4, 6], dtype=torch.uint8)).sum(-1).to(torch.uint8)
    scale = (torch.rand(n, k // 32, generator=gen) * 0.01 + 1e-4).half()
    return QuantTensor("q6", pack_nibbles(q & 15), scale, None, 32, hi=hi_packed, offset=32)


def _gguf(type_name: str):
    """Random well-formed blocks of a GGML type, decoded by kvcli's loader (K-quants keep their two levels)."""
    import numpy as np

    from kvcli.model.gguf_loader import _DECODERS
    from kvcli.model.kquant_encode import random_blocks

    def make(n: int, k: int, gen: torch.Generator) -> QuantTensor:
        rng = np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=gen)))
        raw = random_blocks(type_name, n, k, rng, scale=0.02)
        return _DECODERS[type_name](torch.from_numpy(raw.copy()), n, k)
    return make


def _zero_points(n: int, k: int, gen: torch.Generator) -> QuantTensor:
    """AWQ / GPTQ style: w = (q - zero) * scale, a uint8 zero point per group of 64."""
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(n, k // 64, generator=gen) * 0.02 + 1e-3).half()
    zero = torch.randint(0, 16, (n, k // 64), dtype=torch.uint8, generator=gen)
    return QuantTensor("q4", pack_nibbles(codes), scale, None, 64, zero=zero)


OUTLIER = 4.0  # IG_OUTLIER in cpu_int8dot.c: a block keeps its second level past this many times its row's RMS
PER_32 = ("Q4_0 offset 8", "q4 min fp16 g32", "q4 no-min fp16 g32")  # weight_plan.rounds_per_32: one level
WEIGHTS = {
    "Q4_K two-level": _gguf("Q4_K"),
    "Q5_K two-level": _gguf("Q5_K"),
    "Q6_K groups of 16": _gguf("Q6_K"),
    "Q5_1": _gguf("Q5_1"),
    "Q4_0 offset 8": _gguf("Q4_0"),
    "zero points g64": _zero_points,
    "q4 min fp16 g32": lambda n, k, gen: _q4(n, k, 32, True, False, gen),
    "q4 no-min fp16 g32": lambda n, k, gen: _q4(n, k, 32, False, False, gen),
    "q4 min fp32 g128": lambda n, k, gen: _q4(n, k, 128, True, True, gen),
    "q8 fp16": _q8,
    "q6 offset 32": _q6,
}


def _check(lin: Int8DotCpu, w: torch.Tensor, x: torch.Tensor) -> float:
    y = lin(x)
    ref = x.double() @ w.double().t()
    err = ((y.double() - ref).abs().amax(-1) / ref.abs().amax(-1)).max().item()
    return err


@pytest.mark.parametrize("kind", list(WEIGHTS))
def test_matches_float64_reference(isa, kind):
    """Two levels: within REL_BOUND of the exact product. Forms rounded per 32 where the int8 GEMM takes them
    (one_level): within fp32 rounding of the product with x rounded as kvq_gemm_i8 rounds it."""
    gen = torch.Generator().manual_seed(7)
    n, k = 136, 256  # 17 groups of 8 rows: tiles of 4 groups plus a partial one
    q = WEIGHTS[kind](n, k, gen)
    lin = Int8DotCpu(q)
    lin.kernel_at_every_row_count()
    # (the route reads this machine's build, not the isa fixture's library)
    assert lin.one_level == (kind in PER_32 and capabilities().build_isa in ("avx2", "avx512vnni"))
    w = q.dequantize()
    for rows in (1, 2, 3, 5, 8, 33):  # every tail of the 4-row tiles
        x = torch.randn(rows, k, generator=gen) * torch.rand(1, k, generator=gen) * 3
        x[:, 5] *= 40  # an outlier channel, as real activations have
        if lin.one_level:
            ref = _i8_reference(q, x, OUTLIER)
            err = ((lin(x).double() - ref).abs().amax(-1) / ref.abs().amax(-1)).max().item()
            assert err < 1e-5, f"{isa} {kind} rows {rows}: max relative error {err:.2e} against the one-level rounding"
            continue
        err = _check(lin, w, x)
        assert err < REL_BOUND, f"{isa} {kind} rows {rows}: max relative error {err:.2e}"


@pytest.mark.parametrize("kind", ["Q5_K two-level", "Q6_K groups of 16", "Q5_1", "Q5_0", "q6 offset 32"])
def test_packed_codes_equal_signed_codes_bitwise(isa, kind):
    """5/6-bit codes held as the file's bits (nibbles + high bits), unsigned, with the offset taken off
    after as offset x the activations' integer sum, give the signed int8 form's outputs bit for bit: both
    are exact integer sums. Groups of 16 (Q6_K), every tail of the 4-row tiles, the read-back. 6-bit codes
    in another scale layout than Q6_K's (no kernel loop for them) are held as int8."""
    gen = torch.Generator().manual_seed(11)
    q = (WEIGHTS.get(kind) or _gguf(kind))(136, 512, gen)
    packed, signed = Int8DotCpu(q), Int8DotCpu(q, codes="i8")
    bits = 8 if kind == "q6 offset 32" else 5 if q.kind == "q5" else 6
    assert (packed.bits, signed.bits) == (bits, 8)
    assert packed.codes.numel() == 136 * 512 * bits // 8
    packed.kernel_at_every_row_count(), signed.kernel_at_every_row_count()
    for rows in (1, 2, 3, 4, 5, 9):
        x = torch.randn(rows, 512, generator=gen) * 3
        x[:, 7] *= 50
        assert torch.equal(packed(x), signed(x)), f"{isa} {kind} rows {rows}"
    assert torch.equal(packed.dense(torch.float32), q.dequantize())


def test_a_form_without_a_kernel_loop_is_an_error():
    """6-bit codes packed with plain per-32 scales: kvq_linear refuses them (-3) rather than run a loop
    for another form."""
    from kvcli_kernels.cpu_int8dot import int8dot_linear, pack_x8_native, weight_args

    q = _q6(16, 64, torch.Generator().manual_seed(1))
    lin = Int8DotCpu(q, codes="i8")
    codes = pack_x8_native(lin.lib, q.unpack_codes(), 6)
    args = weight_args(codes, 6, lin.scale, lin.mins, 32, 32)
    with pytest.raises(ValueError, match="no kernel loop"):
        int8dot_linear(lin.lib, torch.randn(1, 64), args, 16)


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_native_pack_writes_the_reference_layout(isa, bits):
    """kvq_pack (what a load runs) writes the bytes of pack_x8, the layout's torch reference."""
    from kvcli_kernels.cpu_int8dot import pack_x8, pack_x8_native

    gen = torch.Generator().manual_seed(bits)
    if bits == 8:
        q = torch.randint(-128, 128, (24, 96), dtype=torch.int8, generator=gen)
    else:
        q = torch.randint(0, 1 << bits, (24, 96), dtype=torch.uint8, generator=gen)
    got = pack_x8_native(int8dot_cpu.native_library(), q, bits)
    assert torch.equal(got.view(torch.uint8), pack_x8(q, bits).view(torch.uint8))


def test_native_pack_refuses_other_code_widths():
    from kvcli_kernels.cpu_int8dot import pack_x8_native

    with pytest.raises(ValueError, match="not 7"):
        pack_x8_native(int8dot_cpu.native_library(), torch.zeros(8, 32, dtype=torch.uint8), 7)


def test_rows_do_not_depend_on_their_batch(isa):
    """A row's output is bit-identical whether it runs alone or among others (speculation's verify
    steps and batched decode rely on it), and so is the zero row."""
    gen = torch.Generator().manual_seed(3)
    q = _q4(64, 320, 32, True, False, gen)
    lin = Int8DotCpu(q)
    lin.kernel_at_every_row_count()
    x = torch.randn(11, 320, generator=gen)
    x[4] = 0
    full = lin(x)
    for i in range(11):
        assert torch.equal(lin(x[i:i + 1])[0], full[i])
    assert torch.equal(full[4], torch.zeros(64))


@pytest.mark.parametrize("kind", list(WEIGHTS))
def test_a_decode_row_is_a_batch_row_bit_for_bit(isa, kind):
    """A 1-row call reads each thread's weights as two streams far apart (FORM_TWO_FNS, one_level_two16), a batch
    row-tile by row-tile: every form's row gets the same bits either way, for group counts that take the two
    streams (8, 17: an odd last group alone) and one that does not (5)."""
    gen = torch.Generator().manual_seed(29)
    for n, k in ((40, 256), (64, 256), (136, 2304)):
        q = WEIGHTS[kind](n, k, gen)
        lin = Int8DotCpu(q)
        lin.kernel_at_every_row_count()
        x = torch.randn(5, k, generator=gen) * (torch.rand(1, k, generator=gen) + 0.5)
        x[::2, 9] = 30.0  # an outlier channel (the one-level forms' second level)
        full = lin(x)
        for i in range(5):
            assert torch.equal(lin(x[i:i + 1])[0], full[i]), (kind, n, k, i)


@pytest.mark.parametrize("kind", list(WEIGHTS))
def test_every_small_row_count_gives_each_row_its_own_bits(isa, kind):
    """2-8 rows go through the 16-column loops on AVX-512 builds (one_level_rec16, group_block16), in passes of up to
    8 rows with an odd last group on 8 columns: at every row count from 2 to 10 each row's output is its 1-row call's
    bit for bit."""
    gen = torch.Generator().manual_seed(31)
    q = WEIGHTS[kind](136, 256, gen)
    lin = Int8DotCpu(q)
    lin.kernel_at_every_row_count()
    x = torch.randn(10, 256, generator=gen) * (torch.rand(1, 256, generator=gen) + 0.5)
    x[1::3, 17] = 25.0  # an outlier channel (the one-level forms' second level)
    alone = [lin(x[i:i + 1])[0] for i in range(10)]
    for m in range(2, 11):
        out = lin(x[:m])
        for i in range(m):
            assert torch.equal(out[i], alone[i]), (kind, m, i)


def test_calls_from_several_threads_keep_their_own_buffers():
    """kvq_linear and kvq_gemm_i8 keep their scratch per calling thread (kernels/cpu_scratch.h): calls running at
    once from several Python threads (ctypes lets go of the GIL) give each caller its own results, bit for bit
    those of the calls made one at a time, at row counts from one to past the int8 GEMM's. (One buffer shared by
    every thread fails this.)"""
    import threading

    gen = torch.Generator().manual_seed(5)
    lin = Int8DotCpu(_q4(96, 512, 32, True, False, gen))
    xs = [torch.randn(m, 512, generator=gen) for m in (1, 3, 6, 9, 16, 1, 40, 2)]
    want = [lin(x) for x in xs]
    bad: list[int] = []

    def run(order: list[int]) -> None:
        for _ in range(20):
            for i in order:
                if not torch.equal(lin(xs[i]), want[i]):
                    bad.append(i)

    threads = [threading.Thread(target=run, args=(list(range(len(xs)))[::step],)) for step in (1, -1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", list(WEIGHTS))
def test_read_back_equals_dequantize(isa, dtype, kind):
    """Bit for bit, on every build (AVX2 builds unpack a block's codes in vectors, the plain C one per code)."""
    gen = torch.Generator().manual_seed(5)
    for q in [WEIGHTS[kind](48, 256, gen)]:
        lin = Int8DotCpu(q)
        assert torch.equal(lin.dense(dtype), q.dequantize().to(dtype))
        assert torch.equal(lin.dense(dtype, 16, 8), q.dequantize()[16:24].to(dtype))


@pytest.mark.parametrize("type_name,ratio", [("Q4_K", 144 / 148), ("Q5_K", 176 / 180), ("Q6_K", 210 / 210)])
def test_k_quants_stay_in_their_files_bytes(type_name, ratio):
    """The file's codes, 8-bit sub-scales and fp16 super-block scales are what the kernel reads: Q4_K
    keeps 4-bit codes + 20 bytes of scales per 256 weights (the file: 144 B per 256), Q5_K 5-bit codes
    (+ 20; the file: 176), Q6_K 6-bit codes + 16 signed sub-scales + an fp16 d (the file: 210)."""
    from kvcli_kernels.cpu_int8dot import NEG_SUB, NONE, SUB, SUB_I8

    q = _gguf(type_name)(64, 512, torch.Generator().manual_seed(2))
    lin = Int8DotCpu(q)
    kinds = {"Q4_K": (SUB, NEG_SUB), "Q5_K": (SUB, NEG_SUB), "Q6_K": (SUB_I8, NONE)}[type_name]
    assert (lin.scale.kind, lin.mins.kind) == kinds
    file_bytes = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[type_name] * 64 * 512 // 256
    assert lin.nbytes == pytest.approx(file_bytes / ratio)


def test_many_rows_take_their_route_and_agree():
    """From the route's row count: 8-bit codes a float GEMM (bf16 within 1e-2, fp32 within 1e-5); 4-bit codes the
    same, or where the route says the int8 GEMM (within fp32 rounding of its own rounding of x); on AMX CPUs the
    float GEMM over the int8 GEMM from there (dense_over_int8), which then takes the rows below."""
    gen = torch.Generator().manual_seed(9)
    for q in (_q8(64, 256, gen), _q4(64, 256, 32, True, False, gen)):
        lin = Int8DotCpu(q)
        x = torch.randn(lin.dense_min_rows, 256, generator=gen)
        if lin.route.dense_over_int8:  # the int8 GEMM below the float GEMM's row count
            assert q.bits == 4 and lin.route.takes_int8(len(x) - 1) and not lin.route.takes_int8(len(x))
            ref = _i8_reference(q, x[:-1], OUTLIER)
            assert ((lin(x[:-1]).double() - ref).abs().amax(-1) / ref.abs().amax(-1)).max().item() < 1e-5
        elif lin.route.takes_int8(len(x)):
            assert q.bits == 4
            ref = _i8_reference(q, x, OUTLIER)
            assert ((lin(x).double() - ref).abs().amax(-1) / ref.abs().amax(-1)).max().item() < 1e-5
            continue
        tol = 1e-2 if lin.dense_dtype == torch.bfloat16 else 1e-5
        assert _check(lin, q.dequantize(), x) < tol


def test_resident_bytes_are_the_files_for_q4_1():
    """Q4_1's fp16 scale and min stay fp16: 4-bit codes + 4 bytes per 32 weights, the file's 20 B per block."""
    gen = torch.Generator().manual_seed(1)
    q = _q4(64, 256, 32, True, False, gen)
    assert Int8DotCpu(q).nbytes == 64 * 256 // 32 * 20


def test_resident_bytes_are_the_files_for_q4_0():
    """Q4_0 (w = d (q - 8)) holds no min: the kernel takes the offset off in the integer sum, so 4-bit codes
    + an fp16 scale, the file's 18 B per block (a min of -8 d held beside them was 1.11x the file)."""
    from kvcli.model.int8dot_cpu import code_offset

    q = _gguf("Q4_0")(64, 256, torch.Generator().manual_seed(1))
    assert code_offset(q) == 8
    assert Int8DotCpu(q).nbytes == 64 * 256 // 32 * 18
    # a free min per group (Q4_1) or mins that are not one multiple of the scale keep theirs
    assert code_offset(_q4(64, 256, 32, True, False, torch.Generator().manual_seed(2))) == 0
    q.min[0, 0] = q.min[0, 0] * 0.5
    assert code_offset(q) == 0


@pytest.mark.slow
def test_without_a_compiler_torch_kernels_run(tmp_path):
    """No C compiler (CC names none, an empty build cache): one status line says why, and the model
    loads and generates on torch's kernels (int4-cpu linears, torch attention and norms)."""
    import json
    import os
    import subprocess
    import sys

    code = ("import json; from kvcli.llm import LLM; from kvcli.native.registry import status as native_status; "
            "from kvcli.config import SamplingParams; llm = LLM(kv_budget='16MiB'); "
            "out = llm.generate(['The keeper'], SamplingParams(max_tokens=3, ignore_eos=True))[0]; "
            "print(json.dumps([native_status(), llm.engine.linear_mode, llm.engine.kv_dtype.name, len(out.token_ids)]))")
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), KVCLI_CACHE=str(tmp_path / "cache"))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    status, mode, kv, n = json.loads(p.stdout.strip().splitlines()[-1])
    assert status.startswith("unavailable:") and "no-such-cc" in status, status
    assert (mode, kv, n) == ("int4-cpu", "fp32", 3)


def _gemm_problem(kind: str, gen: torch.Generator) -> tuple[QuantTensor, torch.Tensor]:
    # N = 136: 8 panels of 16 rows and a last one of 8. K: 640 = two 256-wide panels and a tail of 128
    # (legacy kinds); K-quants need whole super-blocks of 256: 1280, five panels.
    k = 1280 if kind.startswith(("Q4_K", "Q5_K", "Q6_K")) else 640
    q = WEIGHTS[kind](136, k, gen)
    return q, q.dequantize()


@pytest.mark.parametrize("kind", list(WEIGHTS))
def test_fp32_gemm_matches_float64_reference(isa, kind):
    """kvq_gemm_f32, the many-row path of AVX2 builds: weight panels dequantized exactly (as the
    read-back), fp32 products: within fp32 rounding of the float64 reference for every code kind, every
    tail of the 6-row tile, a last panel of 8 rows and K panels with a tail. The plain C build has none."""
    from kvcli_kernels.cpu_int8dot import int8dot_gemm_f32

    gen = torch.Generator().manual_seed(11)
    q, w = _gemm_problem(kind, gen)
    lin = Int8DotCpu(q)
    for rows in (1, 5, 6, 7, 13, 40):
        x = torch.randn(rows, w.shape[1], generator=gen) * torch.rand(1, w.shape[1], generator=gen) * 3
        y = int8dot_gemm_f32(lin.lib, x, lin.args, lin.out_features)
        if isa == "generic":
            assert y is None
            return
        ref = x.double() @ w.double().t()
        err = ((y.double() - ref).abs().amax(-1) / ref.abs().amax(-1)).max().item()
        assert err < 1e-5, f"{isa} {kind} rows {rows}: max relative error {err:.2e}"


def test_fp32_gemm_rows_and_threads_do_not_change_a_row(isa):
    """Each output sums its k in one fixed order: a row alone, in a batch, or on one thread is bit-identical."""
    from kvcli_kernels.cpu_int8dot import int8dot_gemm_f32

    if isa == "generic":
        pytest.skip("the plain C build has no fp32 GEMM")
    _assert_rows_and_threads_do_not_change_a_row(int8dot_gemm_f32, "q4 min fp16 g32", 12, 13, (0, 6, 12))


def _assert_rows_and_threads_do_not_change_a_row(gemm, kind: str, seed: int, rows: int, picks: tuple[int, ...],
                                                 outlier_rows: tuple[int, ...] = ()) -> None:
    """gemm (a panel GEMM of cpu_int8dot.py) on `rows` rows: each of rows `picks` alone, and all of them on one
    thread, bit-identical to the batch; `outlier_rows` get an outlier channel."""
    gen = torch.Generator().manual_seed(seed)
    q, w = _gemm_problem(kind, gen)
    lin = Int8DotCpu(q)
    x = torch.randn(rows, w.shape[1], generator=gen)
    for i in outlier_rows:
        x[i, 37] = 40.0
    full = gemm(lin.lib, x, lin.args, lin.out_features)
    for i in picks:
        assert torch.equal(gemm(lin.lib, x[i:i + 1], lin.args, lin.out_features)[0], full[i])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(gemm(lin.lib, x, lin.args, lin.out_features), full)
    finally:
        torch.set_num_threads(threads)


def test_many_rows_take_the_fp32_gemm_where_it_is_chosen(isa):
    """Where the fused GEMM is chosen (AVX2 build, torch on AVX2), calls from GEMM_F32_MIN_ROWS rows take
    it (fp32-exact), fewer rows the integer kernel; the vocabulary projection too, and a row-invariant
    model turns it off (one path at every row count). The plan is made for an AVX2 machine, whatever
    this one is."""
    from kvcli.model.vocab_head import VocabHead
    from kvcli.model.weight_plan import GEMM_F32_MIN_ROWS, HeadPlan, int8dot_route
    from kvcli_kernels.cpu_int8dot import int8dot_gemm_f32
    from kvcli.native.capabilities import CpuCapabilities

    if isa == "generic":
        pytest.skip("the plain C build has no fp32 GEMM")
    avx2 = CpuCapabilities("an AVX2 CPU", "x86_64", frozenset({"avx2", "fma", "f16c"}), "AVX2", "avx2", False)
    route = int8dot_route(avx2)
    gen = torch.Generator().manual_seed(13)
    q, w = _gemm_problem("q8 fp16", gen)
    lin = Int8DotCpu(q, route=route)
    assert lin.gemm is int8dot_gemm_f32 and lin.dense_min_rows == GEMM_F32_MIN_ROWS
    n = lin.dense_min_rows
    x = torch.randn(n, w.shape[1], generator=gen)
    assert _check(lin, w, x) < 1e-5  # the integer kernel's two levels alone give ~5e-5
    few = lin(x[:n - 1])
    lin.kernel_at_every_row_count()
    assert torch.equal(lin(x[:n - 1]), few)  # below the threshold: the integer kernel
    head = VocabHead(HeadPlan("int8dot-cpu", torch.float32, True, route), table=Int8DotCpu(q, route=route))
    assert head.int8dot.dense_min_rows == n and "fp32 GEMM" in head.path
    still = int8dot_route(avx2, row_invariant=True)
    head = VocabHead(HeadPlan("int8dot-cpu", torch.float32, True, still), table=Int8DotCpu(q, route=still))
    assert head.int8dot.dense_min_rows is None and "fp32 GEMM" not in head.path


def _amx_bf16_here(isa: str) -> bool:
    from kvcli.native.capabilities import cpu_flags

    return isa == "avx512vnni" and {"amx_tile", "amx_bf16"} <= cpu_flags()


@pytest.mark.parametrize("kind", list(WEIGHTS))
def test_amx_bf16_gemm_is_the_read_backs_product(isa, kind):
    """kvq_gemm_bf16, the many-row path on AMX CPUs: weight panels dequantized to bf16 on the fly (the read-back's
    bf16 weights, bit for bit) times x in bf16, fp32 sums on tiles: within fp32 summation error of the float64
    product of those same bf16 operands, for every code kind, ragged row counts (2 x 2 tiles of 16 rows, one
    tile, a last short tile, a last 16 + 9 rows), a last panel of 8 weight rows and K panels with a tail. None where there are no
    AMX-BF16 tiles (other CPUs, the AVX2 and plain C builds)."""
    from kvcli_kernels.cpu_int8dot import int8dot_dequant, int8dot_gemm_bf16

    gen = torch.Generator().manual_seed(14)
    q, w = _gemm_problem(kind, gen)
    lin = Int8DotCpu(q)
    wb = int8dot_dequant(lin.lib, lin.args, torch.empty(w.shape, dtype=torch.bfloat16))
    assert torch.equal(wb, w.float().bfloat16())
    for rows in (1, 5, 16, 17, 32, 40, 57, 70):
        x = torch.randn(rows, w.shape[1], generator=gen) * torch.rand(1, w.shape[1], generator=gen) * 3
        y = int8dot_gemm_bf16(lin.lib, x, lin.args, lin.out_features)
        if not _amx_bf16_here(isa):
            assert y is None
            return
        ref = x.bfloat16().double() @ wb.double().t()
        err = ((y.double() - ref).abs().amax(-1) / ref.abs().amax(-1)).max().item()
        assert err < 2e-6, f"{kind} rows {rows}: max relative error {err:.2e}"


def test_amx_bf16_gemm_rows_and_threads_do_not_change_a_row(isa):
    """Each output of the AMX GEMM sums its k in one fixed order: a row alone, in a batch, in a last short tile,
    or on one thread is bit-identical."""
    from kvcli_kernels.cpu_int8dot import int8dot_gemm_bf16

    if not _amx_bf16_here(isa):
        pytest.skip("no AMX-BF16 tiles in this build / CPU")
    _assert_rows_and_threads_do_not_change_a_row(int8dot_gemm_bf16, "Q4_0 offset 8", 15, 37, (0, 20, 33, 36))


def test_many_rows_take_the_amx_gemm_where_it_is_chosen(isa):
    """On an AMX-BF16 CPU the plan routes calls from INT8DOT_DENSE_MIN_ROWS rows to the AMX GEMM: the read-back's
    result within fp32 summation error, without its buffer; fewer rows the integer kernel. The plan is made for
    such a CPU whatever this one is; where the kernel is refused the call falls back to the read-back."""
    from kvcli.model.weight_plan import INT8DOT_DENSE_MIN_ROWS, int8dot_route
    from kvcli.native.capabilities import CpuCapabilities
    from kvcli_kernels.cpu_int8dot import int8dot_gemm_bf16

    amx = CpuCapabilities("an AMX CPU", "x86_64", frozenset({"avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_tile",
                          "amx_bf16", "amx_int8"}), "AVX512", "avx512vnni", True, True, True)
    route = int8dot_route(amx)
    assert (route.gemm, route.dense_min_rows, route.dense_dtype) == ("amx-bf16-gemm", INT8DOT_DENSE_MIN_ROWS,
                                                                     torch.bfloat16)
    assert "bf16 GEMM on AMX tiles from 256 rows" in route.describe()
    gen = torch.Generator().manual_seed(16)
    q, w = _gemm_problem("Q4_K two-level", gen)
    lin = Int8DotCpu(q, route=route)
    assert lin.gemm is int8dot_gemm_bf16
    x = torch.randn(INT8DOT_DENSE_MIN_ROWS, w.shape[1], generator=gen)
    read_back = torch.nn.functional.linear(x.bfloat16(), lin.dense(torch.bfloat16)).float()
    y = lin(x)
    assert ((y - read_back).abs().amax(-1) / read_back.abs().amax(-1)).max() < 2e-2  # torch's bf16 output rounding
    if _amx_bf16_here(isa):
        assert torch.equal(y, int8dot_gemm_bf16(lin.lib, x, lin.args, lin.out_features))
    few = lin(x[:7])
    lin.kernel_at_every_row_count()
    assert torch.equal(lin(x[:7]), few)


@pytest.mark.skipif("avx512vnni" not in runnable_isas() or registry.library("int8dot") is None,
                    reason="no AVX-512-VNNI build here (or no C compiler, or KVCLI_NATIVE=0)")
def test_the_amx_code_compiles_where_it_cannot_run(tmp_path):
    """The AMX tile loops are compiled only where the CPU has AMX (kernels/cpu_build.py, -DKVCLI_AMX): built here
    with that flag anyway (into a scratch folder, never loaded), so that a change that breaks them fails on every
    AVX-512 machine, not only on an AMX one."""
    from pathlib import Path

    from kvcli_kernels import cpu_build

    source = Path(cpu_build.__file__).with_name("cpu_int8dot.c")
    assert cpu_build.compile_sources([source], "avx512vnni", str(tmp_path), ("-DKVCLI_AMX",)) == {}
    assert len(list(tmp_path.glob("cpu_int8dot-avx512vnni-*.so"))) == 1


AMX_KINDS = ["Q4_0 offset 8", "Q4_K two-level", "q4 min fp16 g32", "q4 min fp32 g128", "zero points g64", "q8 fp16",
             "Q5_1"]  # Q5_1: no tile path (5-bit codes), the dpbusd loop whatever the switch


@pytest.mark.skipif(int8dot_cpu.tile_rule() is None, reason="no AMX-INT8 tiles here (or KVCLI_AMX=0, or Linux refused)")
@pytest.mark.parametrize("kind", AMX_KINDS)
def test_amx_tiles_give_the_dpbusd_loops_sums_bit_for_bit(kind):
    """On AMX the integer kernel's block sums come from tile products (cpu_int8dot.c, amx_tile): the outputs
    equal the dpbusd loop's exactly, at ragged row counts (tiles of 16 rows and a last one of 2, 4, 8 or 16, padded)
    and weights of 8 rows past a multiple of 16 (a half panel, alone or paired); within the float64 bound. Two levels
    of activations for every form (the row-invariant route's; where the int8 GEMM takes Q4_0 / Q4_1 forms the engine
    rounds them to one level, and the tiles are off for them)."""
    from kvcli.model.row_route import ONE_ROUTE

    lib = int8dot_cpu.native_library()
    gen = torch.Generator().manual_seed(11)
    try:
        # 17 and 15 groups of 8 rows: panels of 16 in pairs and alone, a half panel in either
        for n in (136, 120):
            k = 256
            q = WEIGHTS[kind](n, k, gen)
            lin = Int8DotCpu(q, route=ONE_ROUTE)
            assert not lin.one_level
            for rows in (1, 2, 3, 5, 6, 7, 9, 16, 17, 24, 30, 37):
                x = torch.randn(rows, k, generator=gen)
                lib.kvq_amx_enable(0, 0, 0)
                loop = lin(x)
                assert lib.kvq_amx_enable(1, 0, 1) == 1
                tiles = lin(x)
                assert torch.equal(tiles, loop), (kind, n, rows, (tiles - loop).abs().max().item())
            assert _check(lin, q.dequantize(), x) < REL_BOUND
    finally:
        int8dot_cpu.restore_tiles(lib)


# --- the many-row integer GEMM: one int8 level of activations, a second in outlier blocks ----------------

FOUR_BIT = ["Q4_K two-level", "Q4_0 offset 8", "zero points g64", "q4 min fp16 g32", "q4 no-min fp16 g32",
            "q4 min fp32 g128"]


def _one_level_rounding(x: torch.Tensor, outlier: float | None) -> torch.Tensor:
    """x as kvq_gemm_i8 rounds it (cpu_int8dot.c): per block of 32, d = max|x| / 127, q1 = round(x / d); the
    remainder in steps of d / 256 only in blocks whose max|x| exceeds `outlier` x the row's RMS (None: never)."""
    m, k = x.shape
    xb = x.view(m, k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    t = xb * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    r1 = torch.round(t)
    r2 = torch.round((t - r1) * 256.0).clamp(-127, 127)
    d = amax / 127.0
    if outlier is None:
        r2 = torch.zeros_like(r2)
    else:
        limit = (outlier * x.double().pow(2).mean(-1).sqrt().float())[:, None, None]
        r2 = r2 * (d * 127.0 > limit)
    return (d.double() * (r1.double() + r2.double() / 256.0)).view(m, k)


def _i8_reference(q: QuantTensor, x: torch.Tensor, outlier: float | None) -> torch.Tensor:
    """The weight against the rounded x (codes and mins alike: llama.cpp's Q8_1 sum)."""
    return _one_level_rounding(x, outlier) @ q.dequantize().double().t()


@pytest.mark.parametrize("kind", FOUR_BIT)
def test_int8_gemm_matches_its_rounding(isa, kind):
    """kvq_gemm_i8, the many-row path where there are no AMX tiles: exact integer sums of the codes against x
    rounded to one int8 level per block (two in blocks holding an outlier), scaled in fp32: within fp32 rounding
    of a float64 reference of that rounding, for every tail of the row tile, a last panel of 8 weight rows and K
    panels with a tail. Rows with an outlier channel take the second level (the one-level reference is then
    measurably off); the plain C build and 8-bit codes have no such kernel."""
    from kvcli_kernels.cpu_int8dot import int8dot_gemm_i8

    gen = torch.Generator().manual_seed(17)
    q, w = _gemm_problem(kind, gen)
    lin = Int8DotCpu(q)
    for rows in (1, 3, 6, 7, 13, 40):
        x = torch.randn(rows, w.shape[1], generator=gen) * (torch.rand(1, w.shape[1], generator=gen) + 0.5)
        x[::2, 37] = 40.0  # an outlier channel in every other row (RMS ~1)
        y = int8dot_gemm_i8(lin.lib, x, lin.args, lin.out_features)
        if isa == "generic":
            assert y is None
            return
        ref = _i8_reference(q, x, OUTLIER)
        scale = ref.abs().amax(-1)
        err = ((y.double() - ref).abs().amax(-1) / scale).max().item()
        assert err < 1e-5, f"{isa} {kind} rows {rows}: max relative error {err:.2e}"
        one = ((y.double() - _i8_reference(q, x, None)).abs().amax(-1) / scale)
        assert one[::2].min().item() > 1e-4  # the second level where a row holds an outlier


def test_int8_gemm_takes_only_4_bit_codes(isa):
    from kvcli_kernels.cpu_int8dot import int8dot_gemm_i8

    gen = torch.Generator().manual_seed(18)
    q, w = _gemm_problem("q8 fp16", gen)
    lin = Int8DotCpu(q)
    assert int8dot_gemm_i8(lin.lib, torch.randn(8, w.shape[1]), lin.args, lin.out_features) is None


def test_int8_gemm_rows_and_threads_do_not_change_a_row(isa):
    """A row's rounding, and whether its blocks take the second level, depend on that row alone: alone, in a
    batch (beside rows with outliers) or on one thread, bit-identical."""
    from kvcli_kernels.cpu_int8dot import int8dot_gemm_i8

    if isa == "generic":
        pytest.skip("the plain C build has no integer GEMM")
    _assert_rows_and_threads_do_not_change_a_row(int8dot_gemm_i8, "Q4_0 offset 8", 19, 13, (0, 5, 6, 12),
                                                 outlier_rows=(1, 7))


@pytest.mark.parametrize("kind", PER_32)
def test_small_row_kernel_gives_the_int8_gemms_bits_in_one_level(isa, kind):
    """Forms rounded per 32 (weight_plan.rounds_per_32) where the int8 GEMM takes them: kvq_linear rounds the
    activations as kvq_gemm_i8 does and sums in its order (per 2,048 k, the second level's sums apart), so a row
    gets the same bits from either kernel whatever call it is in: the switch between them is a matter of speed
    (a 6-row verification step in one kernel, the plain decode step it replaces in the other). K of one chunk
    and of three with a tail; rows with an outlier channel (their second level) and rows without; every tail of
    the 4-row tile of 8 columns and the 8-row tile of 16 (AVX-512), and an odd group of 8 weight rows (N 24); a
    single row's two weight streams per thread (AVX-512: N 128, 4 pairs of groups; N 80, an odd 5th pair alone)."""
    from kvcli_kernels.cpu_int8dot import int8dot_gemm_i8, int8dot_linear

    if isa == "generic":
        pytest.skip("the plain C build has no integer GEMM")
    gen = torch.Generator().manual_seed(23)
    for n, k in ((24, 96), (24, 4160), (128, 4160), (80, 96)):
        q = WEIGHTS[kind](n, k, gen)
        lin = Int8DotCpu(q)
        assert lin.one_level and lin.args[-1] == 1
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17):
            x = torch.randn(rows, k, generator=gen) * (torch.rand(1, k, generator=gen) + 0.5)
            x[::2, 37] = 40.0  # an outlier channel in every other row (RMS ~1)
            small = int8dot_linear(lin.lib, x, lin.args, lin.out_features)
            assert torch.equal(small, int8dot_gemm_i8(lin.lib, x, lin.args, lin.out_features)), (kind, k, rows)
            assert torch.equal(small[-1], int8dot_linear(lin.lib, x[-1:], lin.args, lin.out_features)[0])
        # the second level ran where a row holds an outlier: two-level rounding is measurably elsewhere
        ref = _i8_reference(q, x, OUTLIER)
        one = _i8_reference(q, x, None)
        err = lambda r: ((small.double() - r).abs().amax(-1) / r.abs().amax(-1))  # noqa: E731
        assert err(ref).max().item() < 1e-5 and err(one)[::2].min().item() > 1e-4
