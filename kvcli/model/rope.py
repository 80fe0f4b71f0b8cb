"""Rotary frequencies: the per-pair inverse frequencies and the attention factor of every rotary scaling kvcli
computes, from one dictionary in Hugging Face's vocabulary (config.json's `rope_scaling` / `rope_parameters`,
or the GGUF loader's translation of llama.cpp's `<arch>.rope.*` keys and rotary tensors).

For pair i of a head of D dimensions (base b = rope_theta):

    inv_i = b^(-2i/D) / ff_i                     ff: per-pair divisors ("freq_factors": GGUF rope_freqs.weight;
                                                 longrope's long or short factors; llama3's smoothed bands)
    linear   inv_i /= factor                     (llama.cpp: freq_scale = 1 / factor)
    yarn     inv_i = inv_i/factor * (1 - m_i) + inv_i * m_i,   m_i = 1 - clamp((i - lo) / max(hi - lo, 0.001), 0, 1)
             lo, hi = floor/ceil of D * ln(n_orig / (beta * 2 pi)) / (2 ln b) for beta_fast, beta_slow, in [0, D-1]
    cos/sin  multiplied by the attention factor (yarn: 0.1 ln(factor) + 1 unless given; longrope:
             sqrt(1 + ln(factor) / ln(n_orig)) unless given)

These are llama.cpp's ggml rope (rope_yarn, ggml_rope_yarn_corr_dims, freq_factors dividing theta) and
transformers' _compute_*_parameters, which agree on them. Longrope picks its factors once, from the context
kvcli runs with (the model's max_position_embeddings): long when it exceeds the original context, as
llama.cpp chooses by n_ctx; transformers switches per forward on the sequence length instead, so a Hugging
Face Phi-3 folder matches transformers only on sequences past the original context.
"""

from __future__ import annotations

import math

import torch

from kvcli.config import ROPE_TYPES


def _get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _factor(scaling: dict, key: str = "factor") -> float:
    v = scaling.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise ValueError(f"rope scaling {scaling.get('rope_type')!r} needs a positive {key} (got {v!r})")
    return float(v)


def _per_pair(values, half: int, what: str) -> torch.Tensor:
    t = torch.as_tensor(values, dtype=torch.float32).flatten()
    if t.numel() != half:
        raise ValueError(f"{what} has {t.numel()} values; the rotary embedding has {half} frequency pairs")
    if not bool(torch.all(torch.isfinite(t) & (t > 0))):
        raise ValueError(f"{what} must be positive finite numbers")
    return t


def _llama3(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: divide the low-frequency band by the factor, keep the high one, blend between."""
    factor = _factor(scaling)
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_mid, mid, scaled)


def _yarn_extrapolation(dim: int, theta: float, original: float, beta_fast: float, beta_slow: float
                        ) -> torch.Tensor:
    """m_i: 1 where pair i keeps its trained (extrapolated) frequency, 0 where it is interpolated."""
    def corr_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo = max(math.floor(corr_dim(beta_fast)), 0)
    hi = min(math.ceil(corr_dim(beta_slow)), dim - 1)
    ramp = (torch.arange(dim // 2, dtype=torch.float32) - lo) / max(hi - lo, 0.001)
    return 1 - ramp.clamp(0, 1)


def frequencies(head_dim: int, theta: float, scaling: dict | None, max_positions: int
                ) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] float32, attention factor) for this rotary embedding."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq, 1.0
    half = head_dim // 2
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope scaling {kind!r} is not computed by kvcli (supported: {', '.join(ROPE_TYPES)})")
    if scaling.get("freq_factors") is not None:
        inv_freq = inv_freq / _per_pair(scaling["freq_factors"], half, "rope freq_factors")
    attention = scaling.get("attention_factor")
    if kind == "linear":
        inv_freq = inv_freq / _factor(scaling)
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    elif kind == "yarn":
        factor = _factor(scaling)
        original = float(scaling.get("original_max_position_embeddings") or max_positions)
        keep = _yarn_extrapolation(head_dim, theta, original, float(scaling.get("beta_fast") or 32),
                                   float(scaling.get("beta_slow") or 1))
        inv_freq = inv_freq / factor * (1 - keep) + inv_freq * keep
        if attention is None:
            mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
            attention = (_get_mscale(factor, mscale) / _get_mscale(factor, mscale_all) if mscale and mscale_all
                         else _get_mscale(factor))
    elif kind == "longrope":
        original = float(_factor(scaling, "original_max_position_embeddings"))
        long = max_positions > original
        inv_freq = inv_freq / _per_pair(scaling["long_factor" if long else "short_factor"], half,
                                        f"longrope {'long' if long else 'short'}_factor")
        if attention is None:
            factor = float(scaling.get("factor") or max_positions / original)
            attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inv_freq, float(1.0 if attention is None else attention)
