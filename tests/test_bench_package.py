"""The benchmark package (issue #26.5): every figure has one entry and one results file, every results file
and every citation of one belongs to a figure, scripts/ holds entry points only, nothing edits sys.path,
the A/B tool reads the numbers it compares, and one entry runs end to end in a tiny mode."""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvcli.bench import ab, harness
from kvcli.bench.figures import FIGURES

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ENTRY_POINTS = {"setup.sh", "figures.sh", "gpu_check.py", "gpu_engine_check.py", "gpu_env.sh", "triton_matrix.sh",
                "build_llama_cpp.sh", "build_llama_server.sh", "build_llama_cpp_python.sh", "build_lm_eval.sh"}
# gpu_check.py runs on a GPU machine from a plain `python3` with only torch and triton (kvcli not installed):
# it finds gpu_engine_check.py and kvcli beside itself through sys.path, on purpose (tests/kernels checks it).
SYS_PATH_EXEMPT = {REPO / "scripts" / "gpu_check.py", REPO / "scripts" / "gpu_engine_check.py"}
CITED = re.compile(r"(?<![0-9a-f]:)docs/results/[A-Za-z0-9._*-]+\.txt")
IN_HISTORY = re.compile(r"\b([0-9a-f]{7,40}):(docs/results/[A-Za-z0-9._-]+\.txt)")


def test_every_figure_has_its_results_file_named_after_it() -> None:
    assert FIGURES
    for name, fig in FIGURES.items():
        assert fig.name == name and fig.results == f"docs/results/{name}.txt"
        assert (REPO / fig.results).is_file(), f"{name}: {fig.results} is missing"


def test_every_results_file_belongs_to_a_figure() -> None:
    owned = {Path(f.results).name for f in FIGURES.values()}
    stray = sorted(p.name for p in RESULTS.iterdir() if p.name not in owned)
    assert not stray, f"docs/results/ files no figure writes (dated variants belong in git history): {stray}"


def test_every_cited_results_file_exists() -> None:
    missing = []
    for doc in DOCS:
        for cited in CITED.findall(doc.read_text(encoding="utf-8")):
            if "*" in cited or not (REPO / cited).is_file():
                missing.append(f"{doc.relative_to(REPO)}: {cited}")
    assert not missing, missing


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs the git checkout")
def test_results_cited_from_git_history_are_there() -> None:
    bad = []
    for doc in DOCS:
        for rev, path in set(IN_HISTORY.findall(doc.read_text(encoding="utf-8"))):
            if subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{rev}:{path}"],
                              capture_output=True).returncode:
                bad.append(f"{doc.relative_to(REPO)}: {rev}:{path}")
    assert not bad, bad


def test_scripts_holds_only_entry_points() -> None:
    present = {p.name for p in (REPO / "scripts").iterdir() if p.name != "__pycache__"}
    assert present <= ENTRY_POINTS, f"benchmarks belong in kvcli/bench: {sorted(present - ENTRY_POINTS)}"


def test_nothing_in_kvcli_or_scripts_edits_sys_path() -> None:
    edit = re.compile(r"sys\.path\s*(\.\s*(insert|append|extend|remove)\s*\(|\[[^\]]*\]\s*=|=(?!=)|\+=)")
    offenders = [str(p.relative_to(REPO)) for p in [*(REPO / "kvcli").rglob("*.py"), *(REPO / "scripts").glob("*.py")]
                 if p not in SYS_PATH_EXEMPT and edit.search(p.read_text(encoding="utf-8"))]
    assert not offenders, offenders


def test_every_entry_resolves() -> None:
    for fig in FIGURES.values():
        if fig.entry.startswith("script:"):
            script = next(w for w in fig.entry.split() if w.startswith("scripts/"))
            assert (REPO / script).is_file(), fig.entry
            continue
        module, func = fig.entry.split(":")
        assert callable(getattr(importlib.import_module(f"kvcli.bench.{module}"), func)), fig.entry


def test_make_figures_calls_the_package() -> None:
    make = (REPO / "Makefile").read_text(encoding="utf-8")
    figures_sh = (REPO / "scripts" / "figures.sh").read_text(encoding="utf-8")
    assert "-m kvcli.bench figures" in figures_sh and "scripts/figures.sh" in make
    assert "scripts/bench_" not in make


