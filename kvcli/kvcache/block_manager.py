"""Per-request block tables on top of the block pool: blocks are taken as tokens arrive and
returned when a request finishes or is preempted."""

from __future__ import annotations

from kvcli.kvcache.block_pool import BlockPool


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.tables: dict[str, list[int]] = {}

    def block_table(self, req_id: str) -> list[int]:
        return self.tables.get(req_id, [])

    def num_blocks_needed(self, req_id: str, num_tokens: int) -> int:
        """Extra blocks to hold `num_tokens` tokens in total for this request."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(self.tables.get(req_id, ())))

    def allocate(self, req_id: str, num_tokens: int) -> bool:
        """Grow the request's table to hold `num_tokens` tokens; False (and no change) if the pool
        cannot supply the blocks."""
        need = self.num_blocks_needed(req_id, num_tokens)
        if need > self.pool.num_free:
            return False
        table = self.tables.setdefault(req_id, [])
        if need:
            table.extend(self.pool.allocate(need))
        return True

    def free(self, req_id: str) -> None:
        table = self.tables.pop(req_id, None)
        if table:
            self.pool.free(table)

    def check_invariants(self) -> None:
        self.pool.check_invariants(self.tables)
