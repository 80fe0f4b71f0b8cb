"""int4_matmul (Triton, GEMV and GEMM paths) against the dequantize-then-matmul reference."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not importable; the Triton kernels cannot be tested")

import torch  # noqa: E402
from kernel_test_utils import DEVICE, ON_GPU, dtype_id, generator, requires_cuda  # noqa: E402

from kvcli_kernels.int4_gemm import GEMM_FORMS, GEMV_MAX_M, int4_launch_config, int4_matmul  # noqa: E402
from kvcli_kernels.reference import (  # noqa: E402
    dequantize_int4_ref,
    int4_matmul_ref,
    int8_matmul_ref,
    pack_int4,
    quantize_int4,
)

# Relative to max |ref|: fp16 GEMM rounds the dequantized weights to fp16 before tl.dot; bf16 output
# rounding alone is 2^-8.
REL_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _problem(m: int, n: int, k: int, g: int, dtype: torch.dtype, symmetric: bool = False):
    gen = generator("int4", m, n, k, g, dtype, symmetric)
    w = torch.randn(n, k, generator=gen) * 0.1
    codes, scale, mins = quantize_int4(w, g, symmetric=symmetric)
    x = torch.randn(m, k, generator=gen).to(dtype)
    return [t.to(DEVICE) for t in (x, codes, scale, mins)]


def _check(x, codes, scale, mins, g: int, split_k: int | None, what: str, gemm: str = "dequant",
           config: dict | None = None) -> None:
    out = torch.full((x.shape[0], codes.shape[0]), float("nan"), dtype=x.dtype, device=DEVICE)
    ret = int4_matmul(x, codes, scale, mins, g, out=out, split_k=split_k, gemm=gemm, config=config)
    assert ret is out
    ref = int4_matmul_ref(x, codes, scale, mins, g)
    assert not out.isnan().any(), f"{what}: unwritten outputs"
    tol = REL_TOL[x.dtype] * float(ref.float().abs().max())
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=0, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize(("m", "n", "k", "g", "split_k"), [
    (1, 40, 96, 32, None),  # GEMV; K = 96 is not a multiple of BLOCK_K = 256
    (1, 24, 640, 64, 3),  # GEMV, split-K with a ragged last slice
    (3, 24, 256, 128, 1),  # GEMV, M padded to 4
    (8, 16, 384, 32, 2),  # GEMV at its largest M
])
def test_gemv_path(dtype: torch.dtype, m: int, n: int, k: int, g: int, split_k: int | None) -> None:
    assert m <= GEMV_MAX_M
    _check(*_problem(m, n, k, g, dtype), g, split_k, f"gemv M={m} N={n} K={k} G={g} split={split_k}")


@pytest.mark.parametrize("gemm", GEMM_FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize(("m", "n", "k", "g", "split_k"), [
    (9, 72, 96, 32, None),  # GEMM; K = 96 not a multiple of BLOCK_K = 64, N not of BLOCK_N
    (20, 80, 320, 64, 2),  # GEMM split-K, K = 320 not a multiple of BLOCK_K * splits
    (40, 24, 160, 32, None),  # 32 < M <= 64: 64x64x64 tile, K = 160 ends mid-tile
    (70, 24, 256, 128, 1),  # M > 64: BLOCK_M = 128 tile with a ragged edge, BLOCK_K widened to G
    (130, 16, 96, 32, 2),  # M > 64 with G = 32: one group per K step, split-K, two row tiles
])
def test_gemm_path(gemm: str, dtype: torch.dtype, m: int, n: int, k: int, g: int, split_k: int | None) -> None:
    assert m > GEMV_MAX_M
    _check(*_problem(m, n, k, g, dtype), g, split_k, f"gemm {gemm} M={m} N={n} K={k} G={g} split={split_k}", gemm)


@pytest.mark.parametrize(("m", "config"), [
    (1, dict(BLOCK_N=32, BLOCK_K=256, num_warps=4)),  # GEMV sweep points (gpu_check section c)
    (4, dict(BLOCK_N=8, BLOCK_K=1024, num_warps=8, num_stages=3)),
    (24, dict(BLOCK_N=32, BLOCK_K=128, num_warps=4)),  # GEMM tiles other than the default
    (33, dict(BLOCK_N=128, BLOCK_K=64, num_warps=8)),
])
def test_config_overrides_compute_the_same(m: int, config: dict) -> None:
    _check(*_problem(m, 72, 384, 32, torch.float16), 32, None, f"M={m} {config}", config=config)


def test_bad_gemm_form_or_config_is_refused() -> None:
    x, codes, scale, mins = _problem(12, 16, 64, 32, torch.float16)
    with pytest.raises(ValueError, match="gemm must be"):
        int4_matmul(x, codes, scale, mins, gemm="marlin")
    with pytest.raises(ValueError, match="config takes"):
        int4_matmul(x, codes, scale, mins, config=dict(BLOCK_K=48))
    with pytest.raises(ValueError, match="config takes"):
        int4_matmul(x, codes, scale, mins, config=dict(BLOCK_M=64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize(("m", "n", "k", "g", "lo", "hi", "has_min", "split_k"), [
    (1, 40, 96, 16, -32, 31, False, None),  # GEMV, Q6_K's groups of 16 and signed 6-bit codes
    (3, 24, 640, 32, 0, 31, True, 3),  # GEMV split-K (ragged last slice), Q5_1-like codes with a min
    (9, 72, 96, 16, -128, 127, False, None),  # GEMM, groups of 16, full int8 range, ragged tiles
    (20, 80, 320, 32, -16, 15, True, 2),  # GEMM split-K with a min
    (70, 24, 256, 32, -128, 127, False, 1),  # M > 64: 128-row tile with a ragged edge (Q8_0)
])
@pytest.mark.parametrize("gemm", GEMM_FORMS)
def test_int8_codes(dtype: torch.dtype, m: int, n: int, k: int, g: int, lo: int, hi: int, has_min: bool,
                    split_k: int | None, gemm: str) -> None:
    """5/6/8-bit GGUF codes held as int8 [N, K] (minus their offset) take both kernel paths, with a float
    scale per group of 16 or 32 and a min or none."""
    gen = generator("int8", m, n, k, g, dtype, has_min)
    codes = torch.randint(lo, hi + 1, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, k // g, generator=gen) * 0.01 + 0.001
    mins = -(torch.rand(n, k // g, generator=gen) * 0.1) if has_min else None
    x = torch.randn(m, k, generator=gen).to(dtype)
    x, codes, scale = x.to(DEVICE), codes.to(DEVICE), scale.to(DEVICE)
    mins = None if mins is None else mins.to(DEVICE)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    if m <= GEMV_MAX_M and gemm != GEMM_FORMS[0]:
        pytest.skip("the GEMV path has one form")
    assert int4_matmul(x, codes, scale, mins, g, out=out, split_k=split_k, gemm=gemm) is out
    ref = int8_matmul_ref(x, codes, scale, mins, g)
    assert not out.isnan().any()
    tol = REL_TOL[dtype] * float(ref.float().abs().max())
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=0)


@pytest.mark.parametrize("m", [2, 17])
def test_q4_0_symmetric_and_strided_x(m: int) -> None:
    """Q4_0 (min = -8 * scale) and an x that is a column slice of a wider activation."""
    x, codes, scale, mins = _problem(m, 32, 128, 32, torch.float16, symmetric=True)
    torch.testing.assert_close(mins, -8 * scale)
    wide = torch.cat([x, x], dim=1)
    _check(wide[:, 128:], codes, scale, mins, 32, None, f"q4_0 strided M={m}")


def test_nibble_order_and_dequant() -> None:
    """k = 2j is the LOW nibble: a single non-zero code lands in exactly the right column."""
    q = torch.zeros(2, 64, dtype=torch.uint8)
    q[0, 6], q[1, 7] = 5, 9
    codes = pack_int4(q)
    assert codes[0, 3] == 5 and codes[1, 3] == 9 << 4
    scale = torch.ones(2, 2, dtype=torch.float16)
    mins = torch.zeros(2, 2, dtype=torch.float16)
    torch.testing.assert_close(dequantize_int4_ref(codes, scale, mins, 32), q.float())
    x = torch.eye(64, dtype=torch.float32)[:9].to(DEVICE)  # M = 9 -> GEMM path; rows 0..8 pick columns
    out = int4_matmul(x, codes.to(DEVICE), scale.to(DEVICE), mins.to(DEVICE), 32)
    assert out[6, 0] == 5 and out[7, 1] == 9 and out[:, 0].sum() == 5
    out1 = int4_matmul(x[7:8], codes.to(DEVICE), scale.to(DEVICE), mins.to(DEVICE), 32)  # GEMV path
    assert out1[0, 1] == 9 and out1[0, 0] == 0


def test_launch_config() -> None:
    gemv = int4_launch_config(1, 4096, 4096, 32, num_sms=132)
    assert gemv["gemv"] and gemv["BLOCK_K"] % 32 == 0
    gemm = int4_launch_config(16, 4096, 4096, 128, num_sms=132)
    assert not gemm["gemv"] and gemm["BLOCK_K"] % 128 == 0
    assert int4_launch_config(4096, 4096, 4096, 32, num_sms=132)["split_k"] == 1
    assert int4_launch_config(16, 4096, 4096, 32, num_sms=132)["split_k"] > 1  # 64 tiles < 132 SMs


def test_validation_errors() -> None:
    x, codes, scale, mins = _problem(2, 16, 64, 32, torch.float16)
    with pytest.raises(ValueError, match="group_size"):
        int4_matmul(x, codes, scale, mins, 48)
    with pytest.raises(ValueError, match="codes must be uint8"):
        int4_matmul(x, codes.to(torch.int32), scale, mins)
    with pytest.raises(ValueError, match="multiple of group_size"):
        int4_matmul(x[:, :48], codes, scale, mins)
    with pytest.raises(ValueError, match="scale must be"):
        int4_matmul(x, codes, scale[:, :1], mins)
    with pytest.raises(ValueError, match="group_size"):  # groups of 16 only for int8 codes
        int4_matmul(x, codes, scale, mins, 16)
    with pytest.raises(ValueError, match="int8 \\[N, K=64\\]"):
        int4_matmul(x, codes.view(torch.int8), scale, mins)  # int8 codes must be one byte per weight
    with pytest.raises(ValueError, match="x must be"):
        int4_matmul(x.to(torch.int32), codes, scale, mins)
    with pytest.raises(ValueError, match="out must be"):
        int4_matmul(x, codes, scale, mins, out=torch.empty(2, 3, dtype=x.dtype, device=DEVICE))
    if ON_GPU:
        with pytest.raises(ValueError, match="one device"):
            int4_matmul(x, codes.cpu(), scale, mins)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5, 16, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
def test_gpu_llm_shapes(m: int, dtype: torch.dtype) -> None:
    for n, k in ((4096, 4096), (1024, 14336)):
        _check(*_problem(m, n, k, 32, dtype), 32, None, f"gpu M={m} N={n} K={k}")
