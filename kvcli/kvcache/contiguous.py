"""Contiguous preallocation, for comparison with paging under the same KV budget.

Each admitted request reserves one contiguous region of the pool up front — max_model_len slots
(`--reserve max-len`, like systems that preallocate for the longest possible output) or its prompt
plus max_tokens (`--reserve request`) — from a real arena: first fit over a sorted list of free
holes, merged on release. A request whose region fits in no single hole waits, even when enough
memory is free in total, so external fragmentation happens, it is not computed. Regions are
rounded up to whole blocks so the same paged kernels read them (the block table of a region is a
run of consecutive block ids).
"""

from __future__ import annotations

import bisect

from kvcli.kvcache.block_manager import blocks_for


class ContiguousAllocator:
    layout = "contiguous"

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.holes: list[tuple[int, int]] = [(0, num_blocks)]  # (start, length), sorted by start
        self.regions: dict[str, tuple[int, int]] = {}
        self.tables: dict[str, list[int]] = {}  # same shape as the paged manager's, for invariants
        self.pending_copies: list[tuple[int, int]] = []
        self._fresh = bytearray(b"\x01") * num_blocks  # never handed out: the runner zeroes them
        self.new_blocks: list[int] = []

    @property
    def num_free_blocks(self) -> int:
        return sum(n for _, n in self.holes)

    def largest_hole(self) -> int:
        return max((n for _, n in self.holes), default=0)

    def block_table(self, req_id: str) -> list[int]:
        return self.tables.get(req_id, [])

    def reserved_slots(self, req_id: str) -> int:
        r = self.regions.get(req_id)
        return r[1] * self.block_size if r else 0

    def num_blocks_needed(self, req_id: str, num_tokens: int) -> int:
        if req_id in self.regions:
            return 0
        return blocks_for(num_tokens, self.block_size)

    def allocate(self, req_id: str, num_tokens: int, num_computed: int = 0, reserve_tokens: int = 0) -> bool:
        region = self.regions.get(req_id)
        if region is not None:
            # Growth inside the reservation is free; beyond it the request must stop (the engine
            # caps requests at their reservation).
            return blocks_for(num_tokens, self.block_size) <= region[1]
        n = blocks_for(max(num_tokens, reserve_tokens), self.block_size)
        for i, (start, length) in enumerate(self.holes):
            if length >= n:
                if length == n:
                    del self.holes[i]
                else:
                    self.holes[i] = (start + n, length - n)
                self.regions[req_id] = (start, n)
                self.tables[req_id] = list(range(start, start + n))
                for b in range(start, start + n):
                    if self._fresh[b]:
                        self._fresh[b] = 0
                        self.new_blocks.append(b)
                return True
        return False

    def free(self, req_id: str) -> None:
        region = self.regions.pop(req_id, None)
        self.tables.pop(req_id, None)
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
        return 0  # regions are private: no prefix sharing in this layout

    def cache_blocks(self, req_id: str, tokens, num_computed: int) -> None:
        pass

    def fork(self, parent_id: str, child_id: str) -> None:
        raise NotImplementedError("contiguous preallocation cannot share a region; run n > 1 paged")

    def take_copies(self) -> list[tuple[int, int]]:
        return []

    def take_new_blocks(self) -> list[int]:
        out, self.new_blocks = self.new_blocks, []
        return out

    def shared_saved_blocks(self) -> int:
        return 0

    def check_invariants(self) -> None:
        spans = sorted(list(self.regions.values()) + self.holes)
        pos = 0
        for start, n in spans:
            if start != pos or n <= 0:
                raise AssertionError(f"arena corrupt near block {pos}: span ({start}, {n})")
            pos += n
        if pos != self.num_blocks:
            raise AssertionError("arena spans do not cover the pool")
        for a, b in zip(self.holes, self.holes[1:]):
            if a[0] + a[1] == b[0]:
                raise AssertionError("adjacent free holes were not merged")
