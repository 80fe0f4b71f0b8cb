"""Which matmul path the engine's CPU mode takes here, for tests that name it."""

from __future__ import annotations


def cpu_mode(torch_path: str) -> str:
    """kvcli's own kernel (int8dot-cpu) where it builds and is not turned off (KVCLI_NATIVE=0); otherwise
    `torch_path`, the torch kernel the linear would take (int4-cpu or int4x2-cpu)."""
    from kvcli.native import registry

    return "int8dot-cpu" if registry.library("int8dot") is not None else torch_path


def runnable_isas() -> list[str]:
    """The builds of kvcli's C kernels this machine can run (kvcli_kernels/cpu_build.py): plain C always."""
    from kvcli.native.capabilities import runnable_isas as isas

    return isas()


def built(load, isa: str):
    """A kernel library from its launcher's load(isa, cache_dir), or the test skipped (no build for isa here)."""
    import pytest

    from kvcli.native import registry

    lib = load(isa, registry.build_dir())
    if lib is None:
        pytest.skip(f"no {isa} build here")
    return lib
