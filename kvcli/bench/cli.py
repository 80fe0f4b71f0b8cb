"""Figures that are a kvcli command as a user runs it (continue, profile, profile --simulate): the command
runs in its own process from the repository root (its paths are relative to it), its output as printed."""

from __future__ import annotations

import subprocess
import sys

from kvcli.bench.harness import REPO


def main(argv: list[str]) -> int:
    """argv: the kvcli command line after `kvcli`."""
    sys.stdout.flush()
    return subprocess.run([sys.executable, "-m", "kvcli.cli", *argv], cwd=REPO).returncode
