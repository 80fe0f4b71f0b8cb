"""Rotary scalings (kvcli/model/rope.py) against transformers' own rope initialisation functions on the same
parameters, and Rotary.shift_keys against rotating at the shifted position. GGUF semantics (llama.cpp) are
checked end to end by tests/conformance."""

from __future__ import annotations

import math

import pytest
import torch

from kvcli.model import rope
from kvcli.model.layers import Rotary

HEAD_DIM, THETA = 64, 10000.0


def hf_frequencies(params: dict, max_positions: int, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, head_dim=HEAD_DIM,
                      max_position_embeddings=max_positions, rope_parameters={"rope_theta": THETA, **params})
    inv, attention = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, torch.device("cpu"), seq_len=seq_len)
    return inv.float(), float(attention)


CASES = {
    "linear": ({"rope_type": "linear", "factor": 4.0}, 4096),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}, 131072),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072),
    "yarn-betas": ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096,
                    "beta_fast": 16.0, "beta_slow": 2.0}, 32768),
    "yarn-mscale": ({"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                     "mscale": 1.0, "mscale_all_dim": 0.707}, 163840),
    "yarn-attention": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048,
                        "attention_factor": 1.25}, 8192),
}


@pytest.mark.parametrize("name", CASES)
def test_frequencies_equal_transformers(name):
    params, max_positions = CASES[name]
    want_inv, want_att = hf_frequencies(params, max_positions)
    inv, att = rope.frequencies(HEAD_DIM, THETA, params, max_positions)
    torch.testing.assert_close(inv, want_inv, rtol=1e-6, atol=0)
    assert att == pytest.approx(want_att, rel=1e-6)


@pytest.mark.parametrize("long", [True, False])
def test_longrope_picks_its_factors_by_the_context_as_llama_cpp(long):
    """The factors come from the context kvcli runs with; transformers on a sequence of that length agrees."""
    half = HEAD_DIM // 2
    g = torch.Generator().manual_seed(0)
    params = {"rope_type": "longrope", "original_max_position_embeddings": 4096,
              "long_factor": (1 + 10 * torch.rand(half, generator=g)).tolist(),
              "short_factor": (1 + torch.rand(half, generator=g)).tolist()}
    max_positions = 131072 if long else 4096
    want_inv, want_att = hf_frequencies(params, max_positions, seq_len=max_positions if long else 16)
    inv, att = rope.frequencies(HEAD_DIM, THETA, params, max_positions)
    torch.testing.assert_close(inv, want_inv, rtol=1e-6, atol=0)
    assert att == pytest.approx(want_att, rel=1e-6)
    assert (att > 1) == long  # sqrt(1 + ln(32) / ln(4096)) past the original context, 1 within it


def test_freq_factors_divide_and_combine_with_linear():
    ff = torch.linspace(1, 4, HEAD_DIM // 2)
    plain, _ = rope.frequencies(HEAD_DIM, THETA, None, 64)
    inv, att = rope.frequencies(HEAD_DIM, THETA, {"rope_type": "linear", "factor": 2.0, "freq_factors": ff.tolist()}, 64)
    torch.testing.assert_close(inv, plain / ff / 2.0)
    assert att == 1.0
    with pytest.raises(ValueError, match="has 3 values; the rotary embedding has 32 frequency pairs"):
        rope.frequencies(HEAD_DIM, THETA, {"rope_type": "default", "freq_factors": [1.0, 2.0, 3.0]}, 64)
    with pytest.raises(ValueError, match="'dynamic' is not computed by kvcli"):
        rope.frequencies(HEAD_DIM, THETA, {"rope_type": "dynamic", "factor": 2.0}, 64)


def test_the_attention_factor_scales_both_tables():
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    r = Rotary(HEAD_DIM, 512, THETA, scaling, torch.device("cpu"))
    assert r.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1)
    norms = (r.cos ** 2 + r.sin_signed ** 2)[:, : HEAD_DIM // 2]
    torch.testing.assert_close(norms, torch.full_like(norms, r.attention_factor ** 2))


@pytest.mark.parametrize("scaling", [None, CASES["yarn"][0], CASES["llama3"][0]], ids=["plain", "yarn", "llama3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shift_keys_equals_rotating_at_the_shifted_position(scaling, dtype):
    """A key rotated at p, shifted by d, is the key rotated at p - d (the attention factor carried once)."""
    r = Rotary(HEAD_DIM, 4096, THETA, scaling, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    k0 = torch.randn(40, 3, HEAD_DIM, generator=g)
    p = torch.randint(600, 4096, (40,), generator=g)
    d = 517
    stored = r.apply(k0, r.at(p, torch.float32)).to(dtype)
    want = r.apply(k0, r.at(p - d, torch.float32))
    got = r.shift_keys(stored, d)
    assert got.dtype == dtype
    tol = 1e-3 if dtype == torch.float32 else 2e-2  # fp32 tables: angles p * inv_freq carry ~p * 1e-7 rad
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * float(want.abs().max()))
