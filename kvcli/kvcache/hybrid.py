"""The paged layout with one block table per KV group (implements KVLayout): Gemma 2 / 3's windowed layers
hold only their window's blocks while the global layers hold the whole context (kvcache/kv_groups.py).

One `PagedKVManager` per group, all drawing from one `BlockPool` (pages of equal size): the global group's
manager keeps every block, a windowed group's manager gives back the blocks wholly before its window as
the request advances (true positions: nothing moves, the table's leading entries become the null block).
This class only composes them, in one place per decision:

- **Admission and growth are all-or-nothing.** A step's blocks are counted over every group (net of what
  the windows give back) before any group takes one, so a request never holds one group's blocks for a
  step another group cannot take (`admit` also keeps the watermark free).
- **Prefix caching**: each group indexes its own blocks (its hashes seeded by the group, so one pool's
  index never hands a global layer's page to a windowed table); a new request takes the prefix every group
  still has, the shortest of the groups' hits, and gives back the rest.
- **Swaps and forks** work on every group's blocks: `held_blocks` lists them group after group, in the
  order a swap-in's fresh blocks come back.
- The request's main `block_table` is the first group's (the global layers'); the runner takes every
  group's table from `group_tables`.
A bounded cache (--kv-window: a retention rule re-rotates kept keys) keeps one table for every layer (the
plain PagedKVManager): it bounds every layer alike, and its compact positions are the same for all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvcli.kvcache.block_manager import PagedKVManager, pool_block_map, pool_stats, sliding_window_blocks
from kvcli.kvcache.block_pool import BlockPool
from kvcli.kvcache.interface import NULL_BLOCK
from kvcli.kvcache.kv_groups import KVGroups
from kvcli.metrics.snapshot import BlockMap
from kvcli.metrics.stats import KVLayoutStats, RequestExtent


class HybridKVManager:
    name = "paged"
    supports_sharing = True
    retention = None

    def __init__(self, num_blocks: int, block_size: int, groups: KVGroups, *, prefix_caching: bool = True,
                 watermark: float = 0.01) -> None:
        if not groups.hybrid:
            raise ValueError("a hybrid layout needs two KV groups or more (one: PagedKVManager)")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_groups = groups
        self.watermark_blocks = int(watermark * num_blocks)
        self.managers = [PagedKVManager(num_blocks, block_size, prefix_caching=prefix_caching, watermark=0.0,
                                        sliding_window=g.window, pool=self.pool, hash_seed=i)
                         for i, g in enumerate(groups.groups)]
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.peak_held_blocks = 0  # the most blocks one request has held at once, every group counted

    # --- what the scheduler and the views read ---------------------------------------------------------
    @property
    def sliding_window(self) -> int:
        """The widest window of a group (the scheduler trims windowed tables before a swap)."""
        return max(g.window for g in self.kv_groups.groups)

    @property
    def step_tokens(self) -> int | None:
        return self.managers[0].step_tokens

    @step_tokens.setter
    def step_tokens(self, n: int | None) -> None:
        for m in self.managers:
            m.step_tokens = n

    @property
    def recycled_blocks(self) -> int:
        return sum(m.recycled_blocks for m in self.managers)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def block_table(self, req_id: str) -> list[int]:
        return self.managers[0].block_table(req_id)

    def group_tables(self, req_id: str) -> tuple[list[int], ...]:
        return tuple(m.block_table(req_id) for m in self.managers)

    def held_blocks(self, req_id: str) -> list[int]:
        return [b for m in self.managers for b in m.held_blocks(req_id)]

    def dropped_tokens(self, req_id: str) -> int:
        return 0

    def cache_position(self, req_id: str, text_index: int) -> int:
        return text_index

    def skip(self, req_id: str, num_computed: int, num_tokens: int) -> int:
        return 0

    def take_shifts(self) -> list:
        return []

    # --- blocks ---------------------------------------------------------------------------------------
    def blocks_to_admit(self, num_tokens: int, final_tokens: int) -> int:
        return sum(m.blocks_to_admit(num_tokens, final_tokens) for m in self.managers)

    def window_blocks(self, chunk: int) -> int:
        """The most blocks a request holds in the windowed groups at up to `chunk` tokens a step."""
        return sum(sliding_window_blocks(g.window, chunk, self.block_size) for g in self.kv_groups.groups if g.window)

    def _fits(self, req_id: str, num_tokens: int, num_computed: int, reserve: int) -> bool:
        need = sum(m.blocks_needed(req_id, num_tokens, num_computed) for m in self.managers)
        return need + reserve <= self.pool.num_free

    def _grow(self, req_id: str, num_tokens: int, num_computed: int) -> None:
        for m in self.managers:  # the windows give back first, then every group takes what it needs
            m.trim(req_id, num_computed)
        for m in self.managers:
            if not m.allocate(req_id, num_tokens, num_computed):
                raise AssertionError(f"{req_id}: a KV group could not take the blocks counted for it")
        held = sum(len(m.held_blocks(req_id)) for m in self.managers)
        self.peak_held_blocks = max(self.peak_held_blocks, held)

    def admit(self, req_id: str, num_tokens: int, num_computed: int, final_tokens: int) -> bool:
        if not self._fits(req_id, num_tokens, num_computed, self.watermark_blocks):
            return False
        self._grow(req_id, num_tokens, num_computed)
        return True

    def allocate(self, req_id: str, num_tokens: int, num_computed: int) -> bool:
        if not self._fits(req_id, num_tokens, num_computed, 0):
            return False
        self._grow(req_id, num_tokens, num_computed)
        return True

    def trim(self, req_id: str, num_computed: int) -> None:
        for m in self.managers:
            m.trim(req_id, num_computed)

    def truncate(self, req_id: str, num_tokens: int) -> None:
        for m in self.managers:
            m.truncate(req_id, num_tokens)

    def free(self, req_id: str, *, swapped: bool = False) -> None:
        for m in self.managers:
            m.free(req_id, swapped=swapped)

    def fork(self, parent_id: str, child_id: str) -> None:
        for m in self.managers:
            m.fork(parent_id, child_id)

    def take_new_blocks(self) -> list[int]:
        return self.pool.take_new_blocks()

    def take_copies(self) -> list[tuple[int, int]]:
        return [c for m in self.managers for c in m.take_copies()]

    # --- prefix cache ---------------------------------------------------------------------------------
    def match_prefix(self, req_id: str, prompt: list[int]) -> int:
        if not self.managers[0].prefix_caching or req_id in self.managers[0].tables:
            return 0
        self.prefix_query_tokens += len(prompt)
        hits = [m.match_prefix(req_id, prompt) for m in self.managers]
        hit = min(hits)
        for m, h in zip(self.managers, hits):
            if h > hit:  # the prefix every group still holds; the longer hits go back (cached-free again)
                m.truncate(req_id, hit)
            if not m.tables.get(req_id, True):
                del m.tables[req_id]
        self.prefix_hit_tokens += hit
        return hit

    def cache_blocks(self, req_id: str, tokens: Callable[[int, int], list[int]], num_final: int) -> None:
        for m in self.managers:
            m.cache_blocks(req_id, tokens, num_final)

    # --- statistics -------------------------------------------------------------------------------------
    def stats(self, running: Sequence[RequestExtent], next_waiting: int | None) -> KVLayoutStats:
        """As the plain paged layout's, over the one pool: every group's token slots (each a page of `slots`
        layers, so slots and bytes stay proportional)."""
        tokens = sum(m._token_slots(running) for m in self.managers)
        return pool_stats(self.name, self.pool, self.block_size, tokens, self.prefix_query_tokens,
                          self.prefix_hit_tokens)

    def block_map(self, running: Sequence[RequestExtent]) -> BlockMap:
        """The plain map over the one pool, each held block marked with its group (the view draws the windowed
        groups' blocks apart from the global ones)."""
        names = tuple(f"W {g.window:,}" if g.window else "global" for g in self.kv_groups.groups)
        return pool_block_map(self.pool, self.block_size, running, [m.block_table for m in self.managers], names)

    def check_invariants(self) -> None:
        owners = {f"{rid} (group {g})": [b for b in t if b != NULL_BLOCK]
                  for g, m in enumerate(self.managers) for rid, t in m.tables.items()}
        self.pool.check_invariants(owners)
        rids = set(self.managers[0].tables)
        for g, m in enumerate(self.managers):
            if set(m.tables) != rids:
                raise AssertionError(f"group {g} holds tables for {sorted(set(m.tables) ^ rids)} and group 0 not")
            m.check_tables()
        for rid in rids:  # windowed tables keep their length (null entries lead): all cover the same tokens
            lens = {len(m.tables[rid]) for m in self.managers}
            if len(lens) > 1:
                raise AssertionError(f"{rid}: the groups' tables cover different token counts {sorted(lens)}")
