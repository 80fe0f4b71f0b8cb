"""Where kvcli keeps what it builds once per machine (tokenizer files, C kernel builds): `KVCLI_CACHE`, else
`$XDG_CACHE_HOME/kvcli`, else `~/.cache/kvcli`."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    base = os.environ.get("KVCLI_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                         os.path.expanduser("~/.cache"), "kvcli")
    return Path(base)
