"""kvcli's C kernels for the CPU (kernels/cpu_*.c): which build fits this machine, where builds are
cached, and whether they are wanted.

A build follows the ISA torch's kernels use, so ATEN_CPU_CAPABILITY=avx2 measures the AVX2 build on an
AVX-512 machine. KVCLI_NATIVE=0 turns every C kernel off (torch's kernels instead), read when a model
is built.
"""

from __future__ import annotations

import os
import platform


def native_enabled() -> bool:
    return os.environ.get("KVCLI_NATIVE", "1") != "0"


def native_isa() -> str:
    """"avx512vnni", "avx2" or "generic" (kvcli_kernels/cpu_build.py)."""
    from kvcli.bench.machine import cpu_flags, torch_isa

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "generic"
    flags = cpu_flags()
    if not {"avx2", "fma", "f16c"} <= flags:
        return "generic"
    if torch_isa().upper().startswith("AVX512") and {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
        return "avx512vnni"
    return "avx2"


def build_dir() -> str:
    from kvcli.model.tokenizer import cache_dir

    return str(cache_dir() / "native")
