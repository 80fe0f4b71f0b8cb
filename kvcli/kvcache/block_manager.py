"""The paged layout: per-request block tables on top of the block pool (implements KVLayout).

Blocks are taken only when a token crosses into a new block and returned when a request finishes,
is preempted, or gives back slots it took ahead for guesses (`truncate`). Admission keeps a small
watermark of blocks free, so running requests can still grow. With prefix caching, every block
full of final tokens is indexed by a chained hash (the previous block's hash and this block's token
ids), and a new request starts from the longest run of its prompt's full blocks found in the index:
those tokens are not computed again. Requests forked from one prompt (SamplingParams.n > 1) share
its blocks by reference count; the first write into a shared, partially filled block copies it
(copy-on-write): the copy is queued as (src, dst) for the runner to perform before the step's
forward pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvcli.kvcache.block_pool import BlockPool
from kvcli.kvcache.interface import blocks_for
from kvcli.metrics.snapshot import BlockMap
from kvcli.metrics.stats import KVLayoutStats, RequestExtent


class PagedKVManager:
    name = "paged"
    supports_sharing = True

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True,
                 watermark: float = 0.01) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self.watermark_blocks = int(watermark * num_blocks)
        self.tables: dict[str, list[int]] = {}
        self.hashes: dict[str, list[int]] = {}  # per request: chained hashes of its full final blocks
        self.pending_copies: list[tuple[int, int]] = []
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def block_table(self, req_id: str) -> list[int]:
        return self.tables.get(req_id, [])

    def _needed(self, req_id: str, num_tokens: int) -> int:
        return max(0, blocks_for(num_tokens, self.block_size) - len(self.tables.get(req_id, ())))

    def blocks_to_admit(self, num_tokens: int, final_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def admit(self, req_id: str, num_tokens: int, num_computed: int, final_tokens: int) -> bool:
        if self._needed(req_id, num_tokens) + self.watermark_blocks > self.pool.num_free:
            return False
        return self.allocate(req_id, num_tokens, num_computed)

    def allocate(self, req_id: str, num_tokens: int, num_computed: int) -> bool:
        table = self.tables.setdefault(req_id, [])
        need = self._needed(req_id, num_tokens)
        # Copy-on-write: the block receiving the first new token is shared and already holds tokens.
        first = num_computed // self.block_size
        cow = first < len(table) and num_computed % self.block_size and self.pool.blocks[table[first]].ref_cnt > 1
        if need + (1 if cow else 0) > self.pool.num_free:
            if not table:
                del self.tables[req_id]
            return False
        if cow:
            src = table[first]
            dst = self.pool.allocate(1)[0]
            self.pool.free([src])
            table[first] = dst
            self.pending_copies.append((src, dst))
        if need:
            table.extend(self.pool.allocate(need))
        return True

    def truncate(self, req_id: str, num_tokens: int) -> None:
        table = self.tables.get(req_id)
        if not table:
            return
        keep = blocks_for(num_tokens, self.block_size)
        if keep < len(table):
            self.pool.free(table[keep:])
            del table[keep:]
        hashes = self.hashes.get(req_id)
        if hashes and len(hashes) > num_tokens // self.block_size:
            del hashes[num_tokens // self.block_size:]

    def free(self, req_id: str) -> None:
        table = self.tables.pop(req_id, None)
        self.hashes.pop(req_id, None)
        if table:
            self.pool.free(table)

    # --- prefix cache ---------------------------------------------------------------------------------
    def match_prefix(self, req_id: str, prompt: list[int]) -> int:
        """At least one prompt token is always left to compute, for its logits."""
        if not self.prefix_caching or req_id in self.tables:
            return 0
        bs = self.block_size
        self.prefix_query_tokens += len(prompt)
        hits: list[int] = []
        parent = 0
        for i in range((len(prompt) - 1) // bs):
            tokens = tuple(prompt[i * bs:(i + 1) * bs])
            h = hash((parent, tokens))
            bid = self.pool.lookup(h, tokens)
            if bid is None:
                break
            hits.append(bid)
            parent = h
        if hits:
            self.pool.incref(hits)
            self.tables[req_id] = hits
            self.prefix_hit_tokens += len(hits) * bs
        return len(hits) * bs

    def cache_blocks(self, req_id: str, tokens: Callable[[int, int], list[int]], num_final: int) -> None:
        if not self.prefix_caching:
            return
        bs = self.block_size
        table = self.tables.get(req_id, [])
        hashes = self.hashes.setdefault(req_id, [])
        for i in range(len(hashes), min(num_final // bs, len(table))):
            block_tokens = tuple(tokens(i * bs, (i + 1) * bs))
            h = hash((hashes[-1] if hashes else 0, block_tokens))
            hashes.append(h)
            self.pool.register(table[i], h, block_tokens)

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent (ref counts up, nothing copied yet)."""
        table = list(self.tables[parent_id])
        self.pool.incref(table)
        self.tables[child_id] = table
        self.hashes[child_id] = list(self.hashes.get(parent_id, []))

    def take_new_blocks(self) -> list[int]:
        return self.pool.take_new_blocks()

    def take_copies(self) -> list[tuple[int, int]]:
        out, self.pending_copies = self.pending_copies, []
        return out

    # --- statistics -------------------------------------------------------------------------------------
    def _token_slots(self, running: Sequence[RequestExtent]) -> int:
        if self.pool.extra_refs == 0:  # nothing shared: every request's tokens are its own
            return sum(r.num_tokens for r in running)
        bs = self.block_size
        fill: dict[int, int] = {}  # shared blocks hold their tokens once
        for r in running:
            for i, b in enumerate(self.block_table(r.req_id)):
                f = min(bs, max(0, r.num_tokens - i * bs))
                if f > fill.get(b, 0):
                    fill[b] = f
        return sum(fill.values())

    def stats(self, running: Sequence[RequestExtent], next_waiting: int | None) -> KVLayoutStats:
        bs = self.block_size
        used = self.num_blocks - self.pool.num_free
        tokens = self._token_slots(running)
        # Paging reserves nothing ahead and every free block is usable by anyone: no reserved
        # slots, no external fragmentation; internal = unused tails of partly filled blocks.
        return KVLayoutStats(
            layout=self.name, block_size=bs, num_blocks=self.num_blocks, used_blocks=used,
            shared_saved_blocks=self.pool.extra_refs, prefix_query_tokens=self.prefix_query_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens, token_slots=tokens, reserved_slots=0,
            internal_slots=used * bs - tokens, external_slots=0, free_slots=self.pool.num_free * bs)

    def block_map(self, running: Sequence[RequestExtent]) -> BlockMap:
        bs = self.block_size
        n = self.num_blocks + 1
        owner, fill, ref = [-1] * n, [0] * n, [0] * n
        for bid in self.pool.cached_free_ids():
            owner[bid], fill[bid] = -2, bs
        owners: list[str] = []
        for r in running:
            idx = len(owners)
            owners.append(r.req_id)
            for i, b in enumerate(self.block_table(r.req_id)):
                if owner[b] == -1:
                    owner[b] = idx
                fill[b] = max(fill[b], min(bs, max(0, r.num_tokens - i * bs)))
                ref[b] += 1
        # Entry 0 is the null block: not part of the map.
        return BlockMap(bs, tuple(owner[1:]), tuple(fill[1:]), tuple(ref[1:]), tuple(owners))

    def check_invariants(self) -> None:
        self.pool.check_invariants(self.tables)
