"""The physical KV blocks: ref counts, an O(1) free queue, and the prefix-cache index.

A block is `block_size` token slots in every layer's K and V pool. Ids run 1..num_blocks: block 0
is the null block (kvcache/interface.py), which pads block tables and is never handed out. Blocks are handed out from the
front of the free queue. A freed block that holds a full, hashed block of tokens goes to the queue's back and
stays in the index ("cached-free") until it is handed out again, so a later request with the same prefix can
take it back instead of recomputing it; the least recently freed goes first (LRU). A freed block with nothing
indexed (a partial tail, a block a bounded cache dropped, any block with prefix caching off) goes to the front:
it is handed out again before any cached prefix is evicted, and before any block never touched yet, so the pool
memory a process touches follows what it holds at once, not the pool's size (the pool is allocated
uninitialised: on the CPU its pages become resident only when first written; under a plain FIFO a 256-token
window streaming a long text walked the whole pool a block at a time and made all of it resident).

The blocks of one allocation are handed out in ascending id order: which blocks leave the queue is the
queue's (LRU) decision, where each lands in the request's table is not, and ascending ids are ascending
addresses in every layer's pool. Requests free their blocks in reverse (below), so without the sort a
prompt's chunk after another request's would get a descending table, and decode attention reads a
descending run of 16-token blocks behind the hardware prefetchers' backs: 1.16x the time of an ascending
table over 8k keys of the 1B shape's heads from memory, a random order 1.13x (2-core Xeon, 2026-12-07:
`python -m kvcli.bench attention-order`, docs/results/attention-order.txt).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvcli.kvcache.interface import NULL_BLOCK


class NoFreeBlocksError(RuntimeError):
    pass


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None  # set once the block is full and registered in the prefix index
    tokens: tuple[int, ...] = ()  # the block's token ids, compared on a hit (hashes can collide)


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks  # usable blocks; the physical pool has one more (the null block)
        self.blocks = [Block(i) for i in range(num_blocks + 1)]
        # OrderedDict as a doubly linked list: O(1) pop from the front, append, and removal by id.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks + 1))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.extra_refs = 0  # sum over blocks of (ref_cnt - 1): blocks saved by sharing
        # Blocks handed out for the first time: the runner zeroes them (the pool tensors are
        # allocated uninitialised, and attention reads padded slots of partly used blocks).
        self._fresh = bytearray(b"\x01") * (num_blocks + 1)
        self.new_blocks: list[int] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_free(self) -> int:
        return sum(1 for bid in self._free if self.blocks[bid].block_hash is not None)

    def cached_free_ids(self) -> list[int]:
        """Free blocks that still hold an indexed prefix (reusable on a hit)."""
        return [bid for bid in self.cached.values() if self.blocks[bid].ref_cnt == 0]

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocksError(f"need {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            bid, _ = self._free.popitem(last=False)
            b = self.blocks[bid]
            if b.block_hash is not None:  # evict the cached prefix this block still held
                del self.cached[b.block_hash]
                b.block_hash, b.tokens = None, ()
            b.ref_cnt = 1
            if self._fresh[bid]:
                self._fresh[bid] = 0
                self.new_blocks.append(bid)
            out.append(bid)
        return sorted(out)

    def take_new_blocks(self) -> list[int]:
        out, self.new_blocks = self.new_blocks, []
        return out

    def incref(self, block_ids: list[int]) -> None:
        """Share blocks (copy-on-write forks, prefix-cache hits)."""
        for bid in block_ids:
            b = self.blocks[bid]
            if b.ref_cnt == 0:
                del self._free[bid]
            else:
                self.extra_refs += 1
            b.ref_cnt += 1

    def free(self, block_ids: list[int]) -> None:
        # Freed in reverse so that a request's tail blocks are reused before its head blocks,
        # which keeps the head (the part other requests are likeliest to share) cached longest.
        for bid in reversed(block_ids):
            b = self.blocks[bid]
            if b.ref_cnt <= 0:
                raise AssertionError(f"block {bid} freed while not in use")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self._free[bid] = None
                if b.block_hash is None:  # nothing to keep: handed out again first (see the module docstring)
                    self._free.move_to_end(bid, last=False)
            else:
                self.extra_refs -= 1

    # --- prefix cache ---------------------------------------------------------------------------------
    def lookup(self, block_hash: int, tokens: tuple[int, ...]) -> int | None:
        bid = self.cached.get(block_hash)
        if bid is None or self.blocks[bid].tokens != tokens:
            return None
        return bid

    def register(self, block_id: int, block_hash: int, tokens: tuple[int, ...]) -> None:
        """Index a full block; the first block to hold a given prefix stays the cached one."""
        b = self.blocks[block_id]
        if b.block_hash is not None or block_hash in self.cached:
            return
        b.block_hash, b.tokens = block_hash, tokens
        self.cached[block_hash] = block_id

    def unregister(self, block_id: int) -> None:
        """Take a block out of the prefix index (its keys are about to change: a retention shift)."""
        b = self.blocks[block_id]
        if b.block_hash is not None:
            if self.cached.get(b.block_hash) == block_id:
                del self.cached[b.block_hash]
            b.block_hash, b.tokens = None, ()

    def check_invariants(self, owners: dict[str, list[int]]) -> None:
        """Every block is either free (ref 0, in the queue once) or held by exactly ref_cnt owners;
        the prefix index points at blocks that carry the indexed hash."""
        held: dict[int, int] = {}
        for blocks in owners.values():
            for bid in blocks:
                held[bid] = held.get(bid, 0) + 1
        if NULL_BLOCK in held or NULL_BLOCK in self._free:
            raise AssertionError("the null block was handed out")
        for b in self.blocks[1:]:
            in_free = b.block_id in self._free
            if b.ref_cnt != held.get(b.block_id, 0):
                raise AssertionError(f"block {b.block_id}: ref_cnt {b.ref_cnt} but {held.get(b.block_id, 0)} owners")
            if in_free != (b.ref_cnt == 0):
                raise AssertionError(f"block {b.block_id}: ref_cnt {b.ref_cnt} yet in_free={in_free}")
        if len(self._free) + len(held) != self.num_blocks:
            raise AssertionError("blocks leaked: free + held != total")
        for h, bid in self.cached.items():
            if self.blocks[bid].block_hash != h:
                raise AssertionError(f"prefix index: block {bid} does not carry hash {h}")
        if self.extra_refs != sum(max(0, b.ref_cnt - 1) for b in self.blocks):
            raise AssertionError("shared-reference counter out of step")
