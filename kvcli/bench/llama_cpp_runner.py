"""kvcli's handle on the benchmarks' llama.cpp (scripts/build_llama_cpp.sh): find its venv for the ISA
under test (native: the conformance suite's build outside the clone, without AMX on CPUs whose AMX path crashes;
avx2: .cache/bench/llama-avx2) and run kvcli/bench/llama_cpp_worker.py there with a JSON job (the worker never imports kvcli;
it is run by its file path, so the venv needs only llama-cpp-python and numpy)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from kvcli.bench.harness import REPO

WORKER = Path(__file__).resolve().parent / "llama_cpp_worker.py"


def bench_isa() -> str:
    """native, or avx2 when torch is being held to AVX2 (ATEN_CPU_CAPABILITY=avx2)."""
    return "avx2" if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2" else "native"


def python_for(isa: str) -> Path | None:
    if isa == "native":
        where = subprocess.run(["bash", str(REPO / "scripts" / "build_llama_cpp_python.sh"), "--where"],
                               capture_output=True, text=True)
        py = Path(where.stdout.strip())
    else:
        py = REPO / ".cache" / "bench" / f"llama-{isa}" / "bin" / "python"
    if not py.exists():
        return None
    ok = subprocess.run([str(py), "-c", "import llama_cpp"], capture_output=True).returncode == 0
    return py if ok else None


def not_built_note(isa: str) -> str:
    return f"llama.cpp not built for {isa}: run `bash scripts/build_llama_cpp.sh {isa}` (or `make bench-deps`)"


def run(job: dict, isa: str | None = None, timeout: float = 3600) -> tuple[dict | None, str]:
    """(result, note): result None with a one-line reason when llama.cpp is not built or fails."""
    isa = isa or bench_isa()
    py = python_for(isa)
    if py is None:
        return None, not_built_note(isa)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    p = subprocess.run([str(py), str(WORKER)], input=json.dumps(job), capture_output=True, text=True, env=env,
                       timeout=timeout)
    if p.returncode < 0:  # killed by a signal: its last log line says nothing about why
        why = signal.Signals(-p.returncode).name if -p.returncode in signal.valid_signals() else str(p.returncode)
        return None, (f"llama.cpp worker died ({why}) with the build at {py.parent.parent}"
                      + ("; it has llama.cpp's AMX path, which crashes on quantized models on CPUs with AMX: "
                         "rebuild with `bash scripts/build_llama_cpp.sh native`" if "AMX_INT8 = 1" in p.stderr else ""))
    if p.returncode != 0:
        return None, f"llama.cpp worker failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}"
    return json.loads(p.stdout.strip().splitlines()[-1]), ""
