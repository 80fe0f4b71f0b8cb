"""Contiguous preallocation (implements KVLayout), for comparison with paging under one KV budget.

Each admitted request reserves one contiguous region of the pool up front — max_model_len slots
(`--reserve max-len`, like systems that preallocate for the longest possible output) or its prompt
plus max_tokens (`--reserve request`) — from a real arena: first fit over a sorted list of free
holes, merged on release. A request whose region fits in no single hole waits, even when enough
memory is free in total, so external fragmentation happens, it is not computed. Regions are
rounded up to whole blocks so the same paged kernels read them (the block table of a region is a
run of consecutive block ids). Regions are private: no prefix sharing, no forks.

Under a retention rule (kvcache/retention.py: sinks + a recent window) a request reserves the rule's bound
instead, `max_slots` = sink slots + W + one block, so a windowed comparison stays honest: preallocation
for the window, not for the context. Inside its region the request's block table is then a permutation
of the region's blocks: a dropped window block goes to the region's spare list and is re-used as the
window advances (a ring inside one reservation), the table stays compact and the kept keys are re-rotated
by the drop exactly as the paged layout does (same positions, same `KeyShift`s, same `skip` on a rebuild).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

from kvcli.kvcache.interface import blocks_for
from kvcli.kvcache.retention import KeyShift, Retention
from kvcli.metrics.snapshot import BlockMap
from kvcli.metrics.stats import KVLayoutStats, RequestExtent


def reservation_split(region_slots: int, tokens: int, final: int) -> tuple[int, int]:
    """(reserved, internal) of a region: slots up to the final length will still be used, the rest
    never will."""
    usable = min(region_slots, final)
    return max(0, usable - tokens), region_slots - max(tokens, usable)


class ContiguousArena:
    name = "contiguous"
    supports_sharing = False

    def __init__(self, num_blocks: int, block_size: int, *, reserve: str = "max-len", max_model_len: int,
                 retention: Retention | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV pool needs at least one block")
        if reserve not in ("max-len", "request"):
            raise ValueError(f"unknown reservation {reserve!r} (max-len or request)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.reserve = reserve
        self.max_model_len = max_model_len
        # Block ids 1..num_blocks (0 is the null block). (start, length) holes, sorted by start.
        self.holes: list[tuple[int, int]] = [(1, num_blocks)]
        self.regions: dict[str, tuple[int, int]] = {}
        self._fresh = bytearray(b"\x01") * (num_blocks + 1)  # never handed out: the runner zeroes them
        self.new_blocks: list[int] = []
        self.retention = retention
        # Windowed requests only: the compact table (a permutation of the region), the region's spare blocks,
        # the text tokens dropped (cache position = text - D past the sinks) and the queued key re-rotations.
        self.tables: dict[str, list[int]] = {}
        self.spare: dict[str, list[int]] = {}
        self.dropped: dict[str, int] = {}
        self.pending_shifts: list[KeyShift] = []
        self.dropped_total = 0
        self.recycled_blocks = 0
        self.peak_slots = 0

    @property
    def num_free_blocks(self) -> int:
        return sum(n for _, n in self.holes)

    def largest_hole(self) -> int:
        return max((n for _, n in self.holes), default=0)

    def reservation_tokens(self, final_tokens: int) -> int:
        """Slots a request sets aside at admission under this layout's --reserve policy (a windowed request:
        at most the retention bound)."""
        n = min(final_tokens, self.max_model_len) if self.reserve == "request" else self.max_model_len
        return n if self.retention is None else min(n, self.retention.max_slots)

    def block_table(self, req_id: str) -> list[int]:
        if self.retention is not None:
            return list(self.tables.get(req_id, ()))
        r = self.regions.get(req_id)
        return list(range(r[0], r[0] + r[1])) if r else []

    def group_tables(self, req_id: str) -> tuple[list[int], ...]:
        return (self.block_table(req_id),)

    def held_blocks(self, req_id: str) -> list[int]:
        return self.block_table(req_id)

    def _region_tokens(self, num_tokens: int, final_tokens: int) -> int:
        if self.retention is not None:
            num_tokens = min(num_tokens, self.retention.max_slots)
        return max(num_tokens, self.reservation_tokens(final_tokens))

    def blocks_to_admit(self, num_tokens: int, final_tokens: int) -> int:
        return blocks_for(self._region_tokens(num_tokens, final_tokens), self.block_size)

    # --- retention (bounded cache): the paged layout's rule, inside one reservation ---------------------
    def dropped_tokens(self, req_id: str) -> int:
        return self.dropped.get(req_id, 0)

    def cache_position(self, req_id: str, text_index: int) -> int:
        return self.retention.cache_position(text_index, self.dropped.get(req_id, 0))

    def skip(self, req_id: str, num_computed: int, num_tokens: int) -> int:
        """A rebuild with exactly the sinks cached: the tokens between them and the last W count as dropped."""
        r = self.retention
        n = 0 if r is None else r.tokens_to_skip(self.dropped.get(req_id, 0), num_computed, num_tokens)
        if n <= 0:
            return 0
        self.dropped[req_id] = n
        self.dropped_total += n
        return n

    def take_shifts(self) -> list[KeyShift]:
        out, self.pending_shifts = self.pending_shifts, []
        return out

    def _grow_windowed(self, req_id: str, num_tokens: int, num_computed: int) -> bool:
        r, bs = self.retention, self.block_size
        table, spare = self.tables[req_id], self.spare[req_id]
        d = self.dropped.get(req_id, 0)
        slots, computed = num_tokens - d, num_computed - d
        k = r.blocks_to_drop(slots, computed, len(table))
        if k:
            ns = r.sink_blocks
            gone, kept = table[ns:ns + k], table[ns + k:]
            moving = kept[:max(0, blocks_for(computed - r.sink_slots, bs) - k)]
            table[ns:] = kept
            spare.extend(gone)
            delta = k * bs
            self.dropped[req_id] = d + delta
            self.dropped_total += delta
            self.recycled_blocks += k
            if moving:
                self.pending_shifts.append(KeyShift(req_id, tuple(moving), delta))
            slots -= delta
        need = blocks_for(slots, bs) - len(table)
        if need > len(spare):
            return False  # past the reservation (cannot happen within the rule's bound)
        self.peak_slots = max(self.peak_slots, slots)
        for _ in range(max(0, need)):
            table.append(spare.pop(0))
        return True

    def admit(self, req_id: str, num_tokens: int, num_computed: int, final_tokens: int) -> bool:
        if req_id in self.regions:
            return self.allocate(req_id, num_tokens, num_computed)
        n = self.blocks_to_admit(num_tokens - self.dropped.get(req_id, 0), final_tokens)
        for i, (start, length) in enumerate(self.holes):
            if length >= n:
                if length == n:
                    del self.holes[i]
                else:
                    self.holes[i] = (start + n, length - n)
                self.regions[req_id] = (start, n)
                for b in range(start, start + n):
                    if self._fresh[b]:
                        self._fresh[b] = 0
                        self.new_blocks.append(b)
                if self.retention is not None:
                    self.tables[req_id], self.spare[req_id] = [], list(range(start, start + n))
                    return self._grow_windowed(req_id, num_tokens, num_computed)
                return True
        return False  # no single hole is large enough: external fragmentation

    def allocate(self, req_id: str, num_tokens: int, num_computed: int) -> bool:
        # Growth inside the reservation is free; beyond it the request cannot grow (the scheduler
        # ends it: a contiguous reservation is a hard cap).
        region = self.regions.get(req_id)
        if region is not None and self.retention is not None:
            return self._grow_windowed(req_id, num_tokens, num_computed)
        return region is not None and blocks_for(num_tokens, self.block_size) <= region[1]

    def truncate(self, req_id: str, num_tokens: int) -> None:
        # The region stays reserved whole; rejected slots are simply rewritten later (a windowed table gives
        # its emptied tail blocks back to the region's spares).
        table = self.tables.get(req_id)
        if table:
            keep = blocks_for(num_tokens - self.dropped.get(req_id, 0), self.block_size)
            if keep < len(table):
                self.spare[req_id][:0] = table[keep:]
                del table[keep:]

    def free(self, req_id: str, *, swapped: bool = False) -> None:
        self.tables.pop(req_id, None)
        self.spare.pop(req_id, None)
        if not swapped:
            self.dropped.pop(req_id, None)
        if self.pending_shifts:
            self.pending_shifts = [s for s in self.pending_shifts if s.req_id != req_id]
        region = self.regions.pop(req_id, None)
        if region is None:
            return
        start, n = region
        i = bisect.bisect_left(self.holes, (start, 0))
        self.holes.insert(i, (start, n))
        # Merge with the neighbours so that freed space becomes usable as one region again.
        if i + 1 < len(self.holes) and self.holes[i][0] + self.holes[i][1] == self.holes[i + 1][0]:
            self.holes[i] = (self.holes[i][0], self.holes[i][1] + self.holes[i + 1][1])
            del self.holes[i + 1]
        if i > 0 and self.holes[i - 1][0] + self.holes[i - 1][1] == self.holes[i][0]:
            self.holes[i - 1] = (self.holes[i - 1][0], self.holes[i - 1][1] + self.holes[i][1])
            del self.holes[i]

    def match_prefix(self, req_id: str, prompt: list[int]) -> int:
        return 0

    def cache_blocks(self, req_id: str, tokens: Callable[[int, int], list[int]], num_final: int) -> None:
        pass

    def fork(self, parent_id: str, child_id: str) -> None:
        raise ValueError("contiguous preallocation cannot share a region; run n > 1 with the paged layout")

    def take_copies(self) -> list[tuple[int, int]]:
        return []

    def take_new_blocks(self) -> list[int]:
        out, self.new_blocks = self.new_blocks, []
        return out

    # --- statistics -------------------------------------------------------------------------------------
    def stats(self, running: Sequence[RequestExtent], next_waiting: int | None) -> KVLayoutStats:
        bs = self.block_size
        tokens = reserved = internal = 0
        for r in running:
            region = self.regions.get(r.req_id)
            res, inter = reservation_split(region[1] * bs if region else 0, r.num_tokens, r.final_tokens)
            tokens += r.num_tokens
            reserved += res
            internal += inter
        # External fragmentation: free holes too small for the reservation of the request first in
        # line (admission is first come, first served: nobody behind it is admitted first).
        external = 0
        if next_waiting is not None:
            need = blocks_for(self.reservation_tokens(next_waiting), bs)
            external = sum(n for _, n in self.holes if n < need) * bs
        free = self.num_free_blocks
        return KVLayoutStats(
            layout=self.name, block_size=bs, num_blocks=self.num_blocks, used_blocks=self.num_blocks - free,
            shared_saved_blocks=0, prefix_query_tokens=0, prefix_hit_tokens=0, token_slots=tokens,
            reserved_slots=reserved, internal_slots=internal, external_slots=external,
            free_slots=free * bs - external)

    def block_map(self, running: Sequence[RequestExtent]) -> BlockMap:
        bs = self.block_size
        owner, fill, ref = [-1] * self.num_blocks, [0] * self.num_blocks, [0] * self.num_blocks
        owners: list[str] = []
        for r in running:
            region = self.regions.get(r.req_id)
            if region is None:
                continue
            idx = len(owners)
            owners.append(r.req_id)
            table = self.tables.get(r.req_id) if self.retention is not None else None
            order = table + self.spare[r.req_id] if table is not None else range(region[0], region[0] + region[1])
            for i, bid in enumerate(order):
                b = bid - 1  # map index (block ids start at 1)
                owner[b], ref[b] = idx, 1
                fill[b] = min(bs, max(0, r.num_tokens - i * bs))
        return BlockMap(bs, tuple(owner), tuple(fill), tuple(ref), tuple(owners))

    def check_invariants(self) -> None:
        spans = sorted(list(self.regions.values()) + self.holes)
        pos = 1
        for start, n in spans:
            if start != pos or n <= 0:
                raise AssertionError(f"arena corrupt near block {pos}: span ({start}, {n})")
            pos += n
        if pos != self.num_blocks + 1:
            raise AssertionError("arena spans do not cover the pool")
        for a, b in zip(self.holes, self.holes[1:]):
            if a[0] + a[1] == b[0]:
                raise AssertionError("adjacent free holes were not merged")
        if self.retention is None:
            if self.tables or self.dropped or self.pending_shifts:
                raise AssertionError("windowed state without a retention rule")
            return
        for rid, (start, n) in self.regions.items():
            table, spare = self.tables.get(rid, []), self.spare.get(rid, [])
            if sorted(table + spare) != list(range(start, start + n)):
                raise AssertionError(f"{rid}: table and spares are not a permutation of its region")
            if n > blocks_for(self.retention.max_slots, self.block_size):
                raise AssertionError(f"{rid}: a region of {n} blocks exceeds the retention bound")
