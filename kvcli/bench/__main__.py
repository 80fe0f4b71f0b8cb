"""python -m kvcli.bench: the one entry point of the benchmarks.

  python -m kvcli.bench --list                       every figure, the results file it writes, what it measures
  python -m kvcli.bench FIGURE [ARGS ...]            print FIGURE (header first: date, machine line, load, command)
  python -m kvcli.bench FIGURE --save [ARGS ...]     ... and write it to its file in docs/results/
  python -m kvcli.bench figures [FIGURE ...]         `make figures`: every figure of make figures (or those named),
                                                     each saved to its file
  python -m kvcli.bench ab --before REV FIGURE       the figure at git revision REV and in this tree, interleaved

ARGS are appended to the figure's own (those `make figures` uses), so `decode --repeats 1` is a short run.
"""

from __future__ import annotations

import importlib
import os
import shlex
import subprocess
import sys

from kvcli.bench.figures import FIGURES, Figure
from kvcli.bench.harness import REPO, header


def _list() -> None:
    width = max(len(n) for n in FIGURES)
    for f in FIGURES.values():
        extra = "" if f.in_make_figures else "  (not in make figures)"
        env = "".join(f" {k}={v}" for k, v in f.env.items())
        print(f"{f.name:<{width}}  {f.results:<40}  {f.about}{extra}" + (f"  [{env.strip()}]" if env else ""))


def merge_args(own: tuple[str, ...], argv: list[str]) -> list[str]:
    """The figure's arguments, then the caller's; where either has a `--` (the A/B figures: what follows goes
    to both sides), the parts before it and after it are joined separately."""
    def split(a):
        a = list(a)
        return (a[:a.index("--")], a[a.index("--") + 1:]) if "--" in a else (a, None)
    (o1, o2), (u1, u2) = split(own), split(argv)
    if o2 is None and u2 is None:
        return o1 + u1
    return o1 + u1 + ["--"] + (o2 or []) + (u2 or [])


def run_figure(fig: Figure, argv: list[str]) -> int:
    """Print the header, then run the figure in this process (the environment is already the figure's)."""
    args = merge_args(fig.args, argv)
    header(fig.name, argv, own=fig.args)
    if fig.entry.startswith("script:"):
        cmd = shlex.split(fig.entry[len("script:"):]) + argv
        return subprocess.run(cmd, cwd=REPO).returncode
    module, func = fig.entry.split(":")
    sys.argv = [f"python -m kvcli.bench {fig.name}", *args]  # argparse's prog, and what a figure echoes
    mod = importlib.import_module(f"kvcli.bench.{module}")
    return int(getattr(mod, func)(args) or 0)


def _in_figure_env(fig: Figure) -> bool:
    return all(os.environ.get(k) == v for k, v in fig.env.items())


def child(fig: Figure, argv: list[str], out_path: str | None) -> int:
    """Run the figure in a fresh process under its environment (torch reads the ISA variables once, at
    import), its stdout and stderr to out_path (or inherited)."""
    env = dict(os.environ, **fig.env, NO_COLOR="1", COLUMNS=os.environ.get("COLUMNS", "120"))
    cmd = [sys.executable, "-m", "kvcli.bench", fig.name, *argv]
    if out_path is None:
        return subprocess.run(cmd, env=env, cwd=REPO).returncode
    with open(out_path, "w", encoding="utf-8") as f:
        rc = subprocess.run(cmd, env=env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode
        if rc:
            print(f"(exit status {rc})", file=f)
    return rc


def figures(names: list[str]) -> int:
    """make figures: each figure saved to its file, one after the other (on an otherwise idle machine)."""
    chosen = names or [n for n, f in FIGURES.items() if f.in_make_figures]
    bad = [n for n in chosen if n not in FIGURES]
    if bad:
        print(f"unknown figure(s): {', '.join(bad)}; see python -m kvcli.bench --list", file=sys.stderr)
        return 2
    failed = []
    for name in chosen:
        print(f"figures: {name}", file=sys.stderr, flush=True)
        if child(FIGURES[name], [], str(REPO / FIGURES[name].results)):
            failed.append(name)
    print(f"figures: done; raw outputs in docs/results/" + (f"; failed: {' '.join(failed)}" if failed else ""),
          file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    if argv[0] == "--list":
        _list()
        return 0
    if argv[0] == "ab":
        from kvcli.bench.ab import main as ab_main

        return ab_main(argv[1:])
    if argv[0] == "figures":
        return figures(argv[1:])
    name, rest = argv[0], argv[1:]
    fig = FIGURES.get(name)
    if fig is None:
        print(f"unknown figure {name!r}; see python -m kvcli.bench --list", file=sys.stderr)
        return 2
    save = None
    if "--save" in rest:
        rest.remove("--save")
        save = str(REPO / fig.results)
    if save is not None or not _in_figure_env(fig):
        return child(fig, rest, save)
    return run_figure(fig, rest)


if __name__ == "__main__":
    sys.exit(main())
