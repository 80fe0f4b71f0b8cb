"""The physical KV blocks: ref counts and an O(1) free queue.

A block is `block_size` token slots in every layer's K and V pool. Blocks are handed out from the
front of the free queue and returned to its back, so the least recently freed block is reused first
(which is what keeps cached prefixes alive longest once prefix caching keeps hashes on free blocks).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


class NoFreeBlocksError(RuntimeError):
    pass


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # OrderedDict as a doubly linked list: O(1) pop from the front, append, and removal by id.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocksError(f"need {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            bid, _ = self._free.popitem(last=False)
            self.blocks[bid].ref_cnt = 1
            out.append(bid)
        return out

    def incref(self, block_ids: list[int]) -> None:
        """Share blocks (copy-on-write forks, prefix hits)."""
        for bid in block_ids:
            b = self.blocks[bid]
            if b.ref_cnt == 0:
                del self._free[bid]
            b.ref_cnt += 1

    def free(self, block_ids: list[int]) -> None:
        # Freed in reverse so that a request's tail blocks are reused before its head blocks.
        for bid in reversed(block_ids):
            b = self.blocks[bid]
            if b.ref_cnt <= 0:
                raise AssertionError(f"block {bid} freed while not in use")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self._free[bid] = None

    def check_invariants(self, owners: dict[str, list[int]]) -> None:
        """Every block is either free (ref 0, in the queue once) or held by exactly ref_cnt owners."""
        held: dict[int, int] = {}
        for blocks in owners.values():
            for bid in blocks:
                held[bid] = held.get(bid, 0) + 1
        for b in self.blocks:
            in_free = b.block_id in self._free
            if b.ref_cnt != held.get(b.block_id, 0):
                raise AssertionError(f"block {b.block_id}: ref_cnt {b.ref_cnt} but {held.get(b.block_id, 0)} owners")
            if in_free != (b.ref_cnt == 0):
                raise AssertionError(f"block {b.block_id}: ref_cnt {b.ref_cnt} yet in_free={in_free}")
        if len(self._free) + len(held) != self.num_blocks:
            raise AssertionError("blocks leaked: free + held != total")
