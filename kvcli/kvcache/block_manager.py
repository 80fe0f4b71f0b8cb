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

With a `Retention` (kvcache/retention.py: attention sinks + a recent window, the rule and the positions
are written there) the manager also bounds each request: `allocate` drops the window's oldest whole
blocks before a step would overflow it, keeps the table compact, counts the request's dropped tokens
(`dropped_tokens`: text token t >= sink_slots sits at cache position t - D) and queues the re-rotation of
the kept keys (`take_shifts`). All counts the scheduler passes stay in text tokens (tokens of the
request's prompt + output covered); the manager converts them to cache slots.

With a `sliding_window` W (a model whose every layer attends only to its last W keys: Mistral; the span
of the widest window) positions stay true and nothing is re-rotated: a step that computes tokens from
`num_computed` on reads keys from position num_computed - W + 1 on, so every block wholly before that goes
back to the pool as the request advances, and its table entry points at the null block instead (the
table's length stays ceil(tokens / block_size), so slot = table[p // block_size] still holds for every
position; kernels skip or mask the null block's zeros, which are finite in every KV format: vLLM does the
same). A request so holds at most ceil((W - 1 + chunk) / block_size) + 1 blocks, whatever its length.
A released block keeps its prefix-index entry while it sits free: its keys are at true positions and were
computed with their whole context, so a later request with the same prefix may take it back, as from any
finished request (the chain stops at the first block handed out again since). Swap-outs copy only the
held blocks (`trim` first); a readmission points the leading entries at the null block again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvcli.kvcache.block_pool import BlockPool
from kvcli.kvcache.interface import NULL_BLOCK, blocks_for
from kvcli.kvcache.retention import KeyShift, Retention
from kvcli.metrics.snapshot import BlockMap
from kvcli.metrics.stats import KVLayoutStats, RequestExtent


def sliding_window_of(config) -> int:
    """The span a paged layout may keep per request of a model whose every layer slides (its widest window),
    or 0 when some layer attends to the whole context. `config`: a kvcli.config.ModelConfig (layer_window)."""
    windows = [config.layer_window(i) for i in range(config.num_layers)]
    return 0 if not windows or not all(windows) else max(windows)


def sliding_window_blocks(window: int, chunk: int, block_size: int) -> int:
    """The most blocks a request of a model that slides in every layer (window W) holds in the paged layout
    when it computes up to `chunk` tokens a step: keys [c - W + 1, c + chunk) span at most
    ceil((W - 1 + chunk) / block_size) + 1 blocks, whatever the request's length."""
    return blocks_for(window - 1 + chunk, block_size) + 1


class PagedKVManager:
    name = "paged"
    supports_sharing = True

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True,
                 watermark: float = 0.01, retention: Retention | None = None, sliding_window: int = 0,
                 pool: BlockPool | None = None, hash_seed: int = 0) -> None:
        if sliding_window and retention is not None:
            raise ValueError("a bounded cache (retention) and a model's sliding window do not combine")
        if sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0 (got {sliding_window})")
        self.pool = BlockPool(num_blocks) if pool is None else pool  # a pool shared by KV groups (hybrid.py)
        self.hash_seed = hash_seed  # the first block's parent hash: groups sharing a pool index apart
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self.watermark_blocks = int(watermark * num_blocks)
        self.tables: dict[str, list[int]] = {}
        self.hashes: dict[str, list[int]] = {}  # per request: chained hashes of its full final blocks
        self.pending_copies: list[tuple[int, int]] = []
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.retention = retention
        self.dropped: dict[str, int] = {}  # per windowed request: text tokens dropped (cache pos = text - D)
        self.pending_shifts: list[KeyShift] = []
        self.dropped_total = 0  # tokens dropped over the run (all requests), for the views
        self.recycled_blocks = 0  # blocks handed back by drops
        self.peak_slots = 0  # the most cache slots one request has held (measured at allocate)
        self.sliding_window = sliding_window  # W > 0: blocks wholly before every layer's window go back
        self.step_tokens: int | None = None  # the most tokens one request computes in a step (the scheduler's)
        self.peak_held_blocks = 0  # the most blocks one request has held at once (measured at allocate)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def block_table(self, req_id: str) -> list[int]:
        return self.tables.get(req_id, [])

    def group_tables(self, req_id: str) -> tuple[list[int], ...]:
        return (self.tables.get(req_id, []),)

    def _needed(self, req_id: str, num_tokens: int, num_computed: int = 0) -> int:
        """New blocks a step to `num_tokens` takes (table entries before the window are the null block)."""
        have = max(len(self.tables.get(req_id, ())), self._window_start(num_computed))
        return max(0, blocks_for(num_tokens, self.block_size) - have)

    def blocks_to_admit(self, num_tokens: int, final_tokens: int) -> int:
        if self.retention is not None:
            num_tokens = min(num_tokens, self.retention.max_slots)
        n = blocks_for(num_tokens, self.block_size)
        if self.sliding_window:
            return min(n, self.window_blocks(num_tokens if self.step_tokens is None else self.step_tokens))
        return n

    # --- a model's sliding window (true positions, blocks before the window released) --------------------
    def window_blocks(self, chunk: int) -> int:
        """The most blocks a request holds under the sliding window at up to `chunk` tokens a step."""
        return sliding_window_blocks(self.sliding_window, chunk, self.block_size)

    def _window_start(self, num_computed: int) -> int:
        """Index of the first block a step from `num_computed` reads (0 without a window)."""
        if not self.sliding_window:
            return 0
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def _release_before(self, table: list[int], start: int) -> None:
        gone = [b for b in table[:start] if b != NULL_BLOCK]
        if gone:
            for i in range(min(start, len(table))):
                table[i] = NULL_BLOCK
            self.pool.free(gone)
            self.recycled_blocks += len(gone)

    def trim(self, req_id: str, num_computed: int) -> None:
        """Release the blocks a step from `num_computed` no longer reads (a swap-out copies only the rest)."""
        table = self.tables.get(req_id)
        if table:
            self._release_before(table, self._window_start(num_computed))

    def blocks_needed(self, req_id: str, num_tokens: int, num_computed: int) -> int:
        """Blocks `allocate(req_id, num_tokens, num_computed)` takes from the pool, net of those its window gives
        back (no retention rule: a KV group's manager, kvcache/hybrid.py, asks before any group allocates)."""
        bs = self.block_size
        table = self.tables.get(req_id, [])
        start = self._window_start(num_computed)
        freed = sum(1 for b in table[:start] if b != NULL_BLOCK and self.pool.blocks[b].ref_cnt == 1)
        need = max(0, blocks_for(num_tokens, bs) - max(len(table), start))
        first = num_computed // bs
        cow = first < len(table) and num_computed % bs and table[first] != NULL_BLOCK \
            and self.pool.blocks[table[first]].ref_cnt > 1
        return need + (1 if cow else 0) - freed

    def held_blocks(self, req_id: str) -> list[int]:
        """The request's blocks that hold KV (its table without the null entries)."""
        return [b for b in self.tables.get(req_id, ()) if b != NULL_BLOCK]

    # --- retention (bounded cache) -----------------------------------------------------------------
    def dropped_tokens(self, req_id: str) -> int:
        return self.dropped.get(req_id, 0)

    def cache_position(self, req_id: str, text_index: int) -> int:
        """Where text token `text_index` (one not dropped) sits in the request's compact cache."""
        return self.retention.cache_position(text_index, self.dropped.get(req_id, 0))

    def skip(self, req_id: str, num_computed: int, num_tokens: int) -> int:
        """Rebuild: count the tokens between the sinks and the last W as dropped without computing them
        (Retention.tokens_to_skip); returns how many. Positions stay compact."""
        r = self.retention
        n = 0 if r is None else r.tokens_to_skip(self.dropped.get(req_id, 0), num_computed, num_tokens)
        if n <= 0:
            return 0
        self.dropped[req_id] = n
        self.dropped_total += n
        hashes = self.hashes.get(req_id)
        if hashes:
            del hashes[r.sink_blocks:]
        return n

    def take_shifts(self) -> list[KeyShift]:
        out, self.pending_shifts = self.pending_shifts, []
        return out

    def _drop(self, req_id: str, table: list[int], k: int, cached_computed: int, grow: int) -> bool:
        """Drop the k oldest window blocks, copy shared kept blocks, queue the kept keys' re-rotation, when
        that and `grow` more blocks (plus one for a copy-on-write of the first written block) fit in the
        pool; else change nothing and return False."""
        r = self.retention
        ns = r.sink_blocks
        gone, kept = table[ns:ns + k], table[ns + k:]
        # Kept blocks that hold computed keys move; shared ones are copied first (never rotate another's keys).
        moving = kept[:max(0, blocks_for(cached_computed - r.sink_slots, self.block_size) - k)]
        shared = [i for i, b in enumerate(moving) if self.pool.blocks[b].ref_cnt > 1]
        freed = sum(1 for b in gone if self.pool.blocks[b].ref_cnt == 1)
        cow = 1 if cached_computed % self.block_size else 0
        if len(shared) + grow + cow > self.pool.num_free + freed:
            return False
        self.pool.free(gone)
        for i in shared:
            src = moving[i]
            dst = self.pool.allocate(1)[0]
            self.pool.free([src])
            self.pending_copies.append((src, dst))
            moving[i] = kept[i] = dst
        for b in moving:
            self.pool.unregister(b)
        table[ns:] = kept
        hashes = self.hashes.get(req_id)
        if hashes:
            del hashes[ns:]
        delta = k * self.block_size
        self.dropped[req_id] = self.dropped.get(req_id, 0) + delta
        self.dropped_total += delta
        self.recycled_blocks += len(gone)
        if moving:
            self.pending_shifts.append(KeyShift(req_id, tuple(moving), delta))
        return True

    def admit(self, req_id: str, num_tokens: int, num_computed: int, final_tokens: int) -> bool:
        d = self.dropped.get(req_id, 0)
        if self._needed(req_id, num_tokens - d, num_computed - d) + self.watermark_blocks > self.pool.num_free:
            return False
        return self.allocate(req_id, num_tokens, num_computed)

    def allocate(self, req_id: str, num_tokens: int, num_computed: int) -> bool:
        table = self.tables.setdefault(req_id, [])
        d = self.dropped.get(req_id, 0)
        num_tokens, num_computed = num_tokens - d, num_computed - d  # text tokens -> cache slots
        if self.retention is not None:
            k = self.retention.blocks_to_drop(num_tokens, num_computed, len(table))
            if k:
                grow = max(0, blocks_for(num_tokens - k * self.block_size, self.block_size) - (len(table) - k))
                if not self._drop(req_id, table, k, num_computed, grow):
                    return False
                num_tokens -= k * self.block_size
                num_computed -= k * self.block_size
        start = self._window_start(num_computed)
        if start:  # a sliding window: what no step reads again goes back (true positions, nothing moves)
            self._release_before(table, start)
        self.peak_slots = max(self.peak_slots, num_tokens - start * self.block_size)
        need = max(0, blocks_for(num_tokens, self.block_size) - max(len(table), start))
        # Copy-on-write: the block receiving the first new token is shared and already holds tokens.
        first = num_computed // self.block_size
        cow = first < len(table) and num_computed % self.block_size and self.pool.blocks[table[first]].ref_cnt > 1
        if need + (1 if cow else 0) > self.pool.num_free:
            if not table:
                del self.tables[req_id]
            return False
        if len(table) < start:  # readmitted (after a swap) past the window: nothing before it is held
            table.extend([NULL_BLOCK] * (start - len(table)))
        if cow:
            src = table[first]
            dst = self.pool.allocate(1)[0]
            self.pool.free([src])
            table[first] = dst
            self.pending_copies.append((src, dst))
        if need:
            table.extend(self.pool.allocate(need))
        if self.sliding_window:
            self.peak_held_blocks = max(self.peak_held_blocks, len(table) - start)
        elif len(table) > self.peak_held_blocks:
            self.peak_held_blocks = len(table)
        return True

    def truncate(self, req_id: str, num_tokens: int) -> None:
        table = self.tables.get(req_id)
        if not table:
            return
        num_tokens -= self.dropped.get(req_id, 0)
        keep = blocks_for(num_tokens, self.block_size)
        if keep < len(table):
            self.pool.free(table[keep:])
            del table[keep:]
        hashes = self.hashes.get(req_id)
        if hashes and len(hashes) > num_tokens // self.block_size:
            del hashes[num_tokens // self.block_size:]

    def free(self, req_id: str, *, swapped: bool = False) -> None:
        """Give back every block. `swapped`: the request's blocks were copied to host memory and come back
        as they are, so its retention state (tokens dropped) is kept."""
        table = self.tables.pop(req_id, None)
        self.hashes.pop(req_id, None)
        if not swapped:
            self.dropped.pop(req_id, None)
        if self.pending_shifts:
            self.pending_shifts = [s for s in self.pending_shifts if s.req_id != req_id]
        if table:
            self.pool.free([b for b in table if b != NULL_BLOCK])

    # --- prefix cache ---------------------------------------------------------------------------------
    def match_prefix(self, req_id: str, prompt: list[int]) -> int:
        """At least one prompt token is always left to compute, for its logits."""
        if not self.prefix_caching or req_id in self.tables:
            return 0
        bs = self.block_size
        self.prefix_query_tokens += len(prompt)
        hits: list[int] = []
        parent = self.hash_seed
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
        limit = min(num_final // bs, len(table))
        if self.dropped.get(req_id):  # after a drop only the sinks are a plain prefix (kvcache/retention.py)
            limit = min(limit, self.retention.sink_blocks)
        for i in range(len(hashes), limit):
            block_tokens = tuple(tokens(i * bs, (i + 1) * bs))
            h = hash((hashes[-1] if hashes else self.hash_seed, block_tokens))
            hashes.append(h)
            if table[i] != NULL_BLOCK:  # (a block released by a sliding window was registered before)
                self.pool.register(table[i], h, block_tokens)

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent (ref counts up, nothing copied yet)."""
        table = list(self.tables[parent_id])
        self.pool.incref([b for b in table if b != NULL_BLOCK])
        self.tables[child_id] = table
        self.hashes[child_id] = list(self.hashes.get(parent_id, []))
        if parent_id in self.dropped:
            self.dropped[child_id] = self.dropped[parent_id]

    def take_new_blocks(self) -> list[int]:
        return self.pool.take_new_blocks()

    def take_copies(self) -> list[tuple[int, int]]:
        out, self.pending_copies = self.pending_copies, []
        return out

    # --- statistics -------------------------------------------------------------------------------------
    def _token_slots(self, running: Sequence[RequestExtent]) -> int:
        bs = self.block_size
        if self.pool.extra_refs == 0:  # nothing shared: every request's tokens are its own
            if not self.sliding_window:
                return sum(r.num_tokens for r in running)
            # Released blocks (null entries) hold nothing: they lead the table, each block_size tokens.
            return sum(max(0, r.num_tokens - bs * self.block_table(r.req_id).count(NULL_BLOCK)) for r in running)
        fill: dict[int, int] = {}  # shared blocks hold their tokens once
        for r in running:
            for i, b in enumerate(self.block_table(r.req_id)):
                if b == NULL_BLOCK:
                    continue
                f = min(bs, max(0, r.num_tokens - i * bs))
                if f > fill.get(b, 0):
                    fill[b] = f
        return sum(fill.values())

    def stats(self, running: Sequence[RequestExtent], next_waiting: int | None) -> KVLayoutStats:
        return pool_stats(self.name, self.pool, self.block_size, self._token_slots(running), self.prefix_query_tokens,
                          self.prefix_hit_tokens)

    def block_map(self, running: Sequence[RequestExtent]) -> BlockMap:
        return pool_block_map(self.pool, self.block_size, running, [self.block_table])

    def check_invariants(self) -> None:
        self.pool.check_invariants({rid: [b for b in t if b != NULL_BLOCK] for rid, t in self.tables.items()})
        self.check_tables()

    def check_tables(self) -> None:
        """The tables' own shape (the pool's ref counts are checked by its owner: a shared pool's, hybrid.py)."""
        for rid, table in self.tables.items():
            held = [i for i, b in enumerate(table) if b != NULL_BLOCK]
            if held and NULL_BLOCK in table[held[0]:]:
                raise AssertionError(f"{rid}: a null entry after a held block (only released blocks lead the table)")
            if NULL_BLOCK in table and not self.sliding_window:
                raise AssertionError(f"{rid}: null entries without a sliding window")
        r = self.retention
        if r is None:
            if self.dropped or self.pending_shifts:
                raise AssertionError("dropped tokens without a retention rule")
            return
        for rid, d in self.dropped.items():
            if d < 0:
                raise AssertionError(f"{rid}: negative dropped count {d}")
            hashes = self.hashes.get(rid, [])
            if d and len(hashes) > r.sink_blocks:
                raise AssertionError(f"{rid}: {len(hashes)} blocks indexed after a drop (only the sinks may be)")
        for rid, table in self.tables.items():
            if len(table) > blocks_for(r.max_slots, self.block_size):
                raise AssertionError(f"{rid}: {len(table)} blocks exceed the retention bound of "
                                     f"{blocks_for(r.max_slots, self.block_size)}")
        for sh in self.pending_shifts:
            table = self.tables.get(sh.req_id, [])
            if not set(sh.blocks) <= set(table[r.sink_blocks:]):
                raise AssertionError(f"{sh.req_id}: a key shift names blocks outside its window")
            if any(self.pool.blocks[b].ref_cnt != 1 or self.pool.blocks[b].block_hash is not None for b in sh.blocks):
                raise AssertionError(f"{sh.req_id}: a key shift would rotate a shared or indexed block")


def pool_stats(name: str, pool: BlockPool, block_size: int, token_slots: int, prefix_query_tokens: int,
               prefix_hit_tokens: int) -> KVLayoutStats:
    """A paged pool's statistics. Paging reserves nothing ahead and every free block is usable by anyone: no
    reserved slots, no external fragmentation; internal = unused tails of partly filled blocks."""
    used = pool.num_blocks - pool.num_free
    return KVLayoutStats(
        layout=name, block_size=block_size, num_blocks=pool.num_blocks, used_blocks=used,
        shared_saved_blocks=pool.extra_refs, prefix_query_tokens=prefix_query_tokens,
        prefix_hit_tokens=prefix_hit_tokens, token_slots=token_slots, reserved_slots=0,
        internal_slots=used * block_size - token_slots, external_slots=0, free_slots=pool.num_free * block_size)


def pool_block_map(pool: BlockPool, block_size: int, running: Sequence[RequestExtent],
                   tables: Sequence[Callable[[str], list[int]]], group_names: tuple[str, ...] = ()) -> BlockMap:
    """The map of a paged pool: `tables`, one per KV group (kvcache/kv_groups.py), a request's table in it; with
    `group_names`, each held block marked with its group."""
    bs = block_size
    n = pool.num_blocks + 1
    owner, fill, ref, group = [-1] * n, [0] * n, [0] * n, [0] * n
    for bid in pool.cached_free_ids():
        owner[bid], fill[bid] = -2, bs
    owners: list[str] = []
    for r in running:
        idx = len(owners)
        owners.append(r.req_id)
        for g, table_of in enumerate(tables):
            for i, b in enumerate(table_of(r.req_id)):
                if b == NULL_BLOCK:
                    continue
                if owner[b] < 0:
                    owner[b] = idx
                fill[b] = max(fill[b], min(bs, max(0, r.num_tokens - i * bs)))
                ref[b] += 1
                group[b] = g
    # Entry 0 is the null block: not part of the map.
    return BlockMap(bs, tuple(owner[1:]), tuple(fill[1:]), tuple(ref[1:]), tuple(owners),
                    group=tuple(group[1:]) if group_names else (), group_names=group_names)