def test_list_names_every_figure_and_its_file() -> None:
    out = subprocess.run([sys.executable, "-m", "kvcli.bench", "--list"], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split()[1] for line in out.stdout.splitlines() if line.strip()}
    assert rows == {n: f.results for n, f in FIGURES.items()}


def test_interleaved_rounds_alternate_and_pair_up() -> None:
    calls = []
    rounds = harness.interleaved(["a", "b"], 3, lambda e, r: calls.append((e, r)) or (2.0 if e == "a" else 1.0),
                                 alternate=True, progress=False)
    assert calls == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2)]
    assert rounds.ratios("a", "b") == [2.0, 2.0, 2.0] and rounds.best("b") == 1.0 and rounds.median("a") == 2.0
    t, out = harness.best_warm(lambda: 7, 2)
    assert out == 7 and t >= 0


def test_ab_reads_the_committed_figures() -> None:
    """The A/B tool's parsers find the headline numbers in each figure's current raw output."""
    decode = (RESULTS / "decode.txt").read_text(encoding="utf-8")
    got = {k: p(decode) for k, p in ab.AB["decode"].numbers.items()}
    table = [line for line in decode.splitlines() if line.startswith("| kvcli, INT4 resident")][0]
    cells = [c.strip() for c in table.split("|")[1:-1]]
    assert got["kvcli INT4 decode tok/s"] == float(cells[1])
    assert got["kvcli INT4 vs transformers"] == float(cells[2].rstrip("x"))
    assert all(v is not None for v in got.values()), got
    tp = (RESULTS / "throughput.txt").read_text(encoding="utf-8")
    got = {k: p(tp) for k, p in ab.AB["throughput"].numbers.items()}
    assert all(v is not None and v > 0 for v in got.values()), got
    cpu = (RESULTS / "cpu.txt").read_text(encoding="utf-8")
    assert all(p(cpu) for p in ab.AB["cpu"].numbers.values())
    for name in ab.AB:
        assert name in FIGURES


def test_ab_old_side_imports_the_old_tree(tmp_path: Path) -> None:
    """PYTHONPATH puts the old tree first, with kvcli_kernels linked to its kernels/ (what the A/B child
    checks before its first round)."""
    tree = tmp_path / "old"
    (tree / "kvcli").mkdir(parents=True)
    (tree / "kernels").mkdir()
    (tree / "kvcli" / "__init__.py").write_text("")
    (tree / "kernels" / "cpu_build.py").write_text("")  # kernels/ is a namespace portion (no __init__.py)
    env = ab.old_env(tree)
    files = ab.check_imports("before", env, tmp_path, tree)
    assert Path(files[0]).resolve() == (tree / "kvcli" / "__init__.py").resolve()
    assert Path(files[1]).resolve() == (tree / "kernels" / "cpu_build.py").resolve()
    with pytest.raises(SystemExit):
        ab.check_imports("after", ab.new_env(), REPO, tree)


