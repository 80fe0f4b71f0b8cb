"""Per-request block tables on top of the block pool (the paged layout).

Blocks are taken only when a token crosses into a new block and returned when a request finishes
or is preempted. With prefix caching, every full block is indexed by a chained hash (the previous
block's hash and this block's token ids), and a new request starts from the longest run of its
prompt's full blocks found in the index: those tokens are not computed again. Requests forked from one prompt (SamplingParams.n > 1) share its blocks by
reference count; the first write into a shared, partially filled block copies it (copy-on-write):
the copy is queued as (src, dst) for the runner to perform before the step's forward pass.
"""

from __future__ import annotations

from collections.abc import Callable

from kvcli.kvcache.block_pool import BlockPool


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    layout = "paged"

    def __init__(self, pool: BlockPool, block_size: int, prefix_caching: bool = True) -> None:
        self.pool = pool
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.tables: dict[str, list[int]] = {}
        self.hashes: dict[str, list[int]] = {}  # per request: chained hashes of its full blocks
        self.pending_copies: list[tuple[int, int]] = []
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def block_table(self, req_id: str) -> list[int]:
        return self.tables.get(req_id, [])

    def num_blocks_needed(self, req_id: str, num_tokens: int) -> int:
        """Extra blocks to hold `num_tokens` tokens in total for this request."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(self.tables.get(req_id, ())))

    def reserved_slots(self, req_id: str) -> int:
        return len(self.tables.get(req_id, ())) * self.block_size

    def allocate(self, req_id: str, num_tokens: int, num_computed: int = 0, reserve_tokens: int = 0) -> bool:
        """Make the request's table hold `num_tokens` tokens, tokens from `num_computed` on being
        written this step. False (and no change) if the pool cannot supply the blocks.
        `reserve_tokens` is for contiguous layouts; paging reserves nothing ahead."""
        table = self.tables.setdefault(req_id, [])
        need = self.num_blocks_needed(req_id, num_tokens)
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

    # --- prefix cache ---------------------------------------------------------------------------------
    def match_prefix(self, req_id: str, prompt: list[int]) -> int:
        """Take the cached blocks for the longest indexed prefix of a new request's prompt; returns
        the number of tokens they hold (at least one prompt token is always left to compute, for
        its logits)."""
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

    def cache_blocks(self, req_id: str, tokens: Callable[[int, int], list[int]], num_computed: int) -> None:
        """Index the request's blocks that are full of computed tokens; `tokens(start, end)` gives
        the request's token ids, asked for only when a block has filled."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        table = self.tables.get(req_id, [])
        hashes = self.hashes.setdefault(req_id, [])
        for i in range(len(hashes), min(num_computed // bs, len(table))):
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

    def free(self, req_id: str) -> None:
        table = self.tables.pop(req_id, None)
        self.hashes.pop(req_id, None)
        if table:
            self.pool.free(table)

    def take_new_blocks(self) -> list[int]:
        return self.pool.take_new_blocks()

    def take_copies(self) -> list[tuple[int, int]]:
        out, self.pending_copies = self.pending_copies, []
        return out

    def shared_saved_blocks(self) -> int:
        """Blocks not allocated thanks to sharing: sum over blocks of (ref_cnt - 1)."""
        return self.pool.extra_refs

    def check_invariants(self) -> None:
        self.pool.check_invariants(self.tables)
