"""The live view on a real terminal: `kvcli continue samples/keepers-log.txt -n 300` in tmux (120 x 50),
captured 5 s into decode (once the prefill bar is gone and the dashboard is up); `window` (the
dashboard-window figure): `kvcli continue samples/lunyu-zh.txt --kv-window 1024` on a text of 2.5x the
context, captured while its blocks recycle (the bounded-KV line counting dropped tokens) and again during
decode; `groups` (the dashboard-groups figure): `kvcli continue samples/keepers-log.txt --model dummy:gemma-3-270m`,
Gemma 3 270M's shape with random weights (its byte-level tokenizer makes the text ~17k tokens), captured
during decode: the block map draws the windowed layers' blocks (KV groups) apart from the global ones.
Skipped without tmux."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

from kvcli.bench.harness import REPO

SESSION = "kvcli-figures"


def _pane() -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", SESSION], capture_output=True, text=True).stdout


def _start(kvcli: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    subprocess.run(["tmux", "kill-session", "-t", SESSION], capture_output=True)
    subprocess.run(["tmux", "new-session", "-d", "-s", SESSION, "-x", "120", "-y", "50", "-c", str(REPO),
                    f"{shlex.join(kvcli)} > /dev/null; sleep 30"], check=True, env=env)


def _wait(ready, seconds: float) -> str | None:
    """The pane once ready(pane) holds, or None after `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(1)
        pane = _pane()
        if ready(pane):
            return pane
    return None


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
    _start(kvcli)
    try:
        _wait(lambda pane: "KV fragmentation" in pane and "prefill " not in pane, a.wait)
        time.sleep(5)
        print(_pane())
    finally:
        subprocess.run(["tmux", "kill-session", "-t", SESSION], capture_output=True)
    return 0


_DROPPED = re.compile(r"([\d,]+) tokens dropped")


def window(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcli.bench dashboard-window", description=__doc__)
    ap.add_argument("-n", type=int, default=200, help="tokens to generate (default 200)")
    ap.add_argument("--kv-window", type=int, default=1024, help="the bounded cache's window (default 1024)")
    ap.add_argument("--text", default="samples/lunyu-zh.txt", help="a text longer than the context")
    ap.add_argument("--wait", type=float, default=300, help="seconds to wait for each capture (default 300)")
    a = ap.parse_args(argv)
    if shutil.which("tmux") is None:
        print("dashboard-window skipped (no tmux)")
        return 0
    kvcli = [sys.executable, "-m", "kvcli.cli", "continue", a.text, "-n", str(a.n), "--kv-window", str(a.kv_window),
             "--temperature", "0"]
    print(f"tmux (120x50): {shlex.join(kvcli)}\n", flush=True)
    _start(kvcli)

    def dropped(pane: str) -> int:
        m = _DROPPED.search(pane)
        return int(m.group(1).replace(",", "")) if m else 0

    try:
        # While the text streams through the window: blocks already handed back, the prefill still running.
        pane = _wait(lambda p: dropped(p) >= 4 * a.kv_window, a.wait)
        print("-- while the prefill streams through the window (blocks recycling) --")
        print(pane if pane is not None else "(no capture: nothing dropped in time)\n" + _pane())
        pane = _wait(lambda p: "KV fragmentation" in p and "prefill " not in p, a.wait)
        if pane is not None:
            time.sleep(5)
        print("-- during decode, 5 s in --")
        print(_pane())
    finally:
        subprocess.run(["tmux", "kill-session", "-t", SESSION], capture_output=True)
    return 0


def groups(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcli.bench dashboard-groups", description=__doc__)
    ap.add_argument("-n", type=int, default=200, help="tokens to generate (default 200)")
    ap.add_argument("--model", default="dummy:gemma-3-270m", help="a model with KV groups (default dummy:gemma-3-270m)")
    ap.add_argument("--wait", type=float, default=600, help="seconds to wait for the dashboard (default 600)")
    a = ap.parse_args(argv)
    if shutil.which("tmux") is None:
        print("dashboard-groups skipped (no tmux)")
        return 0
    kvcli = [sys.executable, "-m", "kvcli.cli", "continue", "samples/keepers-log.txt", "--model", a.model,
             "-n", str(a.n)]
    print(f"tmux (120x50): {shlex.join(kvcli)}, captured 5 s into decode\n", flush=True)
    _start(kvcli)
    try:
        pane = _wait(lambda p: "KV fragmentation" in p and "prefill " not in p, a.wait)
        if pane is not None:
            time.sleep(5)
        print(_pane() if pane is not None else "(no capture: no decode in time)\n" + _pane())
    finally:
        subprocess.run(["tmux", "kill-session", "-t", SESSION], capture_output=True)
    return 0
