"""Launcher of cpu_rmsnorm.c: RMSNorm of fp32 rows in one pass (torch's CPU rms_norm is several small
ops). Built at first use by cpu_build.py; `load` returns None where it cannot be built."""

from __future__ import annotations

import ctypes

import torch

from kvcli_kernels.cpu_build import build

_SOURCE = "cpu_rmsnorm.c"


def load(isa: str, cache_dir: str) -> ctypes.CDLL | None:
    lib = build(_SOURCE, isa, cache_dir)
    if lib is not None and not hasattr(lib, "_kvq_declared"):
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.kvq_rmsnorm.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_float, ctypes.c_int]
        lib.kvq_rmsnorm.restype = None
        lib._kvq_declared = True
    return lib


def rmsnorm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x fp32 [..., K] contiguous, weight fp32 [K] -> a new tensor."""
    out = torch.empty_like(x)
    k = x.shape[-1]
    lib.kvq_rmsnorm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // k, k, eps, torch.get_num_threads())
    return out
