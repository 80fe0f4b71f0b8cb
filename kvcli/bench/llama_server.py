"""Where llama.cpp's llama-server binary is, for the tests and benchmarks that run it beside kvcli
serve (never a kvcli dependency). scripts/build_llama_server.sh builds it and is the one place that
names its path (`--where`): the cache outside the clone that the conformance suite's llama.cpp uses."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "build_llama_server.sh"


def candidates() -> list[Path]:
    """$KVCLI_LLAMA_SERVER if set (only it); else where scripts/build_llama_server.sh builds it."""
    if os.environ.get("KVCLI_LLAMA_SERVER"):
        return [Path(os.environ["KVCLI_LLAMA_SERVER"])]
    try:
        where = subprocess.run(["bash", str(SCRIPT), "--where"], capture_output=True, text=True,
                               timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return []
    return [Path(where)] if where else []


def find_llama_server() -> Path | None:
    return next((p for p in candidates() if p.is_file() and os.access(p, os.X_OK)), None)
