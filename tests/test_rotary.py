"""Rotary.apply (sign folded into the sin table, rotate-half as a roll) against the textbook
rotate-half formula: the same float operations, so the results must be equal bit for bit."""

from __future__ import annotations

import torch

from kvcli.model.layers import Rotary


def textbook(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def test_rotary_apply_is_bitwise_the_rotate_half_formula():
    g = torch.Generator().manual_seed(0)
    rot = Rotary(64, 4096, 100000.0, None, torch.device("cpu"))
    positions = torch.tensor([0, 1, 17, 511, 4095, 300])
    cos = rot.cos[positions].unsqueeze(1)
    half = rot.half  # sin's halves are equal: the signed table's second half is sin
    sin = rot.sin_signed[positions, half:].repeat(1, 2).unsqueeze(1)
    for dtype in (torch.float32, torch.bfloat16):
        cs = rot.at(positions, dtype)
        for heads in (1, 12):
            x = (torch.randn(len(positions), heads, 64, generator=g) * 30).to(dtype)
            got = rot.apply(x, cs)
            assert got.dtype == dtype
            assert torch.equal(got, textbook(x, cos.to(dtype), sin.to(dtype)))
    # q and k heads side by side in one call give what separate calls give
    q, k = torch.randn(6, 9, 64, generator=g), torch.randn(6, 3, 64, generator=g)
    both = rot.apply(torch.cat([q, k], dim=1), rot.at(positions, torch.float32))
    assert torch.equal(both[:, :9], textbook(q, cos, sin)) and torch.equal(both[:, 9:], textbook(k, cos, sin))
