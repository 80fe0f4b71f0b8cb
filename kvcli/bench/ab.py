"""Before and after: one figure at git revision REV and in this tree, round by round (interleaved).

  python -m kvcli.bench ab --before REV FIGURE [--rounds N] [-- ARGS ...]

REV is checked out once as a git worktree under .cache/ab/<rev> (.cache/ is ignored). Each round runs the
figure's measurement twice, in a fresh process each: once in the old tree, once in this one, the order
swapped every other round (so neither side always runs first); a slow phase of a shared machine then
falls on both sides alike. `--after REV2` compares with REV2's worktree instead of this tree. ARGS (after `--`)
go to both sides, e.g. `-- --repeats 1` for a short run.

The old side runs REV's own code: the worktree is put first on PYTHONPATH, with a temporary folder holding
`kvcli_kernels -> <worktree>/kernels` (kvcli_kernels is the installed name of kernels/), so REV's kvcli and
REV's kernels are imported, not the editable install of this tree; both sides print where their kvcli and
kvcli_kernels come from before the first round, and a side that imports the wrong tree stops the run.
REV's measurement is its scripts/ benchmark for revisions before the benchmark package (scripts/bench_decode.py,
...), else `python -m kvcli.bench FIGURE` there. Each side's output is parsed for the figure's common numbers.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvcli.bench.figures import FIGURES
from kvcli.bench.harness import REPO, load_average, median


def _row(label: str, col: int) -> Callable[[str], float | None]:
    """The number in column `col` (1 = the first after the label) of the markdown row starting with label."""
    pat = re.compile(r"^\|\s*" + re.escape(label) + r"[^|]*\|(.*)$", re.M)

    def parse(text: str) -> float | None:
        m = pat.search(text)
        if not m:
            return None
        cells = [c.strip() for c in m.group(1).split("|")]
        try:
            return float(cells[col - 1].rstrip("x"))
        except (IndexError, ValueError):
            return None
    return parse


def _cpu_row(context: int, engine: str, col: int) -> Callable[[str], float | None]:
    pat = re.compile(r"^\|\s*" + str(context) + r"\s*\|\s*" + re.escape(engine) + r"\s*\|(.*)$", re.M)

    def parse(text: str) -> float | None:
        m = pat.search(text)
        if not m:
            return None
        try:
            return float(m.group(1).split("|")[col - 1].strip().rstrip("x"))
        except (IndexError, ValueError):
            return None
    return parse


@dataclass(frozen=True)
class ABSpec:
    old_script: str  # the revision's benchmark before the package (relative to its tree)
    numbers: dict[str, Callable[[str], float | None]]  # what is compared: name -> parser of a side's output
    headline: str  # the number whose after / before ratio is the verdict


AB: dict[str, ABSpec] = {
    "decode": ABSpec("scripts/bench_decode.py", {
        "kvcli INT4 decode tok/s": _row("kvcli, INT4 resident", 1),
        "kvcli INT4 vs transformers": _row("kvcli, INT4 resident", 2),
        "kvcli --dequantize decode tok/s": _row("kvcli, --dequantize", 1),
        "transformers decode tok/s": _row("transformers generate", 1),
    }, "kvcli INT4 decode tok/s"),
    "throughput": ABSpec("scripts/bench_throughput.py", {
        "kvcli output tok/s": _row("kvcli, whole trace at once", 2),
        "kvcli vs one at a time": _row("transformers `generate`, one request at a time", 3),
        "kvcli vs static batches": _row("transformers `generate`, static batches", 3),
        "kvcli vs generate_batch": _row("transformers continuous batching", 3),
        "kvcli vs llama.cpp": _row("llama.cpp", 3),
    }, "kvcli output tok/s"),
    "cpu": ABSpec("scripts/bench_cpu.py", {
        "kvcli prefill tok/s at 512": _cpu_row(512, "kvcli", 1),
        "kvcli decode tok/s at 512": _cpu_row(512, "kvcli", 2),
        "kvcli prefill tok/s at 4096": _cpu_row(4096, "kvcli", 1),
        "kvcli decode tok/s at 4096": _cpu_row(4096, "kvcli", 2),
    }, "kvcli decode tok/s at 512"),
}
AB["verify-step"] = ABSpec("", {  # a verification step of n rows against a 1-row step (lower is better)
    "6 rows vs 1 at 512": _row("512 | 6", 2),
    "6 rows vs 1 at 4096": _row("4096 | 6", 2),
    "8 rows vs 1 at 4096": _row("4096 | 8", 2),
    "1-row step ms at 4096": _row("4096 | 1", 1),
}, "6 rows vs 1 at 4096")
AB["roofline"] = ABSpec("", {  # batch 1 on the 1B shape (kvcli's rows; llama.cpp runs too, as the figure does)
    "kvcli prefill tok/s at 512": _cpu_row(512, "kvcli", 2),
    "kvcli decode tok/s at 512": _cpu_row(512, "kvcli", 4),
}, "kvcli prefill tok/s at 512")
AB["spec-default"] = ABSpec("", {  # speculation by prompt lookup at batch 1 against plain decode, same engine
    "code: speculation vs plain": _row("1 | code | kvcli+ngram", 2),
    "prose: speculation vs plain": _row("1 | prose | kvcli+ngram", 2),
    "code: plain decode tok/s": _row("1 | code | kvcli ", 1),
    "prose: plain decode tok/s": _row("1 | prose | kvcli ", 1),
}, "prose: speculation vs plain")
AB["throughput-avx2"] = AB["throughput"]
AB["cpu-avx2"] = ABSpec("scripts/bench_cpu.py", AB["cpu"].numbers, AB["cpu"].headline)


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True).stdout.strip()


def worktree(rev: str) -> Path:
    """REV checked out (detached) under .cache/ab/<short hash>; reused when already there."""
    short = _git("rev-parse", "--short", f"{rev}^{{commit}}")
    path = REPO / ".cache" / "ab" / short
    if not (path / ".git").exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), short], check=True,
                       capture_output=True, text=True)
    return path


def old_env(tree: Path) -> dict[str, str]:
    """PYTHONPATH: the old tree, then a folder whose kvcli_kernels links to the old tree's kernels/ (kept as
    .cache/ab/<rev>.shim beside the worktree, so reruns reuse it)."""
    shim = tree.parent / f"{tree.name}.shim"
    shim.mkdir(exist_ok=True)
    link = shim / "kvcli_kernels"
    if not link.is_symlink():
        link.symlink_to(tree / "kernels", target_is_directory=True)
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(shim)]))


def new_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


WHERE = "import kvcli, kvcli_kernels.cpu_build as k; print(kvcli.__file__); print(k.__file__)"


def check_imports(label: str, env: dict[str, str], cwd: Path, tree: Path) -> list[str]:
    """Where the side's kvcli and kvcli_kernels come from; exits when not from `tree`."""
    out = subprocess.run([sys.executable, "-c", WHERE], env=env, cwd=cwd, capture_output=True, text=True)
    files = out.stdout.split()
    print(f"{label}: kvcli from {files[0] if files else '?'}; kvcli_kernels from "
          f"{files[1] if len(files) > 1 else '?'}", flush=True)
    want = (tree / "kvcli", tree / "kernels")
    real = [Path(f).resolve() for f in files]
    if out.returncode or len(real) != 2 or any(w.resolve() not in r.parents for w, r in zip(want, real)):
        raise SystemExit(f"ab: the {label} side does not import {tree} ({out.stderr.strip()[-300:]})")
    return files


