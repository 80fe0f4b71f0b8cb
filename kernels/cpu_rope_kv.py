"""Launcher of cpu_rope_kv.c: rotary embedding of q and k and the store of k, v into the paged cache in
one call per layer. Built at first use by cpu_build.py; `load` returns None where it cannot be built."""

from __future__ import annotations

import ctypes

import torch

from kvcli_kernels import kv_formats
from kvcli_kernels.cpu_build import build

_SOURCE = "cpu_rope_kv.c"
DTYPE_CODES = kv_formats.DTYPE_CODES  # cache storage dtype -> DT_* of cpu_rope_kv.c (kv_formats.py)
_ERRORS = {-2: "a position outside the rotary table", -3: "a KV slot outside the cache",
           -4: "an unsupported cache dtype or head size"}


def load(isa: str, cache_dir: str) -> ctypes.CDLL | None:
    lib = build(_SOURCE, isa, cache_dir)
    if lib is not None and not hasattr(lib, "_kvr_declared"):
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.kvr_rope_kv.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr,
                                    ctypes.c_int, i64, i64, i64, i64, i64, i64, i64, i64, ptr, ptr, i64, i64, i64,
                                    ctypes.c_int]
        lib.kvr_rope_kv.restype = ctypes.c_int
        lib._kvr_declared = True
    return lib


def cache_supported(k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> bool:
    """A cache the kernel writes: fp32 / fp16 / bf16 without scales, or int8 / fp8 with fp32 scales
    [blocks, block_size, kvh] (k's and v's strides alike), indexed [blocks, block_size, kvh, D] with unit-stride
    head rows, on the CPU."""
    if not (k.device.type == "cpu" and k.dim() == 4 and k.dtype in DTYPE_CODES and v.dtype == k.dtype
            and v.shape == k.shape and k.stride(3) == 1 and v.stride(3) == 1):
        return False
    if k.dtype not in kv_formats.QUANTIZED:
        return k_scale is None and v_scale is None
    return (k_scale is not None and v_scale is not None and all(
        s.dtype == torch.float32 and s.device.type == "cpu" and s.shape == k.shape[:3] for s in (k_scale, v_scale))
        and k_scale.stride() == v_scale.stride())


def scale_args(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> tuple:
    """kvr_rope_kv's ks, vs, s_sb, s_st, s_sh for a cache's scales (NULLs and zeros for a float cache)."""
    if k_scale is None or v_scale is None:
        return None, None, 0, 0, 0
    return (k_scale.data_ptr(), v_scale.data_ptr(), *k_scale.stride())


def rope_kv(lib: ctypes.CDLL, qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor,
            sin_signed: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """qkv fp32 [T, (heads + 2 kv_heads) * D] (rows contiguous), tables fp32 [P, D], positions and slots
    int64 [T] contiguous, k / v (and an int8 / fp8 cache's scales) as cache_supported -> q rotated, fp32
    [T, heads, D]; k rotated and v are stored in their slots (negative: not stored), quantized as
    kv_dtype.quantize does for int8 / fp8. ValueError for a position or slot out of range."""
    t = qkv.shape[0]
    d = cos.shape[1]
    q = torch.empty(t, heads, d, dtype=torch.float32)
    blocks, bs = k.shape[0], k.shape[1]
    rc = lib.kvr_rope_kv(qkv.data_ptr(), t, qkv.stride(0), heads, kv_heads, d, cos.data_ptr(), sin_signed.data_ptr(),
                         cos.shape[0], positions.data_ptr(), slots.data_ptr(), q.data_ptr(), k.data_ptr(),
                         v.data_ptr(), DTYPE_CODES[k.dtype], bs, blocks * bs, k.stride(0), k.stride(1), k.stride(2),
                         v.stride(0), v.stride(1), v.stride(2), *scale_args(k_scale, v_scale),
                         torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"rope_kv: {_ERRORS.get(rc, f'error {rc}')}")
    return q
