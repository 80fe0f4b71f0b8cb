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
def build(source: str, isa: str, cache_dir: str) -> ctypes.CDLL | None:
    import torch  # noqa: F401  (first: the library's libgomp.so.1 must resolve to torch's)

    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        _errors[(source, isa)] = "no C compiler (cc) found"
        return None
    flags = ["-O3", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off", *ISA_FLAGS[isa]]
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        _errors[(source, isa)] = f"{cc} does not run: {e}"
        return None
    path = Path(__file__).with_name(source)
    key = hashlib.sha256(path.read_bytes() + " ".join(flags).encode() + version.encode()).hexdigest()[:16]
    lib_path = Path(cache_dir) / f"{path.stem}-{isa}-{key}.so"
    if not lib_path.exists():
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        # Built under a temporary name and renamed: processes building at once never load half a file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib_path.parent)
        os.close(fd)
        p = subprocess.run([cc, *flags, str(path), "-o", tmp, "-lm"], capture_output=True, text=True)
        if p.returncode != 0:
            os.unlink(tmp)
            _errors[(source, isa)] = f"{cc} failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}"
            return None
        os.replace(tmp, lib_path)
    try:
        return ctypes.CDLL(str(lib_path))
    except OSError as e:
        _errors[(source, isa)] = f"cannot load {lib_path.name}: {e}"
        return None
