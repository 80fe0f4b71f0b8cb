"""scripts/gpu_check.py runs from the repo root: --help, the no-GPU exit, and a --cpu-smoke pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not importable; the Triton kernels cannot be tested")

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.py"


def _run(*args: str, env_extra: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_help() -> None:
    r = _run("--help")
    assert r.returncode == 0 and "--cpu-smoke" in r.stdout and "--quick" in r.stdout and "--out" in r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit path taken without a CUDA device")
def test_exits_nonzero_without_cuda() -> None:
    r = _run()
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0]


def test_cpu_smoke_writes_report(tmp_path: Path) -> None:
    """Correctness section (tiny, interpreter) and the benchmark code paths at toy sizes."""
    out = tmp_path / "report.md"
    # CUDA hidden so the smoke run never touches a GPU even where one exists.
    r = _run("--cpu-smoke", "--out", str(out), env_extra={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = out.read_text()
    for needle in ("## (a) correctness", "## (b) decode attention", "## (c) INT4 GEMM", "--cpu-smoke",
                   "torch ", "triton ", "command: `python ", "## (d) the engine end to end",
                   "| engine | logits triton vs torch backend", "| engine | greedy tokens paged vs contiguous",
                   "kvcli / transformers decode:", "| paged |", "| contiguous |"):
        assert needle in text, needle
    assert "FAIL" not in text and "NOT met" not in text and "goals" not in text  # no verdicts on toy sizes
    assert r.stdout.rstrip().endswith(text.rstrip().splitlines()[-1])  # the table is printed last


def test_sections_subset(tmp_path: Path) -> None:
    """--sections picks what runs; the report holds only those tables."""
    out = tmp_path / "report.md"
    r = _run("--cpu-smoke", "--sections", "c", "--out", str(out), env_extra={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = out.read_text()
    assert "## (c) INT4 GEMM" in text
    for absent in ("## (a)", "## (b)", "## (d)"):
        assert absent not in text, absent


def test_engine_section_crash_is_a_failed_row_not_a_lost_run(tmp_path: Path, monkeypatch) -> None:
    """A crash inside section (d) becomes a FAIL row (exit 1) and a note; the report is still written."""
    sys.path.insert(0, str(REPO / "scripts"))
    import gpu_check
    import gpu_engine_check

    def boom(*_args, **_kwargs):
        raise RuntimeError("simulated engine failure")

    monkeypatch.setattr(gpu_engine_check, "check_engine_correctness", boom)
    monkeypatch.setattr(gpu_engine_check, "bench_engine", boom)
    out = tmp_path / "report.md"
    rc = gpu_check.main(["--cpu-smoke", "--sections", "d", "--out", str(out)])
    assert rc == 1
    text = out.read_text()
    assert "correctness did not run: RuntimeError: simulated engine failure" in text and "**FAIL**" in text
    assert "Not completed: RuntimeError: simulated engine failure" in text


def test_engine_section_skips_without_kvcli_dependencies(tmp_path: Path, monkeypatch) -> None:
    """With only torch and triton installed the script still passes: section (d) says it was skipped."""
    sys.path.insert(0, str(REPO / "scripts"))
    import gpu_check
    import gpu_engine_check

    monkeypatch.setattr(gpu_engine_check, "kvcli_missing", lambda: "rich")
    out = tmp_path / "report.md"
    assert gpu_check.main(["--cpu-smoke", "--sections", "d", "--out", str(out)]) == 0
    assert "Skipped: kvcli needs the module `rich`" in out.read_text()
