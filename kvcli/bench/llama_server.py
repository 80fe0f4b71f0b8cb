"""Where llama.cpp's llama-server binary is, for the tests and benchmarks that run it beside kvcli
serve (never a kvcli dependency; scripts/build_llama_server.sh builds it)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REL = Path("llama-server") / "bin" / "llama-server"


def _main_checkout() -> Path | None:
    """The main checkout when this tree is a git worktree (builds are shared from its .cache)."""
    try:
        common = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--path-format=absolute", "--git-common-dir"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return Path(common).parent if common else None


def candidates() -> list[Path]:
    """$KVCLI_LLAMA_SERVER if set (only it); else under $KVCLI_CACHE, this checkout's .cache/bench and,
    in a git worktree, the main checkout's .cache/bench."""
    if os.environ.get("KVCLI_LLAMA_SERVER"):
        return [Path(os.environ["KVCLI_LLAMA_SERVER"])]
    out = []
    if os.environ.get("KVCLI_CACHE"):
        out.append(Path(os.environ["KVCLI_CACHE"]) / REL)
    out.append(REPO / ".cache" / "bench" / REL)
    main = _main_checkout()
    if main is not None and main != REPO:
        out.append(main / ".cache" / "bench" / REL)
    return out


def find_llama_server() -> Path | None:
    return next((p for p in candidates() if p.is_file() and os.access(p, os.X_OK)), None)