WARM = ("from kvcli.llm import LLM; from kvcli.config import SamplingParams; "
        "LLM().generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, ignore_eos=True))")


def warm_up(label: str, env: dict[str, str], cwd: Path) -> None:
    """One untimed load and generation per side first: the first use of a tree compiles its C kernels."""
    p = subprocess.run([sys.executable, "-c", WARM], env=env, cwd=cwd, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"ab: the {label} side's warm-up failed:\n{p.stderr[-2000:]}")


def side_command(tree: Path, figure: str, spec: ABSpec, args: list[str]) -> list[str]:
    fig = FIGURES[figure]
    if (tree / "kvcli" / "bench" / "figures.py").exists():
        return [sys.executable, "-m", "kvcli.bench", figure, *args]
    # before the package: the revision's script, with the figure's own arguments (the AVX2 figures: the
    # environment below; bench_cpu.py also wants --isa avx2)
    extra = ["--isa", "avx2"] if fig.env and spec.old_script.endswith("bench_cpu.py") else []
    return [sys.executable, str(tree / spec.old_script), *fig.args, *extra, *args]


def run_side(cmd: list[str], env: dict[str, str], cwd: Path, log) -> str:
    p = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    text = p.stdout + p.stderr
    if log is not None:
        log.write(f"\n$ {' '.join(cmd)}  (cwd {cwd})\n{text}")
        log.flush()
    if p.returncode:
        raise SystemExit(f"ab: {' '.join(cmd)} failed ({p.returncode}):\n{text[-2000:]}")
    return text


