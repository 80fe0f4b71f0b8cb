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
        for fn in (lib.kvs_swiglu, lib.kvs_geglu):
            fn.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_int]
            fn.restype = ctypes.c_int
        lib._kvs_declared = True
    return lib


def swiglu(lib: ctypes.CDLL, gu: torch.Tensor, act: str = "silu") -> torch.Tensor | None:
    """gu fp32 [M, 2F] with unit-stride rows -> act(gu[:, :F]) * gu[:, F:], a new [M, F] tensor (act: "silu",
    or "gelu_tanh" for GeGLU); None where this build has no such kernel (plain C)."""
    m, f2 = gu.shape
    out = torch.empty(m, f2 // 2, dtype=torch.float32)
    fn = lib.kvs_swiglu if act == "silu" else lib.kvs_geglu
    if fn(gu.data_ptr(), m, f2 // 2, gu.stride(0), out.data_ptr(), torch.get_num_threads()) != 0:
        return None
    return out
