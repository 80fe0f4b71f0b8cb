"""Steps issued to an engine's runner by hand, as the scheduler issues them: through the engine's KV layout
(blocks zeroed on first use, copy-on-write copies), every KV group's table in the chunk (kvcache/kv_groups.py:
Gemma's windowed layers keep their own)."""

from __future__ import annotations

import torch

from kvcli.step import ScheduledChunk, SchedulerOutput


def forced_step(engine, req: str, ids: list[int], pos: int) -> SchedulerOutput:
    """The step that computes `ids` at positions pos.. of request `req` (its logits wanted)."""
    assert engine.kv.allocate(req, pos + len(ids), pos)
    tables = engine.kv.group_tables(req)
    chunk = ScheduledChunk(req, list(ids), pos, list(tables[0]), True, group_tables=tuple(list(t) for t in tables[1:]))
    return SchedulerOutput([chunk], new_blocks=engine.kv.take_new_blocks(), block_copies=engine.kv.take_copies())


def teacher_forced(engine, ids: list[int], prefill: int, chunk: int, req: str = "tf") -> torch.Tensor:
    """Logits at every position: `prefill` tokens in chunks of `chunk`, then one decode step per token."""
    rows, pos = [], 0
    while pos < len(ids):
        n = min(chunk, prefill - pos) if pos < prefill else 1
        rows.append(engine.runner.execute(forced_step(engine, req, ids[pos:pos + n], pos), all_logits=True).logits)
        pos += n
    engine.kv.free(req)
    engine.kv.check_invariants()
    return torch.cat(rows)
