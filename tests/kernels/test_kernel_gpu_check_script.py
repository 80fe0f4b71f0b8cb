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


NO_CAPS = ["--section-seconds", "a=900,b=900,c=900,d=900,e=900,g=900,h=900", "--engine-seconds", "300"]  # the interpreter is far slower than a GPU


@pytest.fixture(scope="module")
def smoke_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, str]:
    out = tmp_path_factory.mktemp("smoke") / "report.md"
    # CUDA hidden so the smoke run never touches a GPU even where one exists.
    r = _run("--cpu-smoke", "--out", str(out), *NO_CAPS, env_extra={"CUDA_VISIBLE_DEVICES": ""}, timeout=900)
    return r, out.read_text() if out.exists() else ""


def _table_keys(text: str) -> set[str]:
    """The first two cells of every table row (kernel + case, batch + context, M + N, layout + blocks)."""
    keys = set()
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) >= 3 and not set(cells[0]) <= set("- "):
            timed = "." in cells[1] and cells[1].replace(".", "").isdigit()  # a measured value, not a key
            keys.add(cells[0] if timed else " | ".join(cells[:2]))
    return keys


def test_cpu_smoke_writes_report(smoke_report: tuple[subprocess.CompletedProcess, str]) -> None:
    """Correctness section (tiny, interpreter) and the benchmark code paths at toy sizes, one process each."""
    r, text = smoke_report
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for needle in ("## (a) correctness", "## (b) decode attention", "## (c) INT4 GEMM", "--cpu-smoke",
                   "torch ", "triton ", "command: `python ", "## (d) the engine end to end",
                   "| engine | logits triton vs torch backend", "| engine | greedy tokens paged vs contiguous",
                   "| paged |", "| contiguous |", "== section (a), cap 900 s", "== section (d): done",
                   "## (e) decode attention per KV cache dtype", "== section (e): done",
                   "| cuda graphs | decode step of 3 requests (bucket 4), graph vs eager logits",
                   "| cuda graphs | greedy tokens with vs without graphs", "## (g) decode with and without CUDA graphs",
                   "| 1 | graphs |", "| 1 | eager |", "== section (g): done", "## (c) tile sweeps",
                   "## (h) transformers on the same shapes", "| sequential |", "| static |", "== section (h): done",
                   "four-way breakdown", "The live view during the paged run", "KV fragmentation",
                   "## (b) decode attention by split count"):
        assert needle in text or needle in r.stdout, needle
    assert "FAIL" not in text and "NOT met" not in text and "goals" not in text  # no verdicts on toy sizes
    assert "Partial result" not in text
    import re

    assert re.search(r"\| (flash_attention|efficient_attention|math)[ |]", text)  # the forced SDPA backend is named
    assert r.stdout.rstrip().endswith(text.rstrip().splitlines()[-1])  # the table is printed last


def test_injected_failures_keep_every_other_row(tmp_path: Path,
                                                smoke_report: tuple[subprocess.CompletedProcess, str]) -> None:
    """One failing case in each of (a), (b), (c) and (d): each is a FAIL row with its message, and every
    row of the clean run that belongs to another case is still in the report."""
    out = tmp_path / "report.md"
    cases = ["paged_attention GQA 4, D 32, page 16, splits=8 bfloat16", "decode B=2 ctx=64", "int4 M=16 N=64",
             "engine correctness", "cuda graphs speed", "transformers baselines"]
    r = _run("--cpu-smoke", "--out", str(out), *NO_CAPS, *[a for c in cases for a in ("--inject-failure", c)],
             env_extra={"CUDA_VISIBLE_DEVICES": ""}, timeout=900)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    text = out.read_text()
    assert text.count("injected failure in") == len(cases), text
    for c in cases:
        assert f"injected failure in '{c}" in text, c
    # (g) and (h) are one case each, and (d)'s correctness rows (engine, cuda graphs) one case: all injected.
    clean = smoke_report[1].split("## (g)")[0]
    lost = {k for k in _table_keys(clean) - _table_keys(text) if not k.startswith(("engine |", "cuda graphs |"))}
    assert not lost, f"rows of other cases missing after one case failed: {sorted(lost)}"
    for section in ("(g) decode with and without CUDA graphs", "(h) transformers on the same shapes"):
        part = text.split(f"## {section}")[1].split("\n## ")[0]
        assert "Not completed" in part and "injected failure" in part, section
    assert "| paged |" in text and "| contiguous |" in text  # (d)'s speed part ran after its failed correctness


def test_section_past_its_cap_is_cut_and_the_run_goes_on(tmp_path: Path) -> None:
    """A section killed at its time cap is a note (exit 1); the next section still runs in its own process."""
    out = tmp_path / "report.md"
    r = _run("--cpu-smoke", "--sections", "bc", "--section-seconds", "b=1,c=900", "--out", str(out),
             env_extra={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    text = out.read_text()
    assert "(b) stopped at its 1 s cap" in text and "Partial result" in text
    assert "## (c) INT4 GEMM" in text and "| 16 | 64 | 128 |" in text


def test_dry_run_counts_variants_and_budget() -> None:
    """--dry-run needs no GPU and no interpreter: variants per section, compile time measured, caps."""
    r = _run("--dry-run", "--quick", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    import re

    total = re.search(r"total: (\d+) kernel variants; estimate (\d+) s against caps summing to (\d+) s", r.stdout)
    assert total, r.stdout
    assert int(total.group(1)) > 0 and int(total.group(2)) > 0 and int(total.group(3)) == 495
    for letter in "abcegdh":
        assert f"| ({letter}) |" in r.stdout
    assert "paged_attention_kernel" in r.stdout  # a compile time was measured for it


def test_sections_subset(tmp_path: Path) -> None:
    """--sections picks what runs; the report holds only those tables."""
    out = tmp_path / "report.md"
    r = _run("--cpu-smoke", "--sections", "c", "--out", str(out), env_extra={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = out.read_text()
    assert "## (c) INT4 GEMM" in text
    for absent in ("## (a)", "## (b)", "## (d)"):
        assert absent not in text, absent


def test_kv_dtype_section_smoke(tmp_path: Path) -> None:
    """Section (e) alone under the interpreter: one row per KV dtype (fp16, int8, fp8), each checked
    against the torch reference on dequantized K/V; no verdict line on toy sizes."""
    out = tmp_path / "report.md"
    r = _run("--cpu-smoke", "--sections", "e", "--section-seconds", "e=900", "--out", str(out),
             env_extra={"CUDA_VISIBLE_DEVICES": ""}, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = out.read_text()
    assert "## (e) decode attention per KV cache dtype" in text
    for kv in ("fp16", "int8", "fp8"):
        row = next((line for line in text.splitlines() if line.startswith(f"| 1 | 64 | {kv} |")), None)
        assert row is not None, kv
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        assert cells[-1].startswith("ok") and float(cells[-2]) <= 1.0, row  # checked against the reference
    assert "FAIL" not in text and "KV decode at 8k+" not in text
    for absent in ("## (a)", "## (b)", "## (c)", "## (d)"):
        assert absent not in text, absent


def test_engine_section_crash_is_a_failed_row_not_a_lost_run(tmp_path: Path, monkeypatch) -> None:
    """A crash inside section (d) becomes a FAIL row (exit 1) and a note; the report is still written
    (one section runs in this process, so the monkeypatch reaches it)."""
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
    assert "correctness did not finish" in text and "**FAIL**: RuntimeError: simulated engine failure" in text
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
