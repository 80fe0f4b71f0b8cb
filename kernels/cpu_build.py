"""Builds kvcli's C kernels for the CPU (cpu_*.c beside this file) at first use, once per machine.

Each source is compiled with the machine's C compiler (about a second) into
`cache_dir/<name>-<isa>-<hash>.so`, one build per source, ISA flags and compiler version; later processes
load the cached build. `build()` returns None, with the reason in `build_error()`, where there is no
compiler or the build fails: callers fall back to torch's kernels.

ISA names (the caller decides from the CPU's flags and the ISA torch dispatches to, so that
ATEN_CPU_CAPABILITY=avx2 measures the AVX2 build on an AVX-512 machine):
  "avx512vnni"  AVX2 + FMA + F16C code, integer dot products by AVX-512-VNNI (dpbusd on 256-bit vectors)
  "avx2"        AVX2 + FMA + F16C
  "generic"     plain C (any architecture; the compiler vectorizes what it can)
The libraries use OpenMP: torch is imported first, so their libgomp.so.1 resolves to the runtime torch
already loaded (same soname) and torch.set_num_threads governs both.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

ISA_FLAGS = {
    "avx512vnni": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "generic": [],
}
_errors: dict[tuple[str, str], str] = {}


def build_error(source: str, isa: str) -> str | None:
    """Why build(source, isa, ...) returned None (None when it did not)."""
    return _errors.get((source, isa))


@functools.lru_cache(maxsize=None)
def _compiler() -> tuple[str, str]:
    """(cc, its --version text), or ("", why not)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return "", "no C compiler (cc) found"
    try:
        return cc, subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return "", f"{cc} does not run: {e}"


def _flags(isa: str) -> list[str]:
    return ["-O3", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off", *ISA_FLAGS[isa]]


def _lib_path(source: Path, isa: str, cache_dir: str) -> Path:
    # The headers beside the sources (cpu_*.h) are part of every build: a change to one rebuilds all.
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("cpu_*.h")))
    key = hashlib.sha256(source.read_bytes() + headers + " ".join(_flags(isa)).encode() + _compiler()[1].encode())
    return Path(cache_dir) / f"{source.stem}-{isa}-{key.hexdigest()[:16]}.so"


@functools.lru_cache(maxsize=None)
def _build_missing(isa: str, cache_dir: str) -> dict[str, str]:
    """Compile every cpu_*.c without a build for this ISA at once (the first model load on a machine waits
    for the slowest, not the sum: ~3 s -> ~1.5 s on 2 cores); returns source name -> error."""
    cc = _compiler()[0]
    jobs = []
    for source in sorted(Path(__file__).parent.glob("cpu_*.c")):
        lib_path = _lib_path(source, isa, cache_dir)
        if lib_path.exists():
            continue
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        # Built under a temporary name and renamed: processes building at once never load half a file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib_path.parent)
        os.close(fd)
        proc = subprocess.Popen([cc, *_flags(isa), str(source), "-o", tmp, "-lm"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        jobs.append((source.name, lib_path, tmp, proc))
    errors = {}
    for name, lib_path, tmp, proc in jobs:
        _, err = proc.communicate()
        if proc.returncode != 0:
            os.unlink(tmp)
            errors[name] = f"{cc} failed: {(err.strip().splitlines() or ['?'])[-1]}"
        else:
            os.replace(tmp, lib_path)
    return errors


def check_structs(lib: ctypes.CDLL, source: str, isa: str, size_fn: str, mirrors: list[type]) -> ctypes.CDLL | None:
    """The library, or None (with the reason in build_error) when a C struct's size differs from its ctypes
    mirror's: a field added on one side only would otherwise pass garbage pointers. `size_fn(i)` returns
    sizeof the i-th struct mirrored by mirrors[i]."""
    fn = getattr(lib, size_fn)
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int64
    for i, mirror in enumerate(mirrors):
        got = fn(i)
        if got != ctypes.sizeof(mirror):
            _errors[(source, isa)] = (f"{source}: struct {i} is {got} bytes in C, {ctypes.sizeof(mirror)} in its "
                                      f"ctypes mirror {mirror.__name__}")
            return None
    return lib


@functools.lru_cache(maxsize=None)
def build(source: str, isa: str, cache_dir: str) -> ctypes.CDLL | None:
    import torch  # noqa: F401  (first: the library's libgomp.so.1 must resolve to torch's)

    cc, version = _compiler()
    if not cc:
        _errors[(source, isa)] = version
        return None
    lib_path = _lib_path(Path(__file__).with_name(source), isa, cache_dir)
    if not lib_path.exists():
        error = _build_missing(isa, cache_dir).get(source)
        if error or not lib_path.exists():
            _errors[(source, isa)] = error or f"{lib_path.name} was not built"
            return None
    try:
        return ctypes.CDLL(str(lib_path))
    except OSError as e:
        _errors[(source, isa)] = f"cannot load {lib_path.name}: {e}"
        return None
