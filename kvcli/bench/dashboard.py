"""The live view on a real terminal: `kvcli continue samples/keepers-log.txt -n 300` in tmux (120 x 50),
captured 5 s into decode (once the prefill bar is gone and the dashboard is up). Skipped without tmux."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import time

from kvcli.bench.harness import REPO

SESSION = "kvcli-figures"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcli.bench dashboard", description=__doc__)
    ap.add_argument("-n", type=int, default=300, help="tokens to generate (default 300)")
    ap.add_argument("--wait", type=float, default=240, help="seconds to wait for the dashboard (default 240)")
    a = ap.parse_args(argv)
    if shutil.which("tmux") is None:
        print("dashboard skipped (no tmux)")
        return 0
    kvcli = [sys.executable, "-m", "kvcli.cli", "continue", "samples/keepers-log.txt", "-n", str(a.n)]
    print(f"tmux (120x50): {shlex.join(kvcli)}, captured 5 s into decode\n", flush=True)
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    subprocess.run(["tmux", "kill-session", "-t", SESSION], capture_output=True)
    subprocess.run(["tmux", "new-session", "-d", "-s", SESSION, "-x", "120", "-y", "50", "-c", str(REPO),
                    f"{shlex.join(kvcli)} > /dev/null; sleep 30"], check=True, env=env)
    try:
        deadline = time.monotonic() + a.wait
        while time.monotonic() < deadline:
            time.sleep(2)
            pane = subprocess.run(["tmux", "capture-pane", "-p", "-t", SESSION], capture_output=True,
                                  text=True).stdout
            if "KV fragmentation" in pane and "prefill " not in pane:
                break
        time.sleep(5)
        print(subprocess.run(["tmux", "capture-pane", "-p", "-t", SESSION], capture_output=True, text=True).stdout)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", SESSION], capture_output=True)
    return 0
