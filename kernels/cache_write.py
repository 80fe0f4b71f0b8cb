"""Scatter one step's K/V rows into the paged KV cache.

Layouts (see kvcli/attention/base.py):
  key, value       : [num_tokens, num_kv_heads, head_dim]
  k_cache, v_cache : [num_blocks, block_size, num_kv_heads, head_dim]
  slot_mapping     : [num_tokens] int32/int64, slot = block * block_size + offset, < 0 = skip

Grid: (num_tokens, cdiv(num_kv_heads, BLOCK_H)). One program writes a [BLOCK_H, head_dim] tile of
both K and V for one token, so a decode step (one token per request) is a handful of programs
and a prefill chunk scales with its token count. All cache offsets are computed in int64: the
pool of one layer easily exceeds 2^31 elements (block ids * block stride).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["write_kv_cache"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kc_blk,
    stride_kc_tok,
    stride_kc_h,
    stride_kc_d,
    stride_vc_blk,
    stride_vc_tok,
    stride_vc_h,
    stride_vc_d,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:  # padding token / nothing to store
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE

    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < HEAD_DIM)
    # Head/dim offsets stay small; only the token and block terms need int64.
    h64 = offs_h.to(tl.int64)[:, None]
    d64 = offs_d.to(tl.int64)[None, :]

    k = tl.load(key_ptr + tok * stride_kt + h64 * stride_kh + d64 * stride_kd, mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + h64 * stride_vh + d64 * stride_vd, mask=mask)

    kc = k_cache_ptr + blk * stride_kc_blk + off * stride_kc_tok + h64 * stride_kc_h + d64 * stride_kc_d
    vc = v_cache_ptr + blk * stride_vc_blk + off * stride_vc_tok + h64 * stride_vc_h + d64 * stride_vc_d
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check_inputs(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            f"key/value must both be [num_tokens, kv_heads, head_dim]; got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache/v_cache must both be [num_blocks, block_size, kv_heads, head_dim]; "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if tuple(key.shape[1:]) != tuple(k_cache.shape[2:]):
        raise ValueError(
            f"key is [*, {key.shape[1]}, {key.shape[2]}] but the cache holds [*, *, {k_cache.shape[2]}, {k_cache.shape[3]}] "
            "(kv_heads, head_dim must match)"
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must be [num_tokens={key.shape[0]}]; got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64; got {slot_mapping.dtype}")
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} must be float16/bfloat16/float32; got {t.dtype}")
    devices = {t.device for t in (key, value, k_cache, v_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(str(d) for d in devices)}")


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """In place: k_cache/v_cache[slot // block_size, slot % block_size] = key/value[t] (cast to the
    cache dtype) for every token t with slot_mapping[t] >= 0. Any strides are accepted."""
    _check_inputs(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    block_size = k_cache.shape[1]
    block_d = triton.next_power_of_2(head_dim)
    # ~2K elements per tensor per program: enough bytes in flight, few programs for decode.
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 2048 // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _write_kv_cache_kernel[grid](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        num_kv_heads,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_H=block_h,
        num_warps=4 if block_h * block_d >= 1024 else 2,
    )
