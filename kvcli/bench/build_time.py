"""How long kvcli's C kernels take to compile, the part of a machine's first load that later loads skip:
each source's plain build alone (one compiler, one core: what each costs), then every source's build into
an empty folder the way a first load does it (kvcli_kernels/cpu_build.py: as many at once as there are
cores, the largest file first), then each variant built on first need (the decode attention's loop per KV
dtype but fp16). Every build goes to a fresh temporary folder; this machine's own kernel cache is not
touched."""

from __future__ import annotations

import argparse
import tempfile
import time


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=2, help="builds of everything; the best round is printed")
    a = ap.parse_args(argv)

    import torch  # noqa: F401  (cpu_build loads libraries after torch; imported here for the same process)
    from kvcli_kernels import cpu_attention, cpu_build
    from kvcli.bench.internals import kv_dtype
    from kvcli.native.capabilities import build_isa

    isa = build_isa()
    sources = cpu_build.sources()
    attention = next(s for s in sources if s.name == "cpu_attention.c")
    print(f"kvcli C kernels, {isa} build: {' '.join(cpu_build.compile_flags(isa))}; compiler: "
          f"{cpu_build.compiler_line()}")
    alone: dict[str, list[float]] = {s.name: [] for s in sources}
    batch, variants = [], {d.name: [] for d in kv_dtype.KV_DTYPES.values() if d.name != "fp16"}
    for _ in range(a.rounds):
        for s in sources:
            with tempfile.TemporaryDirectory() as d:
                t = time.perf_counter()
                errors = cpu_build.compile_sources([s], isa, d)
                alone[s.name].append(time.perf_counter() - t)
                if errors:
                    raise SystemExit(f"{s.name}: {errors[s.name]}")
        with tempfile.TemporaryDirectory() as d:
            t = time.perf_counter()
            errors = cpu_build.compile_sources(sources, isa, d)
            batch.append(time.perf_counter() - t)
            if errors:
                raise SystemExit(f"first-load build: {errors}")
        for d in kv_dtype.KV_DTYPES.values():
            if d.name == "fp16":
                continue
            with tempfile.TemporaryDirectory() as tmp:
                t = time.perf_counter()
                errors = cpu_build.compile_sources([attention], isa, tmp, cpu_attention.loop_defines(d.kernel_code))
                variants[d.name].append(time.perf_counter() - t)
                if errors:
                    raise SystemExit(f"cpu_attention.c for {d.name}: {errors}")
    print(f"\nbest of {a.rounds} rounds, seconds of wall time\n")
    print("| build | seconds |\n|---|---:|")
    for name, times in sorted(alone.items(), key=lambda kv: -min(kv[1])):
        print(f"| {name} alone (one compiler) | {min(times):.2f} |")
    print(f"| sum of the sources alone | {sum(min(t) for t in alone.values()):.2f} |")
    print(f"| every source, as a first load builds them (cpu_build.build's first call) | {min(batch):.2f} |")
    for name, times in variants.items():
        print(f"| cpu_attention.c's loop for {name} KV, built on first need | {min(times):.2f} |")
