"""What a bounded KV cache (--kv-window; kvcache/retention.py) has done, for the views: the rule (S, W), the
tokens dropped and the blocks handed back, and which blocks of the pool were recycled this run.

Everything is read from public state: the engine's `retention` and its KV layout's counters (`dropped_total`,
`recycled_blocks`, `peak_slots`, `dropped_tokens(req_id)`, `block_table(req_id)`). Nothing here changes the
engine, and nothing is imported from it (kvcache/ imports metrics/).

Which blocks were recycled needs a look after every engine step (`WindowTracker.observe`): the layout drops a
request's oldest window blocks inside its `allocate` and keeps no list of them. The tracker keeps each
windowed request's block table from the last step; when the request's dropped count grew by k blocks' worth,
the k blocks after its sinks in the old table are the ones given back (the rule drops from the front of the
window and keeps the table compact).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvcli.metrics.snapshot import MemorySnapshot, Snapshot, WindowSummary


def window_summary(engine: Any) -> WindowSummary | None:
    """The engine's bounded cache so far (None without --kv-window)."""
    r = getattr(engine, "retention", None)
    if r is None:
        return None
    kv = engine.kv
    return WindowSummary(
        sink_tokens=r.sink_tokens, sink_slots=r.sink_slots, window=r.window, max_slots=r.max_slots,
        dropped_tokens=int(getattr(kv, "dropped_total", 0)), recycled_blocks=int(getattr(kv, "recycled_blocks", 0)),
        peak_tokens=int(getattr(kv, "peak_slots", 0)))


def with_window(snapshot: Snapshot, engine: Any, tracker: "WindowTracker | None" = None) -> Snapshot:
    """The snapshot with the bounded cache's summary, and its block map with the recycled blocks marked
    (when a tracker has followed the run)."""
    w = window_summary(engine)
    if w is None:
        return snapshot
    blocks = snapshot.blocks
    if blocks is not None and tracker is not None:
        blocks = replace(blocks, recycled=tracker.flags(len(blocks.owner)))
    return replace(snapshot, window=w, blocks=blocks)


class WindowTracker:
    """Follows a bounded cache's drops step by step: `observe()` after every engine step, `flags()` for the
    block map. Costs one copy of each running windowed request's block table per step; nothing at all
    without a retention rule."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        r = getattr(engine, "retention", None)
        self.active = r is not None and hasattr(engine.kv, "recycled_blocks")
        self.sink_blocks = r.sink_blocks if r is not None else 0
        self.block_size = r.block_size if r is not None else 1
        self.recycled: set[int] = set()  # block ids given back by a drop this run (the null block is 0)
        self._tables: dict[str, tuple[tuple[int, ...], int]] = {}  # req -> (block table, dropped) last step
        self._seen_recycled = 0

    def observe(self) -> None:
        if not self.active:
            return
        kv = self.engine.kv
        running = [r.req_id for r in self.engine.scheduler.stats().running]
        if kv.recycled_blocks != self._seen_recycled:
            self._seen_recycled = kv.recycled_blocks
            for rid in running:
                old = self._tables.get(rid)
                if old is None:
                    continue
                table, dropped = old
                k = (kv.dropped_tokens(rid) - dropped) // self.block_size
                if k > 0:
                    self.recycled.update(table[self.sink_blocks:self.sink_blocks + k])
        self._tables = {rid: (tuple(kv.block_table(rid)), kv.dropped_tokens(rid)) for rid in running}

    def flags(self, num_blocks: int) -> tuple[bool, ...]:
        """Per block of the map (ids 1..num_blocks): given back by a drop this run."""
        rec = self.recycled
        return tuple(b in rec for b in range(1, num_blocks + 1))

    def snapshot(self, memory: MemorySnapshot | None = None, *, block_map: bool = False) -> Snapshot:
        """The engine's snapshot with the window's summary and the recycled blocks marked."""
        return with_window(self.engine.snapshot(memory, block_map=block_map), self.engine, self)
