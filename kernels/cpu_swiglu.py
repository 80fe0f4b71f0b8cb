"""Launcher of cpu_swiglu.c: silu(gate) * up over [gate | up] rows in one pass (torch: chunk, silu, mul_).
Built at first use by cpu_build.py; `load` returns None where it cannot be built."""

from __future__ import annotations

import ctypes

import torch

from kvcli_kernels.cpu_build import build

_SOURCE = "cpu_swiglu.c"


def load(isa: str, cache_dir: str) -> ctypes.CDLL | None:
    lib = build(_SOURCE, isa, cache_dir)
    if lib is not None and not hasattr(lib, "_kvs_declared"):
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.kvs_swiglu.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_int]
        lib.kvs_swiglu.restype = ctypes.c_int
        lib._kvs_declared = True
    return lib


def swiglu(lib: ctypes.CDLL, gu: torch.Tensor) -> torch.Tensor | None:
    """gu fp32 [M, 2F] with unit-stride rows -> silu(gu[:, :F]) * gu[:, F:], a new [M, F] tensor; None where
    this build has no such kernel (plain C)."""
    m, f2 = gu.shape
    out = torch.empty(m, f2 // 2, dtype=torch.float32)
    if lib.kvs_swiglu(gu.data_ptr(), m, f2 // 2, gu.stride(0), out.data_ptr(), torch.get_num_threads()) != 0:
        return None
    return out
