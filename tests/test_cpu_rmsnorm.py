"""kvcli's one-pass RMSNorm kernel (kernels/cpu_rmsnorm.c) against torch's rms_norm, for every build the
machine runs, on ragged widths (a tail after the 8-wide partial sums) and row counts."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from cpu_paths import runnable_isas

from kvcli.model.layers import RMSNorm
from kvcli.model.weight_plan import Native
from kvcli.native import registry

CPU = torch.device("cpu")


@pytest.mark.parametrize("isa", runnable_isas())
@pytest.mark.parametrize("rows,width", [(1, 576), (3, 64), (5, 1003), (600, 96)])
def test_matches_torch_rms_norm(isa, rows, width, monkeypatch):
    from kvcli_kernels.cpu_rmsnorm import load, rmsnorm

    lib = load(isa, registry.build_dir())
    if lib is None:
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(rows + width)
    x = torch.randn(rows, width, generator=gen) * 3
    x[0, 1] = 80.0  # an outlier channel
    w = torch.randn(width, generator=gen)
    got = rmsnorm(lib, x, w, 1e-5)
    want = F.rms_norm(x, (width,), w, 1e-5)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


def test_layer_takes_the_kernel_unless_turned_off(monkeypatch):
    w = torch.randn(64)
    if shutil.which("cc") or shutil.which("gcc"):
        assert RMSNorm(w, 1e-6, torch.float32, Native.here(CPU, torch.float32).rmsnorm).native is not None
    assert RMSNorm(w, 1e-6, torch.bfloat16, Native.here(CPU, torch.bfloat16).rmsnorm).native is None  # fp32 rows only
    monkeypatch.setenv("KVCLI_NATIVE", "0")
    norm = RMSNorm(w, 1e-6, torch.float32, Native.here(CPU, torch.float32).rmsnorm)
    assert norm.native is None
    x = torch.randn(2, 64)
    assert torch.equal(norm(x), F.rms_norm(x, (64,), w, 1e-6))
