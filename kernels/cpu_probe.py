"""Launcher of cpu_probe.c: the machine's read bandwidth and int8 dot-product peak, measured with the vector
loads and the dot-product instruction kvcli's kernels use (for the roofline benchmark; nothing in the engine
calls it). Built at first use by cpu_build.py; `load` returns None where it cannot be built."""

from __future__ import annotations

import ctypes
import time

import torch

from kvcli_kernels.cpu_build import build

_SOURCE = "cpu_probe.c"


def load(isa: str, cache_dir: str) -> ctypes.CDLL | None:
    lib = build(_SOURCE, isa, cache_dir)
    if lib is not None and not hasattr(lib, "_kvp_declared"):
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.kvp_read.argtypes = [ptr, i64, ctypes.c_int, ptr]
        lib.kvp_read.restype = ctypes.c_uint64
        lib.kvp_int8_peak.argtypes = [i64, ctypes.c_int, ctypes.c_int, ptr]
        lib.kvp_int8_peak.restype = i64
        lib.kvp_read_width.argtypes = []
        lib.kvp_read_width.restype = ctypes.c_int
        lib.kvp_int8_peak_what.argtypes = []
        lib.kvp_int8_peak_what.restype = ctypes.c_char_p
        lib.kvp_fp32_peak.argtypes = [i64, ctypes.c_int, ctypes.c_int, ptr]
        lib.kvp_fp32_peak.restype = ctypes.c_double
        lib.kvp_fp32_peak_what.argtypes = []
        lib.kvp_fp32_peak_what.restype = ctypes.c_char_p
        lib._kvp_declared = True
    return lib


def read_pass(lib: ctypes.CDLL, buf: torch.Tensor, threads: int) -> tuple[float, int, int]:
    """One pass over buf (a contiguous CPU tensor): (seconds, bytes read, checksum of what was read)."""
    done = ctypes.c_int64(0)
    t = time.perf_counter()
    check = lib.kvp_read(buf.data_ptr(), buf.numel() * buf.element_size(), threads, ctypes.byref(done))
    return time.perf_counter() - t, done.value, check


def _peak_pass(fn, iters: int, threads: int, seed: int) -> tuple[float, int, int | float]:
    """One run of a register-only peak loop `fn` (kvp_int8_peak, kvp_fp32_peak): (seconds, multiply-adds done, the
    fold it returns)."""
    done = ctypes.c_int64(0)
    t = time.perf_counter()
    check = fn(iters, threads, seed, ctypes.byref(done))
    return time.perf_counter() - t, done.value, check


def int8_peak_pass(lib: ctypes.CDLL, iters: int, threads: int, seed: int = 0x01010101) -> tuple[float, int, int]:
    """One run of the register-only dot-product loop: (seconds, multiply-adds done, fold of the sums)."""
    return _peak_pass(lib.kvp_int8_peak, iters, threads, seed)


def int8_peak_instruction(lib: ctypes.CDLL) -> str:
    return lib.kvp_int8_peak_what().decode()


def fp32_peak_pass(lib: ctypes.CDLL, iters: int, threads: int, seed: int = 1) -> tuple[float, int, float]:
    """One run of the register-only fp32 FMA loop: (seconds, lane multiply-adds done, fold of the chains)."""
    return _peak_pass(lib.kvp_fp32_peak, iters, threads, seed)


def fp32_peak_instruction(lib: ctypes.CDLL) -> str:
    return lib.kvp_fp32_peak_what().decode()
