"""KV cache element types as kvcli's kernels number them: the one table of their codes and ranges.

kvcli.kvcache.kv_dtype.KVDtype reads its `qmax` and kernel codes from here (kvcli_kernels does not
import kvcli), and so do the launchers: cache_write.py (Triton QUANT ids), cpu_attention.py and
cpu_rope_kv.py (the C kernels' dtype codes). Numbers only: no triton, no compiler, torch alone.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class KVFormat(NamedTuple):
    code: int  # dtype code of the C kernels: DT_* in cpu_attention.c (cpu_rope_kv.c: the float ones)
    quant: int  # QUANT id of the Triton cache-write kernel: 0 float, 1 int8 codes, 2 float8_e4m3fn codes
    qmax: float  # quantized: the code a vector's absmax maps to (symmetric absmax / qmax scales); else 0


INT8_QMAX = 127.0
FP8_QMAX = 448.0  # largest finite float8_e4m3fn

FORMATS: dict[torch.dtype, KVFormat] = {
    torch.float32: KVFormat(0, 0, 0.0),
    torch.float16: KVFormat(1, 0, 0.0),
    torch.bfloat16: KVFormat(2, 0, 0.0),
    torch.int8: KVFormat(3, 1, INT8_QMAX),
    torch.float8_e4m3fn: KVFormat(4, 2, FP8_QMAX),
}
# Storage dtype -> the C kernels' code (cpu_attention.c reads all five, cpu_rope_kv.c the float ones).
DTYPE_CODES = {d: f.code for d, f in FORMATS.items()}
FLOAT_DTYPE_CODES = {d: f.code for d, f in FORMATS.items() if f.quant == 0}
# Quantized storage dtype -> (QUANT id, qmax) of the Triton cache-write kernel.
QUANT_FORMATS = {d: (f.quant, f.qmax) for d, f in FORMATS.items() if f.quant}
