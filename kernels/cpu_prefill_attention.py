"""Launcher of cpu_prefill_attention.c: causal attention of a prefill chunk against fp32 K/V gathered
head-major. Built at first use by cpu_build.py; `load` returns None where it cannot be built."""

from __future__ import annotations

import ctypes

import torch

from kvcli_kernels.cpu_build import build

_SOURCE = "cpu_prefill_attention.c"


def load(isa: str, cache_dir: str) -> ctypes.CDLL | None:
    lib = build(_SOURCE, isa, cache_dir)
    if lib is not None and not hasattr(lib, "_kvp_declared"):
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.kvp_prefill.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float, ptr, i64,
                                    ctypes.c_int]
        lib.kvp_prefill.restype = ctypes.c_int
        lib._kvp_declared = True
    return lib


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """q fp32 [T, H, D] with heads contiguous, k / v fp32 [KVH, L, D] with contiguous rows of D (any head
    stride), L >= T, D % 16 == 0."""
    t, h, d = q.shape
    rows = all(x.stride(2) == 1 and x.stride(1) == d for x in (q, k, v))
    return (q.dtype == k.dtype == v.dtype == torch.float32 and rows and k.shape == v.shape and k.shape[2] == d
            and d % 16 == 0 and h % k.shape[0] == 0 and k.shape[1] >= t and q.device.type == "cpu")


def prefill_attention(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      out: torch.Tensor) -> bool:
    """out [T, H, D] (heads contiguous) = causal attention of q (the last T of L positions) over k, v:
    False where this build has no such kernel (the caller computes it another way)."""
    t, h, d = q.shape
    kvh, length, _ = k.shape
    rc = lib.kvp_prefill(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), t, length,
                         h, kvh, d, scale, out.data_ptr(), out.stride(0), torch.get_num_threads())
    if rc == -2:
        return False
    if rc != 0:
        raise MemoryError("prefill attention: no memory for its work buffers")
    return True
