"""Load time of the bundled model as a user sees it: `kvcli continue FILE -n 1 --json`, whose report
has `load_seconds` (file, tokenizer, model build and KV pool), run first with an empty kvcli cache (a
fresh machine) and then twice with the cache it left. Each run is its own process, as a user's would
be; the process's whole wall time (Python start, imports, load, a 4k-token prefill and one token) is
printed beside it."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from kvcli.bench.harness import REPO


def load_seconds(cache: str) -> tuple[float, float]:
    env = dict(os.environ, KVCLI_CACHE=cache)
    cmd = [sys.executable, "-m", "kvcli.cli", "continue", str(REPO / "samples" / "keepers-log.txt"),
           "-n", "1", "--json", "--no-live"]
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout)["load_seconds"], time.perf_counter() - t


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__).parse_args(argv)

    with tempfile.TemporaryDirectory() as cache:
        first = load_seconds(cache)
        later = [load_seconds(cache) for _ in range(2)]
    print(f"load_seconds, empty cache (first run on a machine): {first[0]:.2f}  (whole process: {first[1]:.2f} s)")
    print(f"load_seconds, cache present (later runs): {', '.join(f'{x[0]:.2f}' for x in later)}  "
          f"(whole process: {', '.join(f'{x[1]:.2f}' for x in later)} s)")
