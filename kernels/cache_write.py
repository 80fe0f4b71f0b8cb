"""Scatter one step's K/V rows into the paged KV cache.

Layouts (see kvcli/attention/base.py):
  key, value       : [num_tokens, num_kv_heads, head_dim]
  k_cache, v_cache : [num_blocks, block_size, num_kv_heads, head_dim]
  slot_mapping     : [num_tokens] int32/int64, slot = block * block_size + offset, < 0 = skip
  k_scale, v_scale : [num_blocks, block_size, num_kv_heads] fp32, only for quantized caches
                     (int8 or float8_e4m3fn codes): one symmetric absmax scale per token and KV head

Quantized caches are quantized here, on write, with exactly the arithmetic of
kvcli.kvcache.kv_dtype.quantize (the one definition): scale = amax / qmax and y = x / scale as
correctly rounded fp32 divisions (div_rn: Triton's plain `/` is an approximate division on GPUs),
clamp to +-qmax, then round half to even (int8) or convert round-to-nearest-even (e4m3). Codes and
scales are therefore bit-identical to the torch backend's (tested).

Grid: (num_tokens, cdiv(num_kv_heads, BLOCK_H)). One program writes a [BLOCK_H, head_dim] tile of
both K and V for one token, so a decode step (one token per request) is a handful of programs
and a prefill chunk scales with its token count. All cache offsets are computed in int64: the
pool of one layer easily exceeds 2^31 elements (block ids * block stride).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcli_kernels import kv_formats

__all__ = ["write_kv_cache"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Quantized cache element type -> (QUANT id in the kernels, qmax), from kvcli.kvcache.kv_dtype.KV_DTYPES.
QUANT_FORMATS = kv_formats.QUANT_FORMATS
# Adding 1.5 * 2^23 to an fp32 |y| < 2^22 leaves no fraction bits: the add rounds y half to even
# (the FPU's default mode), the subtraction is exact. Same result as torch.round, in every backend.
_RNE_MAGIC = tl.constexpr(12582912.0)


def require_fp8_device(device: torch.device) -> None:
    """fp8 (e4m3) KV on CUDA needs the hardware conversions of compute capability >= 8.9."""
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise ValueError(f"fp8 KV cache needs a GPU of compute capability >= 8.9 (Ada, Hopper); this one is "
                             f"{cap[0]}.{cap[1]}: use --kv-dtype int8")


@triton.jit
def _quantize_tile(x, QUANT: tl.constexpr, QMAX: tl.constexpr, out_ty: tl.constexpr):
    """[H, D] fp32 rows -> (codes [H, D] of out_ty, scales [H]); kvcli.kvcache.kv_dtype.quantize."""
    scale = tl.math.div_rn(tl.max(tl.abs(x), 1), QMAX)
    safe = tl.where(scale > 0, scale, 1.0)
    y = tl.math.div_rn(x, safe[:, None])
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if QUANT == 1:
        codes = ((y + _RNE_MAGIC) - _RNE_MAGIC).to(out_ty)
    else:
        codes = _round_to_e4m3(y).to(out_ty)  # exact: the value is already on the e4m3 grid
    return codes, scale


@triton.jit
def _round_to_e4m3(y):
    """fp32 y (|y| <= 448) rounded half to even onto the float8_e4m3fn grid, still fp32.

    Done in fp32 rather than by the fp32 -> e4m3 conversion because Triton 3.9's interpreter
    converts wrongly (120..128 become 64, ties round away from zero); a value already on the grid
    converts exactly everywhere. e4m3 has 3 mantissa bits, exponents >= -6 (below: subnormal steps
    of 2^-9), so the step at y is 2^max(exponent(y) - 3, -9); adding 1.5 * 2^(step exponent + 23)
    rounds to a multiple of the step in the FPU's round-half-even mode.
    """
    exp = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step_exp = tl.maximum(exp - 3, -9)
    magic = (((step_exp + 23 + 127) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
    r = (y + magic) - magic
    return tl.where(r == 0.0, y * 0.0, r)  # keep the sign of zero, as torch's conversion does


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,  # quantized caches only: [num_blocks, block_size, num_kv_heads] fp32
    v_scale_ptr,
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
    stride_ks_blk,
    stride_ks_tok,
    stride_ks_h,
    stride_vs_blk,
    stride_vs_tok,
    stride_vs_h,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    QUANT: tl.constexpr,  # 0 float cache, 1 int8 codes, 2 float8_e4m3fn codes (+ fp32 scales)
    QMAX: tl.constexpr,
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
    if QUANT == 0:
        tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
    else:
        # Masked-off lanes load 0 and cannot raise a row's absmax.
        k_codes, k_scale = _quantize_tile(k.to(tl.float32), QUANT, QMAX, k_cache_ptr.dtype.element_ty)
        v_codes, v_scale = _quantize_tile(v.to(tl.float32), QUANT, QMAX, v_cache_ptr.dtype.element_ty)
        tl.store(kc, k_codes, mask=mask)
        tl.store(vc, v_codes, mask=mask)
        h_valid = offs_h < num_kv_heads
        hs = offs_h.to(tl.int64)
        tl.store(k_scale_ptr + blk * stride_ks_blk + off * stride_ks_tok + hs * stride_ks_h, k_scale, mask=h_valid)
        tl.store(v_scale_ptr + blk * stride_vs_blk + off * stride_vs_tok + hs * stride_vs_h, v_scale, mask=h_valid)


def _check_inputs(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
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
    for name, t in (("key", key), ("value", value)):
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} must be float16/bfloat16/float32; got {t.dtype}")
    check_cache_format(k_cache, v_cache, k_scale, v_scale)
    scales = [] if k_scale is None or v_scale is None else [k_scale, v_scale]
    devices = {t.device for t in (key, value, k_cache, v_cache, slot_mapping, *scales)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(str(d) for d in devices)}")


def check_cache_format(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> None:
    """Float caches take no scales; int8 / float8_e4m3fn caches need fp32 scales [blocks, block_size, kv_heads]."""
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache dtypes differ: {k_cache.dtype} vs {v_cache.dtype}")
    if k_cache.dtype in _FLOAT_DTYPES:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"a {k_cache.dtype} cache is not quantized: pass no k_scale/v_scale")
        return
    if k_cache.dtype not in QUANT_FORMATS:
        raise ValueError(f"cache must be float16/bfloat16/float32, int8 or float8_e4m3fn; got {k_cache.dtype}")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            raise ValueError(f"a {k_cache.dtype} cache needs k_scale and v_scale (one fp32 scale per token and KV head)")
        if s.dtype != torch.float32 or tuple(s.shape) != tuple(k_cache.shape[:3]):
            raise ValueError(f"{name} must be float32 {list(k_cache.shape[:3])} (blocks, block_size, kv_heads); "
                             f"got {s.dtype} {list(s.shape)}")
    if k_cache.dtype == torch.float8_e4m3fn:
        require_fp8_device(k_cache.device)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """In place: k_cache/v_cache[slot // block_size, slot % block_size] = key/value[t] (cast to the
    cache dtype, or quantized with its scale stored in k_scale/v_scale for int8 / float8_e4m3fn
    caches) for every token t with slot_mapping[t] >= 0. Any strides are accepted."""
    _check_inputs(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    block_size = k_cache.shape[1]
    block_d = triton.next_power_of_2(head_dim)
    # ~2K elements per tensor per program: enough bytes in flight, few programs for decode.
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 2048 // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    quant, qmax = QUANT_FORMATS.get(k_cache.dtype, (0, 1.0))
    ks = k_scale if k_scale is not None else slot_mapping  # unused placeholders for float caches
    vs = v_scale if v_scale is not None else slot_mapping
    scale_strides = (*k_scale.stride(), *v_scale.stride()) if k_scale is not None and v_scale is not None else (0,) * 6
    _write_kv_cache_kernel[grid](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        ks,
        vs,
        num_kv_heads,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *scale_strides,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_H=block_h,
        QUANT=quant,
        QMAX=qmax,
        num_warps=4 if block_h * block_d >= 1024 else 2,
    )
