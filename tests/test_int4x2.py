"""int4x2-cpu: Q5_0 / Q5_1 / Q5_K / Q6_K / Q8_0 linears through torch's int4 CPU kernel, each code split
into two nibbles over a doubled reduction dimension (kvcli/model/int4_cpu.py, int4x2_pack).

Not bit-exact (bf16 activations, scales and zeros, as the int4-cpu path), so the bound is relative: the
error against the exact dense matmul (QuantTensor.dequantize, float64) must stay within 2x the error
of the existing 4-bit int4-cpu path on comparable data (random well-formed blocks of the 4-bit
counterpart type, same shapes, same activations). A wrong code offset or zero is off by a whole code
step per group, orders of magnitude above that."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcli.model.gguf_loader import _DECODERS
from kvcli.model.kquant_encode import random_blocks
from kvcli.model.layers import planned_linear as Linear
from kvcli.model.quant import QuantTensor

# Each 5/6/8-bit type against the 4-bit type whose int4-cpu error is the yardstick.
PAIRS = [("Q5_0", "Q4_0"), ("Q5_1", "Q4_1"), ("Q5_K", "Q4_K"), ("Q6_K", "Q4_K"), ("Q8_0", "Q4_0")]
N, K = 128, 1024


def _blocks(type_name: str, seed: int, n: int = N, k: int = K) -> QuantTensor:
    rng = np.random.default_rng(seed)
    raw = random_blocks(type_name, n, k, rng, scale=0.02)
    return _DECODERS[type_name](torch.from_numpy(raw.copy()), n, k)


def _rel_err(lin: Linear, q: QuantTensor, x: torch.Tensor) -> float:
    ref = x.double() @ q.dequantize().double().T
    return ((lin(x).double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("type_name,q4_type", PAIRS)
def test_int4x2_matches_dense_within_the_int4_paths_error(type_name, q4_type, rows):
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    errs, errs4 = [], []
    for seed in range(3):
        q, q4 = _blocks(type_name, seed), _blocks(q4_type, 100 + seed)
        lin, lin4 = Linear(q, None, "int4-cpu", torch.float32), Linear(q4, None, "int4-cpu", torch.float32)
        assert (lin.mode, lin4.mode) == ("int4x2-cpu", "int4-cpu")
        errs.append(_rel_err(lin, q, x))
        errs4.append(_rel_err(lin4, q4, x))
    err, err4 = float(np.mean(errs)), float(np.mean(errs4))
    print(f"{type_name} rows {rows}: int4x2-cpu rel. error {err:.2e}; {q4_type} int4-cpu {err4:.2e}")
    assert 0 < err <= 2 * err4, (err, err4)


@pytest.mark.parametrize("type_name", [t for t, _ in PAIRS])
def test_int4x2_bias_and_bf16_input(type_name):
    """A bias is added once; a bf16 input (no cast before the rearrangement) gives the same numbers."""
    q = _blocks(type_name, 5, n=32, k=256)
    bias = torch.randn(32, generator=torch.Generator().manual_seed(1))
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(2))
    with_bias = Linear(q, bias, "int4-cpu", torch.float32)
    plain = Linear(q, None, "int4-cpu", torch.float32)
    assert torch.allclose(with_bias(x), plain(x) + bias)
    yb = plain(x.to(torch.bfloat16))
    assert yb.dtype == torch.bfloat16 and torch.equal(yb.float(), plain(x.to(torch.bfloat16).float()))


@pytest.mark.parametrize("type_name,group", [("Q5_0", 32), ("Q6_K", 16), ("Q8_0", 32)])
def test_int4x2_resident_bytes(type_name, group):
    """8 bits per code (two nibbles) + a bf16 scale and zero per file group, nothing else kept."""
    import gguf

    q = _blocks(type_name, 9, n=64, k=512)
    lin = Linear(q, None, "int4-cpu", torch.float32)
    assert lin.nbytes == 64 * 512 + 4 * 64 * 512 // group
    assert not hasattr(lin, "q")  # the file's form is not kept besides
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    ratio = lin.nbytes / (64 * 512 // block * size)
    assert ratio == pytest.approx({"Q5_0": 36 / 22, "Q6_K": 320 / 210, "Q8_0": 36 / 34}[type_name])


def test_int4x2_falls_back_to_the_exact_path():
    """Rows not a multiple of 16, or a non-CPU mode: dequantized per call, the dense result exactly."""
    q = _blocks("Q6_K", 3, n=24, k=256)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(0))
    for mode in ("int4-cpu", "exact"):
        lin = Linear(q, None, mode, torch.float32)
        assert lin.mode == "dequant-torch"
        assert torch.equal(lin(x), x @ q.dequantize().T)
    q16 = _blocks("Q6_K", 3, n=32, k=256)
    assert Linear(q16, None, "exact", torch.float32).mode == "dequant-torch"