def test_a_figure_runs_end_to_end_in_a_tiny_mode() -> None:
    """The decode figure, kvcli only, 16 prompt tokens and 10 new (decode tok/s is (N - 1) / (t_N - t_1): with 3
    new tokens and one repeat, a loaded machine once made t_1 exceed t_3): the header, then the table."""
    env = dict(os.environ, NO_COLOR="1")
    out = subprocess.run([sys.executable, "-m", "kvcli.bench", "decode", "--prompt-tokens", "16", "--new-tokens",
                          "10", "--repeats", "2", "--engines", "kvcli"], capture_output=True, text=True, cwd=REPO,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("# decode — ") and lines[1].startswith("machine: ")
    assert lines[3] == "command: python -m kvcli.bench decode --prompt-tokens 16 --new-tokens 10 --repeats 2 --engines kvcli"
    assert ab.AB["decode"].numbers["kvcli INT4 decode tok/s"](out.stdout) > 0


def test_every_internal_a_benchmark_uses_still_resolves() -> None:
    """kvcli/bench/internals.py is the one table of kvcli internals the figures reach into."""
    from kvcli.bench import internals

    missing = []
    for name in internals.WHERE:
        try:
            got = getattr(internals, name)
            assert callable(got) or hasattr(got, "__file__"), got
        except (ImportError, AttributeError) as exc:
            missing.append(f"{name} ({internals.WHERE[name]}): {exc}")
    assert callable(internals.perplexity) and not hasattr(internals.perplexity, "__path__")
    assert not missing, missing
    others = [f"{p.name}: {line.strip()}" for p in (REPO / "kvcli" / "bench").glob("*.py")
              for line in p.read_text(encoding="utf-8").splitlines()
              if re.match(r"\s*from kvcli\.(model|attention|kvcache|runner)\b", line)
              and p.name != "machine.py" and "kvcli.model.loader" not in line]
    assert not others, f"go through kvcli/bench/internals.py: {others}"


def test_caller_arguments_join_the_figures_own_on_each_side_of_the_separator() -> None:
    from kvcli.bench.__main__ import merge_args

    assert merge_args(("--repeats", "2"), ["--repeats", "1"]) == ["--repeats", "2", "--repeats", "1"]
    own = FIGURES["ab-throughput"].args
    got = merge_args(own, ["--rounds", "1", "--", "--num-requests", "4"])
    i = got.index("--")
    assert got[:i][-2:] == ["--rounds", "1"] and got[i + 1:][-2:] == ["--num-requests", "4"]
    assert got.count("--") == 1


def test_the_llama_cpp_worker_imports_llama_cpp_not_its_neighbour():
    """The worker is run by its path, so kvcli/bench/ is first on its sys.path, where a kvcli/bench/llama_cpp.py
    (kvcli's handle on the worker, now llama_cpp_runner.py) stood in for the llama_cpp package: every llama.cpp
    row of the benchmark package failed ("No module named 'kvcli'"). Run in the conformance suite's
    llama-cpp-python venv on the bundled model."""
    import json
    import subprocess

    from conformance.engines import llama_python
    from kvcli.bench.llama_cpp_runner import WORKER
    from kvcli.model.loader import bundled_gguf_path

    py = llama_python()
    if py is None:
        pytest.skip("llama-cpp-python is not built here (scripts/build_llama_cpp_python.sh)")
    job = {"model": str(bundled_gguf_path()), "threads": 1, "contexts": [8], "new_tokens": 2, "repeats": 0,
           "prompt_ids": list(range(1, 9))}
    p = subprocess.run([str(py), str(WORKER)], input=json.dumps(job), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-1500:]
    rows = json.loads(p.stdout.strip().splitlines()[-1])["batch1"]
    assert rows[0]["context"] == 8 and rows[0]["decode_tok_s"] > 0


def test_conformance_margins_table_reads_what_the_suite_recorded() -> None:
    """The conformance-margins figure prints the suite's own measurements: a compared variant's error, bound and
    margin (bound - error), the quantized routes where recorded, a refusal as the outcome."""
    from kvcli.bench.conformance import table

    rows = [{"variant": "q4_0", "weights": "Q4_0", "outcome": "compared", "error": 0.0245, "bound": 0.0308,
             "exact": 0.0298, "invariant": 0.0297, "greedy_same": True},
            {"variant": "plain", "weights": "F32", "outcome": "compared", "error": 2e-6, "bound": 1e-3,
             "greedy_same": False},
            {"variant": "odd", "weights": "F32", "outcome": "refused by kvcli", "why": "unknown key x"}]
    lines = table(rows)
    assert lines[2] == "| q4_0 | Q4_0 | 2.45e-02 | 3.08e-02 | 6.30e-03 | 2.97e-02 | 2.98e-02 | yes |"
    assert lines[3] == "| plain | F32 | 2.00e-06 | 1.00e-03 | 9.98e-04 | — | — | no |"
    assert lines[4].startswith("| odd | F32 | refused by kvcli: unknown key x |")


def test_header_command_reproduces_the_figure() -> None:
    """A figure's header names the command that reproduces it: its name and the caller's arguments; the figure's
    own arguments are named apart (in the command they would be passed twice: `kvcli continue continue ...`)."""
    assert harness.command_line("decode", ["--repeats", "1"]) == "python -m kvcli.bench decode --repeats 1"
    line = harness.command_line("continue", [], FIGURES["continue"].args)
    assert line.startswith("python -m kvcli.bench continue  (the figure's own arguments, first: continue ")
    assert "kvcli.bench continue continue" not in line
