"""kvcli's C kernel libraries (kernels/cpu_*.c), each built and loaded once per process and ISA, with the
reason when one is not available.

    library("attention")          the loaded ctypes.CDLL, or None
    unavailable("attention")      why it is None ("off (KVCLI_NATIVE=0)", "no C compiler (cc) found", ...)
    status()                      one line for `kvcli inspect` and benchmark headers

`KVCLI_NATIVE=0` turns every C kernel off (torch's kernels instead); it is read when a model is built, so a
test or a command can set it before building. Libraries that are SIMD code only (the prefill attention,
SwiGLU and the one-call decode loop) are not offered on the plain C build. Builds are cached on disk by
kvcli_kernels/cpu_build.py (one per source, ISA flags, variant and compiler version), so only a machine's first
load compiles.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import os
from dataclasses import dataclass

from kvcli.native.capabilities import build_isa


@dataclass(frozen=True)
class NativeLibrary:
    module: str  # its ctypes launcher in kvcli_kernels (load(isa, cache_dir), _SOURCE)
    simd_only: bool = False  # not offered on the plain C ("generic") build
    what: str = ""


LIBRARIES = {
    "int8dot": NativeLibrary("kvcli_kernels.cpu_int8dot", what="quantized linears (int8 x 4/5/6/8-bit codes)"),
    "attention": NativeLibrary("kvcli_kernels.cpu_attention", what="paged decode attention"),
    "prefill_attention": NativeLibrary("kvcli_kernels.cpu_prefill_attention", simd_only=True,
                                       what="prefill-chunk attention"),
    "rope_kv": NativeLibrary("kvcli_kernels.cpu_rope_kv", what="rotary + KV store"),
    "rmsnorm": NativeLibrary("kvcli_kernels.cpu_rmsnorm", what="RMSNorm"),
    "swiglu": NativeLibrary("kvcli_kernels.cpu_swiglu", simd_only=True, what="SwiGLU"),
    "decode_layers": NativeLibrary("kvcli_kernels.cpu_decode_layers", simd_only=True,
                                   what="every layer of a decode step in one call"),
    "probe": NativeLibrary("kvcli_kernels.cpu_probe", simd_only=True,
                           what="read bandwidth and int8 peak (benchmarks only)"),
}


def enabled() -> bool:
    return os.environ.get("KVCLI_NATIVE", "1") != "0"


def build_dir() -> str:
    from kvcli.paths import cache_dir

    return str(cache_dir() / "native")


def library(name: str, isa: str | None = None) -> ctypes.CDLL | None:
    """The loaded library `name` (a key of LIBRARIES) for `isa` (default: this machine's build), or None
    (see unavailable)."""
    if not enabled():
        return None
    isa = isa or build_isa()
    if LIBRARIES[name].simd_only and isa == "generic":
        return None
    return _load(name, isa, build_dir())


@functools.lru_cache(maxsize=None)
def _load(name: str, isa: str, cache_dir: str) -> ctypes.CDLL | None:
    return importlib.import_module(LIBRARIES[name].module).load(isa, cache_dir)


def unavailable(name: str, isa: str | None = None) -> str | None:
    """Why library(name, isa) is None, in a few words; None when it loads."""
    if not enabled():
        return "off (KVCLI_NATIVE=0)"
    isa = isa or build_isa()
    spec = LIBRARIES[name]
    if spec.simd_only and isa == "generic":
        return "SIMD only (this CPU takes the plain C build)"
    if library(name, isa) is not None:
        return None
    from kvcli_kernels.cpu_build import build_error

    source = importlib.import_module(spec.module)._SOURCE
    return build_error(source, isa) or "not built"


def status() -> str:
    """One line: which build runs, or why none does (the quantized linears' library stands for all)."""
    why = unavailable("int8dot")
    if why is None:
        return f"{build_isa()} build"
    return why if why.startswith("off") else f"unavailable: {why}"
