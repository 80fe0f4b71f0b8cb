"""The engine's "triton" INT4 linear mode (kvcli.model.layers.Linear) against its exact "dequant-torch" form.

The engine picks this mode on CUDA with the Triton attention backend; nothing else builds it, so
it is built here (under the interpreter on CPU) on a QuantTensor as the loaders make them.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not importable; the Triton kernels cannot be tested")

import torch  # noqa: E402
from kernel_test_utils import DEVICE, dtype_id, generator  # noqa: E402

from kvcli.model.layers import planned_linear as Linear  # noqa: E402
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
    exact = Linear(q, b, "exact", dtype)
    assert tri.mode == "triton" and exact.mode == "dequant-torch"
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
    exact = Linear(q, None, "exact", dtype)
    assert tri.mode == "triton" and exact.mode == "dequant-torch" and tri.q.min.dtype == torch.float32
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    y, ref = tri(x), exact(x.float()).float()
    tol = REL_TOL[dtype] * float(ref.abs().max())
    torch.testing.assert_close(y.float(), ref, atol=tol, rtol=0)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"])
@pytest.mark.parametrize("m", [1, 12])  # GEMV / GEMM paths
def test_triton_linear_reads_every_gguf_type(type_name: str, m: int) -> None:
    """Random well-formed GGUF blocks of each type (the loader's own decoders) take the Triton kernels:
    4-bit types as packed nibbles (Q4_K's two-level scales and mins, Q4_0's offset multiplied out once
    into float32 per group of 32), 5/6/8-bit types as int8 codes (q - offset), one byte per weight; all
    agree with the exact per-call dequantization (dequant-torch)."""
    import numpy as np

    from kvcli.model.gguf_loader import _DECODERS
    from kvcli.model.kquant_encode import random_blocks

    n, k = 40, 512
    raw = random_blocks(type_name, n, k, np.random.default_rng(m), scale=0.02)
    q = _DECODERS[type_name](torch.from_numpy(raw.copy()), n, k).to(DEVICE)
    tri = Linear(q, None, "triton", torch.float32)
    exact = Linear(q, None, "exact", torch.float32)
    if type_name.startswith("Q4"):
        assert tri.mode == "triton" and exact.mode == "dequant-torch"
        assert tri.nbytes <= n * k // 2 + 2 * 4 * n * k // 32  # nibbles + at most a float32 scale and min per 32
    else:
        assert tri.mode == "triton-int8" and exact.mode == "dequant-torch"
        assert tri.q8[0].dtype == torch.int8 and tri.q8[0].shape == (n, k)
        assert tri.nbytes < n * k * 1.3  # one byte per code plus float32 group values
    x = torch.randn(m, k, generator=generator("lowbit", type_name, m)).to(DEVICE)
    y, ref = tri(x), exact(x)
    torch.testing.assert_close(y, ref, atol=REL_TOL[torch.float32] * float(ref.abs().max()), rtol=0)
