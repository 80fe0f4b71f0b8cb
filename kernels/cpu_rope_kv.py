"""Launcher of cpu_rope_kv.c: rotary embedding of q and k and the store of k, v into the paged cache in
one call per layer. Built at first use by cpu_build.py; `load` returns None where it cannot be built."""

from __future__ import annotations

import ctypes

import torch

from kvcli_kernels import kv_formats
from kvcli_kernels.cpu_build import build

_SOURCE = "cpu_rope_kv.c"
DTYPE_CODES = kv_formats.FLOAT_DTYPE_CODES  # float cache dtype -> DT_* of cpu_rope_kv.c (kv_formats.py)
_ERRORS = {-2: "a position outside the rotary table", -3: "a KV slot outside the cache",
           -4: "an unsupported cache dtype or head size"}


def load(isa: str, cache_dir: str) -> ctypes.CDLL | None:
    lib = build(_SOURCE, isa, cache_dir)
    if lib is not None and not hasattr(lib, "_kvr_declared"):
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.kvr_rope_kv.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr,
                                    ctypes.c_int, i64, i64, i64, i64, i64, i64, i64, i64, ctypes.c_int]
        lib.kvr_rope_kv.restype = ctypes.c_int
        lib._kvr_declared = True
    return lib


def cache_supported(k: torch.Tensor, v: torch.Tensor) -> bool:
    """A cache the kernel writes: fp32 / fp16 / bf16 (no scales), indexed [blocks, block_size, kvh, D] with
    unit-stride head rows, on the CPU."""
    return (k.device.type == "cpu" and k.dim() == 4 and k.dtype in DTYPE_CODES and v.dtype == k.dtype
            and v.shape == k.shape and k.stride(3) == 1 and v.stride(3) == 1)


def rope_kv(lib: ctypes.CDLL, qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor,
            sin_signed: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor) -> torch.Tensor:
    """qkv fp32 [T, (heads + 2 kv_heads) * D] (rows contiguous), tables fp32 [P, D], positions and slots
    int64 [T] contiguous, k / v as cache_supported -> q rotated, fp32 [T, heads, D]; k rotated and v are
    stored in their slots (negative: not stored). ValueError for a position or slot out of range."""
    t = qkv.shape[0]
    d = cos.shape[1]
    q = torch.empty(t, heads, d, dtype=torch.float32)
    blocks, bs = k.shape[0], k.shape[1]
    rc = lib.kvr_rope_kv(qkv.data_ptr(), t, qkv.stride(0), heads, kv_heads, d, cos.data_ptr(), sin_signed.data_ptr(),
                         cos.shape[0], positions.data_ptr(), slots.data_ptr(), q.data_ptr(), k.data_ptr(),
                         v.data_ptr(), DTYPE_CODES[k.dtype], bs, blocks * bs, k.stride(0), k.stride(1), k.stride(2),
                         v.stride(0), v.stride(1), v.stride(2), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"rope_kv: {_ERRORS.get(rc, f'error {rc}')}")
    return q
