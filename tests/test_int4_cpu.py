"""The int4 CPU linear's dense read-back (model/int4_cpu.py): torch's packed layout decoded on this
machine's ISA and on AVX2 (a subprocess with ATEN_CPU_CAPABILITY=avx2, whose packing differs), checked
against the canonical codes it was packed from."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvcli.model.int4_cpu import Int4Cpu, packed_block_n
from kvcli.model.quant import random_q4

CHECK = """
import torch
from kvcli.model.int4_cpu import Int4Cpu, packed_block_n
from kvcli.model.quant import random_q4
from kvcli.model.weight_plan import int4_route
from kvcli.native.capabilities import capabilities
g = torch.Generator().manual_seed(1)
for n, k, gs in ((192, 128, 32), (64, 256, 64), (320, 96, 32)):  # ragged block counts, two group sizes
    q = random_q4(n, k, 0.05, g, group_size=gs)
    w = Int4Cpu(q.unpack_codes(), q.group_scales(), q.group_mins(), gs, route=int4_route(capabilities()))
    s, z = w.scale_zero.float().unbind(-1)  # [K / G, N]: the kernel's bf16 scale and zero
    codes = q.unpack_codes().float().t()  # [K, N]
    want = (codes - 8).view(k // gs, gs, n) * s.unsqueeze(1) + z.unsqueeze(1)
    got = w.dense_t().clone()  # dense_t returns a reused buffer
    assert got.shape == (k, n)
    assert torch.allclose(got, want.view(k, n), rtol=1e-6, atol=1e-7), (got - want.view(k, n)).abs().max()
    assert torch.equal(w.dense_t(torch.bfloat16), got.to(torch.bfloat16))
    x = torch.randn(300, k, generator=g)
    assert w.dense_dtype in (torch.bfloat16, torch.float32)
    w.dense_min_rows = 1
    dense = w(x)
    w.dense_min_rows = None
    kernel = w(x)  # bf16 activations: agrees to bf16 precision
    assert (dense - kernel).abs().max() <= 0.02 * kernel.abs().max(), (dense - kernel).abs().max()
print("block", packed_block_n(), "read-back", w.dense_dtype)
"""


def _run(env: dict[str, str]) -> str:
    r = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env={**os.environ, **env},
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_packed_layout_is_recognised_here():
    assert packed_block_n() in (64, 32, 16)


def test_dense_read_back_equals_the_kernels_weight_native_isa():
    assert "block" in _run({})


def test_dense_read_back_equals_the_kernels_weight_on_avx2():
    """torch packs rows in blocks of 32 under its AVX2 kernels (64 under AVX-512): the layout probe must
    find it, and the decoded weight must still be the packed one."""
    out = _run({"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert "block 32" in out or "block 64" in out  # 64 only if this torch ignores the capability
    assert "read-back torch.float32" in out  # bf16 is emulated under AVX2: read back as fp32


def test_a_wrong_layout_guess_is_caught():
    """The probe must be able to fail: decoding with the other block size does not give the codes back."""
    q = random_q4(128, 64, 0.05, torch.Generator().manual_seed(2))
    w = Int4Cpu(q.unpack_codes(), q.group_scales(), q.group_mins(), 32)
    from kvcli.model.int4_cpu import _unpack
    bn = packed_block_n()
    other = 32 if bn == 64 else 64
    assert torch.equal(_unpack(w.packed, 128, 64, bn).t(), q.unpack_codes())
    assert not torch.equal(_unpack(w.packed, 128, 64, other).t(), q.unpack_codes())


@pytest.mark.parametrize("rows", [1, 300])
def test_linear_output_close_to_the_exact_matmul(rows):
    from kvcli.model.layers import planned_linear as Linear
    q = random_q4(256, 128, 0.05, torch.Generator().manual_seed(3))
    lin = Linear(q, None, "int4-cpu", torch.float32)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(4))
    ref = x @ q.dequantize().t()
    assert (lin(x) - ref).abs().max() <= 0.02 * ref.abs().max()
