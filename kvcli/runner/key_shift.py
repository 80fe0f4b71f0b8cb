"""Re-rotating cached keys by a position shift (a bounded cache's context shift, kvcache/retention.py).

Keys are stored rotated at their cache positions p (rotate-half layout: out = x cos + rotate_half(x) sin,
the model's Rotary). Moving them to p - delta needs no original key: rotation composes,
R(p - delta) = R(-delta) R(p), so each pair of dimensions turns by -delta * inv_freq_i. `rotate_by` is the
pure rotation (no attention factor: the stored keys carry it once already).

Private until the model's `Rotary.shift_keys(k, delta)` lands (same contract: keys [N, kv_heads, D] rotated
by -delta positions); the angles here come from the model's own cos/sin tables (row delta is the rotation by
+delta, computed as the tables were), divided by the attention factor the tables fold in.
"""

from __future__ import annotations

import torch


def rotate_by(rotary, k: torch.Tensor, delta: int) -> torch.Tensor:
    """k [N, kv_heads, D], rotated at positions p -> the same keys rotated at p - delta (fp32 math, k's dtype)."""
    factor = float(getattr(rotary, "attention_factor", 1.0))
    cos = rotary.cos[delta].to(k.device, torch.float32) / factor  # cos(delta * f) = cos(-delta * f)
    sin = -rotary.sin[delta].to(k.device, torch.float32) / factor  # sin(-delta * f)
    half = k.shape[-1] // 2
    sin_signed = torch.cat([-sin[:half], sin[half:]])
    x = k.to(torch.float32)
    out = x * cos + torch.roll(x, half, dims=-1) * sin_signed
    return out.to(k.dtype)
