"""Kernel tests run on CUDA when present, else under the Triton interpreter on CPU.

TRITON_INTERPRET is read when a @triton.jit function is *defined*, so it must be set before any
kvcli_kernels module is imported; a module imported earlier without it (by another test package)
is reloaded so its kernels become interpreted. Test modules skip themselves with a reason
(pytest.importorskip) when triton is not importable.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in ("kvcli_kernels.cache_write", "kvcli_kernels.paged_attention", "kvcli_kernels.int4_gemm"):
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])
