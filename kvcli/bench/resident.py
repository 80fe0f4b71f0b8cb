"""Resident weights against the file, on real shapes: `kvcli inspect FILE --json` for random-weight GGUFs of the
1B shape (Q4_0, Q4_K_M-style, Q8_0), the 3B shape (Q4_0) and the 8B shape (Q4_K_M-style, untied head), each its
own process as a user's would be.

Printed per file: the file's tensor bytes, what kvcli holds after the load (inspect's `resident`: the kernel
forms, a tied embedding counted once) and its ratio to the file, the rotary tables beside them (inspect's
`tables`), and what the process really grew by over the load (inspect's `measured_growth`: RSS) and its ratio
to the weights and tables held; the rest of the growth is what kvcli does not count (tokenizer, kernel
libraries, a two-block KV pool, the allocator's slack). The files are written
once into .cache/shapes (kvcli/bench/shapes.py: random but well-formed blocks, the bundled tokenizer).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from kvcli.bench.shapes import shape_file

FILES = [("1b", "Q4_0"), ("1b", "Q4_K_M"), ("1b", "Q8_0"), ("3b", "Q4_0"), ("8b", "Q4_K_M")]
MIB = 2**20


def inspect(path) -> dict:
    out = subprocess.run([sys.executable, "-m", "kvcli.cli", "inspect", str(path), "--json"], capture_output=True,
                         text=True)
    if out.returncode:
        raise SystemExit(f"resident: kvcli inspect {path} failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--files", default=",".join(f"{s}-{k}" for s, k in FILES),
                   help="shape-kind pairs, comma-separated (default: %(default)s)")
    args = p.parse_args(argv)
    rows = []
    for item in args.files.split(","):
        shape, _, kind = item.partition("-")
        try:
            path = shape_file(shape, kind)
        except ValueError as e:
            p.error(str(e))
        rep = inspect(path)
        resident = sum(rep["resident"].values())
        rows.append((f"{shape} {kind}", rep["file_tensor_bytes"], resident, rep["tables"], rep["measured_growth"],
                     rep["linear_paths"], rep["resident"]))
        print(f"{path.name}: {json.dumps(rep['resident'])}", flush=True)
    print()
    print(f"{'file':<12} {'file MiB':>9} {'resident MiB':>13} {'vs file':>8} {'tables MiB':>11} "
          f"{'RSS growth MiB':>15} {'vs held':>8}  linears")
    for name, file_bytes, resident, tables, growth, linears, _ in rows:
        print(f"{name:<12} {file_bytes / MIB:>9.1f} {resident / MIB:>13.1f} {resident / file_bytes:>7.3f}x "
              f"{tables / MIB:>11.1f} {growth / MIB:>15.1f} {growth / (resident + tables):>7.3f}x  {linears}")
