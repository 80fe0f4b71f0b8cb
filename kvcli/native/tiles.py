"""The int8 kernel library's AMX switch (kernels/cpu_int8dot.c kvq_amx_enable), turned on once per process by the
weight plan's rule (kvcli/model/weight_plan.py int8dot_tiles); Linux grants the tile state per process."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def turn_on(lib, min_rows: int, min_elems: int, min_rows8: int) -> bool:
    """The library's tiles on for calls of min_rows+ rows and min_elems+ activations (8-bit codes: min_rows8+ rows);
    False where the CPU has no AMX-INT8, Linux refuses the tile state (arch_prctl) or the build has no AMX path."""
    return lib.kvq_amx_enable(min_rows, min_elems, min_rows8) == 1
