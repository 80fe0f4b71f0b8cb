"""kvcli's SwiGLU kernel (kernels/cpu_swiglu.c) against torch's silu(gate) * up, for every vector build the
machine runs: ragged widths (a scalar tail after the 8-wide vectors), row counts past the threading
threshold, strided rows, and the extremes of the sigmoid (large |x|, +-inf, NaN, signed zeros)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cpu_paths import built, runnable_isas
from kvcli.model.layers import SwiGLU
from kvcli.model.weight_plan import Native
from kvcli.native.capabilities import build_isa

CPU = torch.device("cpu")

ISAS = [i for i in runnable_isas() if i != "generic"]


def _lib(isa: str):
    from kvcli_kernels.cpu_swiglu import load

    return built(load, isa)


def _want(gu: torch.Tensor) -> torch.Tensor:
    g, u = gu.double().chunk(2, dim=-1)
    return (F.silu(g) * u).float()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("rows", "width"), [(1, 1536), (3, 13), (7, 8), (200, 1000)])
def test_matches_silu_times_up(isa, rows, width):
    from kvcli_kernels.cpu_swiglu import swiglu

    lib = _lib(isa)
    gen = torch.Generator().manual_seed(rows * 7 + width)
    wide = torch.randn(rows, 2 * width + 5, generator=gen) * 6
    gu = wide[:, :2 * width]  # strided rows: the row stride is not 2F
    gu[0, :6] = torch.tensor([0.0, -0.0, 90.0, -90.0, 30.0, -30.0])
    got = swiglu(lib, gu)
    assert got is not None and got.shape == (rows, width)
    torch.testing.assert_close(got, _want(gu), rtol=3e-7, atol=1e-30)


@pytest.mark.parametrize("isa", ISAS)
def test_non_finite_inputs_follow_torch(isa):
    from kvcli_kernels.cpu_swiglu import swiglu

    lib = _lib(isa)
    gate = torch.tensor([float("inf"), float("-inf"), float("nan"), 1.0, 2.0, -3.0, 0.5, 4.0, float("inf")])
    up = torch.tensor([2.0, 2.0, 1.0, float("nan"), float("inf"), 1.0, 1.0, 1.0, -1.0])
    gu = torch.cat([gate, up])[None]
    got, want = swiglu(lib, gu)[0], F.silu(gate) * up
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    finite = want.isfinite()
    torch.testing.assert_close(got[finite], want[finite], rtol=3e-7, atol=0)


def test_layer_takes_the_kernel_unless_turned_off(monkeypatch):
    gu = torch.randn(4, 64)
    want = F.silu(gu[:, :32]) * gu[:, 32:]
    layer = SwiGLU(Native.here(CPU, torch.float32).swiglu)
    if ISAS and build_isa() != "generic" and _lib(build_isa()) is not None:
        assert layer.native is not None
    torch.testing.assert_close(layer(gu), want, rtol=3e-7, atol=1e-30)
    assert SwiGLU(Native.here(CPU, torch.bfloat16).swiglu).native is None  # fp32 rows only
    monkeypatch.setenv("KVCLI_NATIVE", "0")
    off = SwiGLU(Native.here(CPU, torch.float32).swiglu)
    assert off.native is None and torch.equal(off(gu), want)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("rows", "width"), [(1, 1536), (3, 13), (7, 8), (200, 1000)])
def test_geglu_matches_gelu_tanh_times_up(isa, rows, width):
    """GeGLU (Gemma): gelu_tanh(gate) * up against float64 transformers-style gelu_pytorch_tanh, ragged widths,
    strided rows, the tanh's saturation (large |x|) and zeros."""
    from kvcli_kernels.cpu_swiglu import swiglu

    lib = _lib(isa)
    gen = torch.Generator().manual_seed(rows * 11 + width)
    wide = torch.randn(rows, 2 * width + 3, generator=gen) * 4
    wide[0, :4] = torch.tensor([30.0, -30.0, 0.0, -0.0])
    gu = wide[:, :2 * width]
    out = swiglu(lib, gu, "gelu_tanh")
    g, u = gu.double().chunk(2, dim=-1)
    want = F.gelu(g, approximate="tanh") * u
    torch.testing.assert_close(out.double(), want, rtol=2e-6, atol=2e-6 * float(want.abs().max()))
    layer = SwiGLU(True, "gelu_tanh")
    if layer.native is not None:
        assert torch.equal(layer(gu.contiguous()), swiglu(layer.native, gu.contiguous(), "gelu_tanh"))
