"""What machine a figure came from: CPU model, its vector ISA, and the ISA torch's kernels use.

Figures differ about 5x between AVX2-only and AVX-512-BF16 machines (torch's int4 CPU kernel takes
bf16 activations, emulated without AVX-512-BF16), so every benchmark prints this line.
`ATEN_CPU_CAPABILITY=avx2` (with `ONEDNN_MAX_CPU_ISA=AVX2`) makes torch use its AVX2 kernels on an
AVX-512 machine; the line then shows both what the CPU has and what torch runs.
"""

from __future__ import annotations

import functools
import os
import platform


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """Read once per process: every int4 linear asks (model/int4_cpu.py, vocab_head.py) at load."""
    name, flags = "", frozenset()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not name:
                    name = value.strip()
                elif key == "flags" and not flags:
                    flags = frozenset(value.split())
    except OSError:
        pass
    return name or platform.processor() or platform.machine(), flags


def cpu_flags() -> frozenset[str]:
    return _cpuinfo()[1]


def cpu_name() -> str:
    return _cpuinfo()[0]


def cpu_isa() -> str:
    """The widest vector ISA the CPU reports: AMX, AVX-512-BF16, AVX-512, AVX2, or the architecture."""
    flags = _cpuinfo()[1]
    if "amx_tile" in flags:
        return "AMX (AVX-512-BF16)"
    if "avx512_bf16" in flags:
        return "AVX-512-BF16"
    if "avx512f" in flags:
        return "AVX-512"
    if "avx2" in flags:
        return "AVX2"
    return platform.machine()


def torch_isa() -> str:
    """The kernel ISA torch dispatches to (honours ATEN_CPU_CAPABILITY)."""
    import torch

    try:
        return torch.backends.cpu.get_cpu_capability()
    except AttributeError:  # older torch
        return "unknown"


def machine_line() -> str:
    import torch

    from kvcli.model.int8dot_cpu import native_status

    env = ", ".join(f"{k}={os.environ[k]}" for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "KVCLI_NATIVE")
                    if k in os.environ)
    return (f"machine: {cpu_name()}, {platform.machine()}, {os.cpu_count()} cores; CPU ISA {cpu_isa()}; "
            f"torch {torch.__version__} kernels {torch_isa()}, {torch.get_num_threads()} threads; "
            f"kvcli C kernels {native_status()}" + (f"; {env}" if env else ""))
