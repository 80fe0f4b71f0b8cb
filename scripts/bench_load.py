#!/usr/bin/env python
"""Load time of the bundled model as a user sees it: `kvcli continue FILE -n 1 --json`, whose report
has `load_seconds`, run first with an empty tokenizer cache (a fresh machine) and then twice with
the cache it left. Each run is its own process, as a user's would be."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def load_seconds(cache: str) -> float:
    env = dict(os.environ, KVCLI_CACHE=cache)
    cmd = [sys.executable, "-m", "kvcli.cli", "continue", str(REPO / "samples" / "keepers-log.txt"),
           "-n", "1", "--json", "--no-live"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout)["load_seconds"]


def main() -> None:
    from kvcli.bench.machine import machine_line

    print(machine_line())
    with tempfile.TemporaryDirectory() as cache:
        first = load_seconds(cache)
        later = [load_seconds(cache) for _ in range(2)]
    print(f"load_seconds, empty tokenizer cache (first run on a machine): {first:.2f}")
    print(f"load_seconds, cache present (later runs): {', '.join(f'{x:.2f}' for x in later)}")


if __name__ == "__main__":
    main()
