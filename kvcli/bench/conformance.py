"""The GGUF conformance suite's margins (tests/conformance/test_llama_cpp.py): how far kvcli's logits are from
llama.cpp's on each tiny variant file, against the bound the suite asserts. The suite itself asserts and prints
nothing; this figure runs it (pytest, in a child process, llama.cpp from the conformance build outside the clone)
with KVCLI_CONFORMANCE_MARGINS set, so that each variant writes one JSON line of what it measured, and prints them.

Per variant: the relative error of kvcli's teacher-forced logits (max |kvcli - llama.cpp| over the largest
|llama.cpp| logit; 256 tokens, prefilled in chunks of 48 then 16 one-token decode steps) on the default weight
path; for quantized files also the exactly dequantized model's error (llama.cpp rounds the activations to 8 bits
per block, or to fp16, before its dot products: the floor kvcli is held to, plus 1e-3) and the error with one
kernel at every row count (--attention-backend invariant: no int8 GEMM for chunks of 32+ rows); the margin =
bound - error; and whether the 12 greedy tokens after the text are llama.cpp's (asserted for F32 files only).
  python -m kvcli.bench conformance-margins [--variants q4_0,q4_k] [--save]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from kvcli.bench.harness import REPO
from kvcli.bench.llama_cpp_runner import python_for

TEST = "tests/conformance/test_llama_cpp.py"


def _llama_build(py: "os.PathLike[str]") -> str:
    """llama-cpp-python's version and its build's features, from the conformance venv's python `py`."""
    code = "import llama_cpp as L; print(L.__version__, '|', L.llama_print_system_info().decode())"
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=120)
    return out.stdout.strip()


def _fmt(v: float | None) -> str:
    return "—" if v is None else f"{v:.2e}"


def table(rows: list[dict]) -> list[str]:
    """The figure's table, one line per recorded variant (the suite's order)."""
    out = ["| variant | linears | kvcli error | bound | margin | one kernel every row count | exactly dequantized "
           "| greedy tokens same |",
           "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r["outcome"] != "compared":
            why = f": {r['why']}" if r.get("why") else ""
            out.append(f"| {r['variant']} | {r['weights']} | {r['outcome']}{why} | | | | | |")
            continue
        err, bound = r["error"], r["bound"]
        out.append(f"| {r['variant']} | {r['weights']} | {_fmt(err)} | {_fmt(bound)} | {_fmt(bound - err)} | "
                   f"{_fmt(r.get('invariant'))} | {_fmt(r.get('exact'))} | {'yes' if r['greedy_same'] else 'no'} |")
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcli.bench conformance-margins", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="", help="comma-separated variant names (default: every one)")
    args = ap.parse_args(argv)
    py = python_for("native")  # (it imports llama_cpp in that venv to check it: once)
    if py is None:
        print("llama.cpp's conformance build is missing: run `bash scripts/build_llama_cpp_python.sh` "
              "(make test builds it)", file=sys.stderr)
        return 1
    targets = ([f"{TEST}::test_variant_matches_llama_cpp[{v.strip()}]" for v in args.variants.split(",") if v.strip()]
               or [f"{TEST}::test_variant_matches_llama_cpp"])
    with tempfile.TemporaryDirectory() as tmp:
        record = os.path.join(tmp, "margins.jsonl")
        open(record, "w").close()
        env = dict(os.environ, KVCLI_CONFORMANCE_MARGINS=record)
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *targets], cwd=REPO,
                           env=env, capture_output=True, text=True)
        with open(record, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    summary = next((ln for ln in reversed(p.stdout.splitlines()) if ln.strip()), "")
    print(f"llama.cpp: llama-cpp-python {_llama_build(py)}")
    print(f"suite: pytest {' '.join(t.removeprefix(TEST) or TEST for t in targets)} -> {summary.strip('= ')}")
    print()
    print("\n".join(table(rows)))
    compared = [r for r in rows if r["outcome"] == "compared"]
    if compared:
        tight = min(compared, key=lambda r: r["bound"] - r["error"])
        print()
        print(f"least margin: {tight['variant']}, {_fmt(tight['error'])} against {_fmt(tight['bound'])}")
    if p.returncode:
        print("\nthe suite failed:\n" + "\n".join(p.stdout.splitlines()[-30:]))
    return p.returncode
