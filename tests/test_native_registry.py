"""kvcli/native: one registry loads each C library once and says why one is not there; the launchers check
their C structs against the ctypes mirrors by size and refuse a library that disagrees."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

from kvcli.native import registry
from kvcli.native.capabilities import build_isa, capabilities


def test_every_library_loads_or_says_why():
    for name in registry.LIBRARIES:
        lib, why = registry.library(name), registry.unavailable(name)
        assert (lib is None) == (why is not None), name
        assert registry.library(name) is lib  # built and loaded once per process
    if registry.library("int8dot") is not None:
        assert registry.status() == f"{build_isa()} build"


def test_every_library_builds_where_a_compiler_runs():
    """Where a C compiler runs, every library builds for every ISA this CPU runs: a source that stops compiling fails
    here, where the kernels' own tests would skip its build as unavailable."""
    from kvcli.native.capabilities import runnable_isas
    from kvcli_kernels.cpu_build import compiler_runs

    if not registry.enabled() or not compiler_runs():
        pytest.skip("no C compiler here, or KVCLI_NATIVE=0: the plain paths run")
    for isa in runnable_isas():
        for name, spec in registry.LIBRARIES.items():
            if not (spec.simd_only and isa == "generic"):
                assert registry.library(name, isa) is not None, f"{name} ({isa}): {registry.unavailable(name, isa)}"


def test_off_and_simd_only_are_reasons(monkeypatch):
    assert registry.unavailable("swiglu", isa="generic") == "SIMD only (this CPU takes the plain C build)"
    assert registry.library("decode_layers", isa="generic") is None
    monkeypatch.setenv("KVCLI_NATIVE", "0")
    assert registry.library("attention") is None and registry.unavailable("attention") == "off (KVCLI_NATIVE=0)"
    assert registry.status() == "off (KVCLI_NATIVE=0)"


def test_capabilities_record_is_this_machine():
    caps = capabilities()
    assert caps.build_isa == build_isa() and caps.isa
    assert caps.build_isa in ("avx512vnni", "avx2", "generic")


@pytest.mark.parametrize("module,fn,mirrors", [
    ("kvcli_kernels.cpu_decode_layers", "kvd_struct_size", ["Part", "Linear", "Layer", "Model"]),
    ("kvcli_kernels.cpu_attention", "kva_struct_size", ["_Step", "_Cache"]),
])
def test_c_structs_match_their_ctypes_mirrors(module, fn, mirrors):
    import importlib

    from kvcli_kernels.cpu_build import build, build_error, check_structs

    mod = importlib.import_module(module)
    lib = build(mod._SOURCE, "generic", registry.build_dir())
    if lib is None:
        pytest.skip(f"no build: {build_error(mod._SOURCE, 'generic')}")
    classes = [getattr(mod, m) for m in mirrors]
    assert check_structs(lib, mod._SOURCE, "generic", fn, classes) is lib
    # A mirror with one field too many is refused, naming the struct.

    class Wider(ctypes.Structure):
        _fields_ = [*classes[-1]._fields_, ("extra", ctypes.c_int64)]

    assert check_structs(lib, mod._SOURCE, "probe", fn, [*classes[:-1], Wider]) is None
    assert f"{ctypes.sizeof(Wider)} in its ctypes mirror Wider" in build_error(mod._SOURCE, "probe")


def test_model_and_attention_do_not_import_bench():
    """What the CPU can do is answered by kvcli.native: building a model imports nothing of kvcli.bench."""
    code = ("import sys; from kvcli.llm import LLM; LLM(max_model_len=256, kv_budget='16MiB'); "
            "print(sorted(m for m in sys.modules if m.startswith('kvcli.bench')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
