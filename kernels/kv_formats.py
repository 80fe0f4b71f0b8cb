"""KV cache element types as kvcli's kernels number them, for the launchers: cache_write.py (Triton QUANT
ids and qmax), cpu_attention.py and cpu_rope_kv.py (the C kernels' dtype codes).

Derived from THE table, kvcli.kvcache.kv_dtype.KV_DTYPES, which holds each format's range and codes next
to the quantization arithmetic the kernels reproduce (kernels/ reads kvcli there, as reference.py does;
kvcli.kvcache imports nothing of kvcli_kernels). No triton, no compiler: torch and that table.
"""

from __future__ import annotations

from kvcli.kvcache.kv_dtype import KV_DTYPES

# Storage dtype -> the C kernels' code: DT_* of cpu_attention.c and cpu_rope_kv.c.
DTYPE_CODES = {d.storage: d.kernel_code for d in KV_DTYPES.values()}
# Storage dtypes stored with a scale per token and KV head (int8, fp8).
QUANTIZED = frozenset(d.storage for d in KV_DTYPES.values() if d.quantized)
# Quantized storage dtype -> (QUANT id, qmax) of the Triton cache-write kernel.
QUANT_FORMATS = {d.storage: (d.quant_code, d.qmax) for d in KV_DTYPES.values() if d.quantized}
