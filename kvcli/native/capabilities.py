"""What this CPU can do, answered once per process: its name and flags, the widest vector ISA it reports,
the ISA torch's kernels dispatch to, which build of kvcli's C kernels fits, and whether bf16 dot products
are native.

A build follows the ISA torch's kernels use, so `ATEN_CPU_CAPABILITY=avx2` (with
`ONEDNN_MAX_CPU_ISA=AVX2`) measures the AVX2 build on an AVX-512 machine. `CpuCapabilities` is the plain
record the weight planner (kvcli/model/weight_plan.py) decides from; tests build their own to plan for a
machine they are not on.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

# Flags each build of kvcli_kernels/cpu_build.py needs (its ISA_FLAGS compile for them).
AVX2_FLAGS = frozenset({"avx2", "fma", "f16c"})
AVX512VNNI_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"})


@dataclass(frozen=True)
class CpuCapabilities:
    name: str  # the CPU model, e.g. "AMD EPYC 9R14"
    arch: str  # platform.machine(): x86_64, aarch64, ...
    flags: frozenset[str]
    torch_isa: str  # what torch's kernels dispatch to: "AVX512", "AVX2", "DEFAULT", ...
    build_isa: str  # kvcli's C build that fits: "avx512vnni", "avx2" or "generic"
    native_bf16: bool  # torch's CPU kernels may use bf16 dot-product instructions here
    amx_int8: bool = False  # kvcli's int8 kernel may run its integer sums on AMX tiles (amx_int8_for)
    amx_bf16: bool = False  # many-row quantized matmuls may run kvcli's bf16 GEMM on AMX tiles (amx_bf16_for)

    @property
    def isa(self) -> str:
        """The widest vector ISA the CPU reports (what benchmark headers print)."""
        return vector_isa(self.flags, self.arch)

    @property
    def fp32_gemm_preferred(self) -> bool:
        """Whether many-row quantized matmuls take kvcli's fused fp32 GEMM: the AVX2 build under torch's
        AVX2 kernels, without native bf16. With AVX-512 in torch (native bf16, or fp32 at twice the AVX2
        width) torch's own GEMM after a read-back of the weight is faster (model/int8dot_cpu.py)."""
        return self.build_isa == "avx2" and not self.torch_isa.upper().startswith("AVX512") and not self.native_bf16


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """/proc/cpuinfo's model name and flags, read once per process."""
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


def vector_isa(flags: frozenset[str], arch: str | None = None) -> str:
    """The widest vector ISA in `flags`: AMX, AVX-512-BF16, AVX-512, AVX2, or the architecture."""
    if "amx_tile" in flags:
        return "AMX (AVX-512-BF16)"
    if "avx512_bf16" in flags:
        return "AVX-512-BF16"
    if "avx512f" in flags:
        return "AVX-512"
    if "avx2" in flags:
        return "AVX2"
    return arch or platform.machine()


def cpu_isa() -> str:
    return vector_isa(cpu_flags())


def torch_isa() -> str:
    """The kernel ISA torch dispatches to (honours ATEN_CPU_CAPABILITY)."""
    import torch

    try:
        return torch.backends.cpu.get_cpu_capability()
    except AttributeError:  # older torch
        return "unknown"


def build_isa_for(arch: str, flags: frozenset[str], torch_kernels: str) -> str:
    """Which build of kvcli's C kernels fits: AVX-512-VNNI only where torch runs its AVX-512 kernels too."""
    if arch.lower() not in ("x86_64", "amd64") or not AVX2_FLAGS <= flags:
        return "generic"
    if torch_kernels.upper().startswith("AVX512") and AVX512VNNI_FLAGS <= flags:
        return "avx512vnni"
    return "avx2"


def native_bf16_for(flags: frozenset[str], torch_kernels: str, onednn_max_isa: str = "") -> bool:
    """True when torch's CPU kernels may use bf16 dot-product instructions: the CPU has them and neither
    ATEN_CPU_CAPABILITY (torch_kernels) nor ONEDNN_MAX_CPU_ISA holds torch below AVX-512."""
    if not ({"avx512_bf16", "amx_bf16"} & flags):
        return False
    onednn = onednn_max_isa.upper()
    if onednn and "512" not in onednn and "AMX" not in onednn and onednn != "ALL":
        return False
    return torch_kernels.upper().startswith("AVX512")


def amx_int8_for(flags: frozenset[str], build: str, switch: str = "") -> bool:
    """True when kvcli's int8 kernel may compute its integer sums on AMX tiles: the CPU has AMX-INT8, the
    AVX-512-VNNI build runs (its epilogue is AVX-512), and KVCLI_AMX (`switch`) is not "0". Linux must still
    grant the tile state at load (kvcli/model/int8dot_cpu.py asks)."""
    return _amx_for("amx_int8", flags, build, switch)


def amx_bf16_for(flags: frozenset[str], build: str, switch: str = "") -> bool:
    """True when calls with many rows may take kvcli's bf16 GEMM on AMX tiles (kvq_gemm_bf16): the CPU has
    AMX-BF16, the AVX-512-VNNI build runs, and KVCLI_AMX (`switch`) is not "0"."""
    return _amx_for("amx_bf16", flags, build, switch)


def _amx_for(feature: str, flags: frozenset[str], build: str, switch: str) -> bool:
    return {"amx_tile", feature} <= flags and build == "avx512vnni" and switch != "0"


def build_isa() -> str:
    """"avx512vnni", "avx2" or "generic" for this process (kvcli_kernels/cpu_build.py)."""
    return build_isa_for(platform.machine(), cpu_flags(), torch_isa())


def native_bf16() -> bool:
    return native_bf16_for(cpu_flags(), torch_isa(), os.environ.get("ONEDNN_MAX_CPU_ISA", ""))


def capabilities() -> CpuCapabilities:
    """This process's CPU as one record (cheap: /proc/cpuinfo is read once)."""
    name, flags = _cpuinfo()
    kernels = torch_isa()
    build = build_isa_for(platform.machine(), flags, kernels)
    return CpuCapabilities(name=name, arch=platform.machine(), flags=flags, torch_isa=kernels, build_isa=build,
                           native_bf16=native_bf16_for(flags, kernels, os.environ.get("ONEDNN_MAX_CPU_ISA", "")),
                           amx_int8=amx_int8_for(flags, build, os.environ.get("KVCLI_AMX", "")),
                           amx_bf16=amx_bf16_for(flags, build, os.environ.get("KVCLI_AMX", "")))


def runnable_isas(flags: frozenset[str] | None = None) -> list[str]:
    """The builds of kvcli's C kernels this CPU can run (plain C always), narrowest first."""
    flags = cpu_flags() if flags is None else flags
    isas = ["generic"]
    if AVX2_FLAGS <= flags:
        isas.append("avx2")
    if AVX512VNNI_FLAGS <= flags:
        isas.append("avx512vnni")
    return isas
