"""Per-request block tables on top of the block pool (the paged layout).

Blocks are taken only when a token crosses into a new block and returned when a request finishes
or is preempted. Requests forked from one prompt (SamplingParams.n > 1) share its blocks by
reference count; the first write into a shared, partially filled block copies it (copy-on-write):
the copy is queued as (src, dst) for the runner to perform before the step's forward pass.
"""

from __future__ import annotations

from kvcli.kvcache.block_pool import BlockPool


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    layout = "paged"

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.tables: dict[str, list[int]] = {}
        self.pending_copies: list[tuple[int, int]] = []

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

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent (ref counts up, nothing copied yet)."""
        table = list(self.tables[parent_id])
        self.pool.incref(table)
        self.tables[child_id] = table

    def free(self, req_id: str) -> None:
        table = self.tables.pop(req_id, None)
        if table:
            self.pool.free(table)

    def take_copies(self) -> list[tuple[int, int]]:
        out, self.pending_copies = self.pending_copies, []
        return out

    def shared_saved_blocks(self) -> int:
        """Blocks not allocated thanks to sharing: sum over blocks of (ref_cnt - 1)."""
        return sum(max(0, b.ref_cnt - 1) for b in self.pool.blocks)

    def check_invariants(self) -> None:
        self.pool.check_invariants(self.tables)
