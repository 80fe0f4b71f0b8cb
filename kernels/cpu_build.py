"""Builds kvcli's C kernels for the CPU (cpu_*.c beside this file) at first use, once per machine.

Each source is compiled with the machine's C compiler into `cache_dir/<name>-<isa>-<hash>.so`, one build
per source, ISA flags, -D variant and compiler version; later processes load the cached build. A machine's
first load compiles every source's plain build, as many at once as there are cores, largest first (about 3 s
on 2 cores); a variant (cpu_attention.c's loop for a KV dtype other than fp16) when first asked for.
`build()` returns None, with the reason in `build_error()`, where there is no compiler or the build fails:
callers fall back to torch's kernels.

ISA names (the caller decides from the CPU's flags and the ISA torch dispatches to, so that
ATEN_CPU_CAPABILITY=avx2 measures the AVX2 build on an AVX-512 machine):
  "avx512vnni"  AVX2 + FMA + F16C code, integer dot products by AVX-512-VNNI (dpbusd on 256-bit vectors)
  "avx2"        AVX2 + FMA + F16C
  "generic"     plain C (any architecture; the compiler vectorizes what it can)
AMX code (cpu_int8dot.c's tile loops) is compiled into the AVX-512-VNNI build only where the CPU reports
AMX tiles (`-DKVCLI_AMX`): it runs nowhere else, and it was half of that file's compile time. Whether it
runs is decided at load (kvcli/native/capabilities.py, Linux's permission request).
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
import time
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


def compiler_line() -> str:
    """The compiler's first --version line (benchmark headers), or why there is none."""
    cc, version = _compiler()
    return (version.splitlines() or [cc])[0] if cc else version


def compiler_runs() -> bool:
    """Whether a C compiler runs here (else every library is unavailable, and the plain paths run)."""
    return bool(_compiler()[0])


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


@functools.lru_cache(maxsize=1)
def _cpu_has_amx() -> bool:
    """Whether /proc/cpuinfo reports AMX tiles (False where it cannot be read: no AMX code is built)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return any(line.startswith("flags") and "amx_tile" in line.split() for line in f)
    except OSError:
        return False


def compile_flags(isa: str, defines: tuple[str, ...] = ()) -> list[str]:
    """The compiler's flags for a build of `isa` (and a variant's -D flags)."""
    amx = ["-DKVCLI_AMX"] if isa == "avx512vnni" and _cpu_has_amx() else []
    return ["-O3", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off", *ISA_FLAGS[isa], *amx, *defines]


def _lib_path(source: Path, isa: str, cache_dir: str, defines: tuple[str, ...] = ()) -> Path:
    # The headers beside the sources (cpu_*.h) are part of every build: a change to one rebuilds all.
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("cpu_*.h")))
    key = hashlib.sha256(source.read_bytes() + headers + " ".join(compile_flags(isa, defines)).encode() +
                         _compiler()[1].encode())
    return Path(cache_dir) / f"{source.stem}-{isa}-{key.hexdigest()[:16]}.so"


def _start(source: Path, isa: str, cache_dir: str, defines: tuple[str, ...] = ()) -> tuple | None:
    """Starts the compiler on `source` unless its build exists: (name, lib path, temporary path, process,
    its stderr file)."""
    lib_path = _lib_path(source, isa, cache_dir, defines)
    if lib_path.exists():
        return None
    lib_path.parent.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: processes building at once never load half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib_path.parent)
    os.close(fd)
    err = tempfile.TemporaryFile(mode="w+")  # (a file, not a pipe: nothing blocks while others are waited for)
    proc = subprocess.Popen([_compiler()[0], *compile_flags(isa, defines), str(source), "-o", tmp, "-lm"],
                            stdout=subprocess.DEVNULL, stderr=err, text=True)
    return source.name, lib_path, tmp, proc, err


def _finish(job: tuple) -> str | None:
    """Waits for a compiler _start began; its error, or None."""
    name, lib_path, tmp, proc, err = job
    proc.wait()
    with err:
        err.seek(0)
        lines = err.read().strip().splitlines()
    if proc.returncode != 0:
        os.unlink(tmp)
        return f"{_compiler()[0]} failed: {(lines or ['?'])[-1]}"
    os.replace(tmp, lib_path)
    return None


def compile_sources(sources: list[Path], isa: str, cache_dir: str, defines: tuple[str, ...] = ()) -> dict[str, str]:
    """Builds the sources without a build, as many at once as this process has cores, the largest file first
    (the longest compile: cpu_int8dot.c's takes as long as most others together, so it starts at once on a core
    of its own while the rest share the other; all at once, each took a share of every core until the last).
    Returns source name -> error."""
    if not _compiler()[0]:
        return {source.name: _compiler()[1] for source in sources}
    pending = sorted(sources, key=lambda p: p.stat().st_size, reverse=True)
    slots = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    running: list[tuple] = []
    errors = {}
    while pending or running:
        while pending and len(running) < slots:
            job = _start(pending.pop(0), isa, cache_dir, defines)
            if job is not None:
                running.append(job)
        done = [job for job in running if job[3].poll() is not None]
        if not done:
            time.sleep(0.005)
        for job in done:
            running.remove(job)
            error = _finish(job)
            if error:
                errors[job[0]] = error
    return errors


def sources() -> list[Path]:
    """Every kernel source (cpu_*.c beside this file)."""
    return sorted(Path(__file__).parent.glob("cpu_*.c"))


@functools.lru_cache(maxsize=None)
def _build_missing(isa: str, cache_dir: str) -> dict[str, str]:
    """Compiles every cpu_*.c without a build for this ISA (a machine's first model load); returns source name
    -> error."""
    return compile_sources(sources(), isa, cache_dir)


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
def build(source: str, isa: str, cache_dir: str, defines: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The library built from `source` for `isa`, or None (the reason in build_error). `defines` (-D flags)
    make a variant of it, its own build, compiled when first asked for (the plain build of every source
    compiles at once, at the first ask on a machine)."""
    import torch  # noqa: F401  (first: the library's libgomp.so.1 must resolve to torch's)

    cc, version = _compiler()
    if not cc:
        _errors[(source, isa)] = version
        return None
    path = Path(__file__).with_name(source)
    lib_path = _lib_path(path, isa, cache_dir, defines)
    if not lib_path.exists():
        if defines:
            error = compile_sources([path], isa, cache_dir, defines).get(source)
        else:
            error = _build_missing(isa, cache_dir).get(source)
        if error or not lib_path.exists():
            _errors[(source, isa)] = error or f"{lib_path.name} was not built"
            return None
    try:
        return ctypes.CDLL(str(lib_path))
    except OSError as e:
        _errors[(source, isa)] = f"cannot load {lib_path.name}: {e}"
        return None