def main(argv: list[str]) -> int:
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(prog="python -m kvcli.bench ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, metavar="REV", help="the git revision to compare against")
    ap.add_argument("--after", metavar="REV", help="compare with REV's worktree instead of this tree (default)")
    ap.add_argument("figure", choices=sorted(AB))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--log", metavar="FILE", help="also write both sides' whole outputs to FILE")
    a = ap.parse_args(argv)
    spec, fig = AB[a.figure], FIGURES[a.figure]
    old_tree = worktree(a.before)
    new_tree = worktree(a.after) if a.after else REPO
    env_fig = dict(fig.env, NO_COLOR="1", HF_HUB_OFFLINE="1")
    log = open(a.log, "w", encoding="utf-8") if a.log else None
    after = (new_tree, {**new_env(), **env_fig}) if not a.after else (new_tree, {**old_env(new_tree), **env_fig})
    sides = {
        f"before ({_git('rev-parse', '--short', a.before)})": (old_tree, {**old_env(old_tree), **env_fig}),
        f"after ({_git('rev-parse', '--short', a.after)})" if a.after else "after (this tree)": after,
    }
    for label, (tree, env) in sides.items():
        check_imports(label, env, tree, tree)
        warm_up(label, env, tree)
    cmds = {label: side_command(tree, a.figure, spec, extra) for label, (tree, _) in sides.items()}
    for label, cmd in cmds.items():
        print(f"{label}: {' '.join(cmd)}")
    print(flush=True)
    got: dict[str, list[dict[str, float | None]]] = {label: [] for label in sides}
    labels = list(sides)
    for r in range(a.rounds):
        order = labels if r % 2 == 0 else labels[::-1]
        for label in order:
            tree, env = sides[label]
            text = run_side(cmds[label], env, tree, log)
            nums = {k: p(text) for k, p in spec.numbers.items()}
            got[label].append(nums)
            shown = ", ".join(f"{k} {v:g}" for k, v in nums.items() if v is not None)
            print(f"round {r + 1}, {label}: {shown or '(no numbers parsed)'} (load average {load_average()})",
                  flush=True)
    if log is not None:
        log.close()
    before, after = labels
    print(f"\n| number | {before} median | {after} median | after / before (median of per-round ratios) |")
    print("|---|---:|---:|---:|")
    for k in spec.numbers:
        b = [x[k] for x in got[before]]
        f = [x[k] for x in got[after]]
        if any(v is None for v in b + f):
            print(f"| {k} | n/a | n/a | not in every round's output |")
            continue
        ratio = median(y / x for x, y in zip(b, f) if x)
        print(f"| {k} | {median(b):g} | {median(f):g} | {ratio:.3f}x |")
    return 0
