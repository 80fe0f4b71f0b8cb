"""Plain-torch references for the Triton kernels (slow, obviously right; used by tests and gpu_check).

Everything is computed in fp32 and cast to the kernel's output dtype at the end.
"""

from __future__ import annotations

import torch

__all__ = [
    "write_kv_cache_ref",
    "paged_attention_ref",
    "int4_matmul_ref",
    "dequantize_int4_ref",
    "quantize_int4",
    "pack_int4",
]


def write_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """In place: cache[slot // block_size, slot % block_size] = row, skipping slots < 0; quantized
    caches (scales given) store kvcli.kvcache.kv_dtype.quantize's codes and scales."""
    if k_scale is not None:
        from kvcli.kvcache.kv_dtype import quantize  # the definition the kernel must reproduce
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        blk, off = slot // block_size, slot % block_size
        for cache, scales, x in ((k_cache, k_scale, key[t]), (v_cache, v_scale, value[t])):
            if scales is None:
                cache[blk, off] = x.to(cache.dtype)
            else:
                cache[blk, off], scales[blk, off] = quantize(x, cache.dtype)


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Per-request loop: gather the request's KV through its block table, causal softmax in fp32.
    Quantized caches (int8 / e4m3 codes) are dequantized first: codes * k_scale/v_scale per token and head.
    window > 0: the row at position p sees keys [p - window + 1, p] only. softcap > 0: scores become
    softcap * tanh(scores / softcap) before the mask (Gemma 2's attention logit soft-capping)."""
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty(num_tokens, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    cu = cu_seqlens_q.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = cu[b], cu[b + 1]
        q_len = hi - lo
        if q_len == 0:
            continue
        pos = torch.arange(seq_len, device=q.device)
        blocks = block_tables[b, pos // block_size].long()
        slots = pos % block_size
        k = k_cache[blocks, slots].float()  # [S, Hkv, D]
        v = v_cache[blocks, slots].float()
        if k_scale is not None and v_scale is not None:
            k = k * k_scale[blocks, slots].unsqueeze(-1)
            v = v * v_scale[blocks, slots].unsqueeze(-1)
        k = k.repeat_interleave(group, dim=1)  # query head h uses KV head h // group
        v = v.repeat_interleave(group, dim=1)
        qb = q[lo:hi].float()  # [L, Hq, D]
        scores = torch.einsum("lhd,shd->hls", qb, k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        causal = pos[None, :] <= q_pos[:, None]  # [L, S]
        if window:
            causal &= pos[None, :] > q_pos[:, None] - window
        scores = scores.masked_fill(~causal[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[lo:hi] = torch.einsum("hls,shd->lhd", probs, v).to(q.dtype)
    return out


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] integer codes in 0..15 -> uint8 [N, K // 2]; k = 2j low nibble, k = 2j + 1 high nibble."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def dequantize_int4_ref(codes: torch.Tensor, scale: torch.Tensor, min: torch.Tensor, group_size: int) -> torch.Tensor:
    """w[n, k] = scale[n, k // G] * q[n, k] + min[n, k // G] in fp32, shape [N, K]."""
    low = (codes & 0xF).float()
    high = (codes >> 4).float()
    q = torch.stack([low, high], dim=-1).flatten(1)  # [N, K], interleaved back to k order
    s = scale.float().repeat_interleave(group_size, dim=1)
    m = min.float().repeat_interleave(group_size, dim=1)
    return s * q + m


def int4_matmul_ref(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, min: torch.Tensor, group_size: int = 32
) -> torch.Tensor:
    """x @ W^T with W dequantized in fp32; output in x's dtype."""
    w = dequantize_int4_ref(codes, scale, min, group_size)
    return (x.float() @ w.t()).to(x.dtype)


def quantize_int4(
    w: torch.Tensor, group_size: int = 32, symmetric: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-wise 4-bit quantization of w [N, K] -> (codes uint8 [N, K//2], scale fp16, min fp16).

    symmetric=False is GGUF Q4_1 (min = group minimum); symmetric=True is Q4_0 (min = -8 * scale).
    """
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"K={k} must be a multiple of group_size={group_size}")
    g = w.float().reshape(n, k // group_size, group_size)
    if symmetric:
        amax = g.abs().amax(-1)
        scale = (amax / 8).clamp_min(1e-8)
        mins = -8 * scale
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).clamp_min(1e-8)
        mins = lo
    # Round the stored (fp16) parameters first so codes are chosen for what the kernel will see.
    scale16, min16 = scale.half(), mins.half()
    q = torch.round((g - min16.float()[..., None]) / scale16.float()[..., None]).clamp(0, 15)
    return pack_int4(q.reshape(n, k)), scale16, min16


def dequantize_int8_ref(codes: torch.Tensor, scale: torch.Tensor, min: torch.Tensor | None,
                        group_size: int) -> torch.Tensor:
    """w[n, k] = scale[n, k // G] * codes[n, k] (+ min[n, k // G]) in fp32 for int8 codes [N, K]."""
    w = codes.float() * scale.float().repeat_interleave(group_size, dim=1)
    return w if min is None else w + min.float().repeat_interleave(group_size, dim=1)


def int8_matmul_ref(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, min: torch.Tensor | None,
                    group_size: int) -> torch.Tensor:
    """x @ W^T with int8-code W dequantized in fp32; output in x's dtype."""
    return (x.float() @ dequantize_int8_ref(codes, scale, min, group_size).t()).to(x.dtype)
