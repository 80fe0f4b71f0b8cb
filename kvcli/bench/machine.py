"""What machine a figure came from: CPU model, its vector ISA, the ISA torch's kernels use and which build of
kvcli's C kernels ran (kvcli/native answers each; this module only prints the line every benchmark starts
with).

Figures differ about 5x between AVX2-only and AVX-512-BF16 machines (torch's int4 CPU kernel takes
bf16 activations, emulated without AVX-512-BF16), so every benchmark prints this line.
`ATEN_CPU_CAPABILITY=avx2` (with `ONEDNN_MAX_CPU_ISA=AVX2`) makes torch use its AVX2 kernels on an
AVX-512 machine; the line then shows both what the CPU has and what torch runs.
"""

from __future__ import annotations

import os
import platform

from kvcli.native import registry
from kvcli.native.capabilities import cpu_flags, cpu_isa, cpu_name, torch_isa

__all__ = ["cpu_flags", "cpu_isa", "cpu_name", "machine_line", "torch_isa"]


def machine_line() -> str:
    import torch

    named = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "KVCLI_NATIVE", "KVCLI_AMX")
    env = ", ".join(f"{k}={os.environ[k]}" for k in named if k in os.environ)
    return (f"machine: {cpu_name()}, {platform.machine()}, {os.cpu_count()} cores; CPU ISA {cpu_isa()}; "
            f"torch {torch.__version__} kernels {torch_isa()}, {torch.get_num_threads()} threads; "
            f"kvcli C kernels {registry.status()}" + (f"; {env}" if env else ""))
