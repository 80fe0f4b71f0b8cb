"""The engine's "triton" INT4 linear mode (kvcli.model.layers.Linear) against its exact "int4-torch" mode.

The engine picks this mode on CUDA with the Triton attention backend; nothing else builds it, so
it is built here (under the interpreter on CPU) on a QuantTensor as the loaders make them.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not importable; the Triton kernels cannot be tested")

import torch  # noqa: E402
from kernel_test_utils import DEVICE, dtype_id, generator  # noqa: E402

from kvcli.model.layers import Linear  # noqa: E402
from kvcli.model.quant import quantize_q4  # noqa: E402

REL_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize(("m", "n", "k", "bias"), [(1, 48, 96, False), (12, 40, 64, True)])  # GEMV / GEMM paths
def test_triton_linear_matches_exact_mode(dtype: torch.dtype, m: int, n: int, k: int, bias: bool) -> None:
    gen = generator("linear", dtype, m, n, k, bias)
    w = torch.randn(n, k, generator=gen) * 0.05
    q = quantize_q4(w, 32)
    q = type(q)(q.kind, q.codes.to(DEVICE), q.scale.to(DEVICE), q.min.to(DEVICE), q.group_size)
    b = (torch.randn(n, generator=gen) * 0.1).to(DEVICE) if bias else None
    tri = Linear(q, b, "triton", dtype)
    exact = Linear(q, b, "int4-torch", dtype)
    assert tri.mode == "triton" and exact.mode == "int4-torch"
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    y, ref = tri(x), exact(x.float()).float()
    assert y.dtype == dtype and y.shape == (m, n)
    tol = REL_TOL[dtype] * float(ref.abs().max())
    torch.testing.assert_close(y.float(), ref, atol=tol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_id)
@pytest.mark.parametrize(("m", "n", "k", "g"), [(1, 48, 128, 64), (12, 40, 256, 128)])  # GEMV / GEMM paths
def test_triton_linear_reads_zero_point_checkpoints(dtype: torch.dtype, m: int, n: int, k: int, g: int) -> None:
    """AWQ / GPTQ / compressed-tensors weights (a uint8 zero per group) take the Triton path with the
    zeros multiplied out once into an exact float32 min, and agree with the exact mode."""
    from kvcli.model.hf_quant import to_quant_tensor

    gen = generator("zero-point", dtype, m, n, k, g)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n, k // g, generator=gen) * 0.01 + 0.001).to(torch.float16)
    zeros = torch.randint(0, 16, (n, k // g), generator=gen)
    q = to_quant_tensor(codes, scale, zeros, g).to(DEVICE)
    assert q.zero is not None
    tri = Linear(q, None, "triton", dtype)
    exact = Linear(q, None, "int4-torch", dtype)
    assert tri.mode == "triton" and exact.mode == "int4-torch" and tri.q.min.dtype == torch.float32
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    y, ref = tri(x), exact(x.float()).float()
    tol = REL_TOL[dtype] * float(ref.abs().max())
    torch.testing.assert_close(y.float(), ref, atol=tol, rtol=0)
