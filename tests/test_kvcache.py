"""Block pool, paged manager (copy-on-write forks) and the contiguous arena: unit and property tests,
and a simulated soak through the real scheduler."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcli.config import PRESETS, ModelConfig
from kvcli.engine.llm_engine import EngineOptions, LLMEngine
from kvcli.kvcache.block_manager import PagedKVManager
from kvcli.kvcache.block_pool import BlockPool, NoFreeBlocksError
from kvcli.kvcache.contiguous import ContiguousArena
from kvcli.kvcache.interface import NULL_BLOCK
from kvcli.metrics.stats import RequestExtent
from kvcli.profile import run_trace
from kvcli.workloads import prompt_ids, synthetic


def test_pool_reuses_blocks_with_nothing_indexed_first_and_detects_double_free():
    pool = BlockPool(5)
    a = pool.allocate(3)
    assert a == [1, 2, 3] and pool.num_free == 2  # block 0 is the null block, never handed out
    pool.register(1, 11, (7,))
    pool.free(a)  # tail first; 3 and 2 hold nothing indexed: to the front; 1 is a cached prefix: to the back
    assert pool.num_cached_free == 1
    # a block with nothing to keep goes out again before any fresh block (the pool's untouched memory) ...
    assert pool.allocate(1) == [2]
    # ... and the cached prefix last (LRU); the table gets the queue's choice in ascending order
    assert pool.allocate(3) == [3, 4, 5] and pool.lookup(11, (7,)) == 1
    assert pool.allocate(1) == [1] and pool.lookup(11, (7,)) is None  # evicted when handed out
    assert NULL_BLOCK not in pool.take_new_blocks()
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.free([2])
    with pytest.raises(AssertionError):
        pool.free([2])


def test_fork_shares_blocks_and_copies_on_first_write():
    kv = PagedKVManager(8, block_size=4)
    pool = kv.pool
    assert kv.allocate("a", 6, 0)  # blocks 1, 2 (block 2 half full)
    kv.fork("a", "b")
    assert kv.block_table("b") == kv.block_table("a") and pool.blocks[2].ref_cnt == 2
    assert kv.stats([], None).shared_saved_blocks == 2
    # b writes token 6 into the shared, partially filled block 2: it gets a private copy.
    assert kv.allocate("b", 7, num_computed=6)
    src, dst = kv.take_copies()[0]
    assert src == 2 and kv.block_table("b")[1] == dst and pool.blocks[2].ref_cnt == 1
    # a writes into block 2, now its own: no copy; block 1 stays shared.
    assert kv.allocate("a", 7, num_computed=6) and kv.take_copies() == []
    assert pool.blocks[1].ref_cnt == 2
    kv.check_invariants()
    kv.free("a")
    kv.free("b")
    assert pool.num_free == 8
    kv.check_invariants()


def test_contiguous_first_fit_merge_and_external_fragmentation():
    arena = ContiguousArena(10, block_size=16, reserve="request", max_model_len=4096)
    assert arena.admit("a", 10, 0, final_tokens=48)  # 3 blocks: 1-3
    assert arena.admit("b", 10, 0, final_tokens=64)  # 4 blocks: 4-7
    assert arena.admit("c", 10, 0, final_tokens=48)  # 3 blocks: 8-10
    assert arena.block_table("b") == [4, 5, 6, 7]
    arena.free("a")
    arena.free("c")
    # 6 blocks free in total, but in two holes of 3: a 4-block region cannot be placed.
    assert arena.num_free_blocks == 6 and arena.largest_hole() == 3
    assert not arena.admit("d", 10, 0, final_tokens=64)
    live = [RequestExtent("b", 10, 64)]
    st = arena.stats(live, next_waiting=64)
    assert st.external_slots == 6 * 16 and st.free_slots == 0  # both holes are useless to "d"
    assert arena.stats(live, next_waiting=48).external_slots == 0  # "e" fits a hole
    arena.free("b")  # holes merge back into one
    assert arena.holes == [(1, 10)]
    assert arena.admit("d", 10, 0, final_tokens=160)
    arena.check_invariants()


def test_contiguous_reservations_max_len_vs_request():
    max_len = ContiguousArena(20, block_size=16, reserve="max-len", max_model_len=160)
    per_request = ContiguousArena(20, block_size=16, reserve="request", max_model_len=160)
    assert max_len.admit("a", 10, 0, final_tokens=40) and len(max_len.block_table("a")) == 10
    assert per_request.admit("a", 10, 0, final_tokens=40) and len(per_request.block_table("a")) == 3
    # Token states 10, reserved up to the final length 40, internal the rest of the region.
    st = max_len.stats([RequestExtent("a", 10, 40)], None)
    assert (st.token_slots, st.reserved_slots, st.internal_slots) == (10, 30, 160 - 40)
    # The region is a hard cap: growth inside it is free, beyond it is refused.
    assert per_request.allocate("a", 48, 40) and not per_request.allocate("a", 49, 48)


def test_paged_slots_ahead_are_given_back():
    """Speculation's contract: slots for guessed tokens are allocated ahead and given back on rejection;
    a block emptied by the rejection returns to the pool, and only final tokens are indexed."""
    kv = PagedKVManager(8, block_size=4)
    assert kv.allocate("a", 5, 0)  # 5 accepted tokens: 2 blocks
    assert kv.allocate("a", 5 + 4, 5)  # 4 guesses: a third block
    assert len(kv.block_table("a")) == 3 and kv.num_free_blocks == 5
    toks = list(range(100, 109))
    kv.truncate("a", 6)  # one guess accepted: the third block is empty again
    assert len(kv.block_table("a")) == 2 and kv.num_free_blocks == 6
    kv.cache_blocks("a", lambda s, e: toks[s:e], 6)  # 6 final tokens: one full block indexed
    assert len(kv.hashes["a"]) == 1
    kv.truncate("a", 3)  # rolling back into an indexed block drops its hash from the request
    assert kv.hashes["a"] == [] and len(kv.block_table("a")) == 1
    kv.check_invariants()


ops = st.lists(st.tuples(st.sampled_from(["alloc", "grow", "fork", "free", "preempt", "truncate"]),
                         st.integers(0, 5), st.integers(1, 40)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_paged_manager_invariants_hold_under_random_operations(seq):
    kv = PagedKVManager(24, block_size=4)
    pool = kv.pool
    tokens: dict[str, int] = {}
    for op, who, n in seq:
        rid = f"r{who}"
        if op == "alloc" and rid not in tokens:
            if kv.admit(rid, n, 0, n):
                tokens[rid] = n
        elif op == "grow" and rid in tokens:
            if kv.allocate(rid, tokens[rid] + n, num_computed=tokens[rid]):
                tokens[rid] += n
            kv.take_copies()
        elif op == "fork" and rid in tokens:
            child = f"{rid}f{n}"
            if child not in tokens:
                kv.fork(rid, child)
                tokens[child] = tokens[rid]
        elif op == "truncate" and rid in tokens:
            tokens[rid] = max(1, tokens[rid] - n)
            kv.truncate(rid, tokens[rid])
        elif op in ("free", "preempt") and rid in tokens:
            kv.free(rid)
            del tokens[rid]
        kv.check_invariants()
        for r, t in tokens.items():  # every request's table covers its tokens, and no more blocks
            assert len(kv.block_table(r)) * 4 >= t
            assert NULL_BLOCK not in kv.block_table(r)
    for r in list(tokens):
        kv.free(r)
    kv.check_invariants()
    assert pool.num_free == 24


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 7), st.integers(1, 6)), max_size=50))
def test_contiguous_arena_invariants_hold_under_random_operations(seq):
    arena = ContiguousArena(20, block_size=1, reserve="request", max_model_len=64)
    live: set[str] = set()
    for is_alloc, who, size in seq:
        rid = f"r{who}"
        if is_alloc and rid not in live:
            if arena.admit(rid, 1, 0, final_tokens=size):
                live.add(rid)
        elif not is_alloc and rid in live:
            arena.free(rid)
            live.discard(rid)
        arena.check_invariants()
        assert arena.num_free_blocks == 20 - sum(arena.regions[r][1] for r in live)


def small_engine(layout: str, num_blocks: int, preempt: str = "recompute", **kw) -> LLMEngine:
    cfg = ModelConfig.from_hf_dict(PRESETS["smollm2-135m"], name="sim")
    per_block = cfg.kv_bytes_per_token(torch.float16) * 16
    # One block more than asked for: the null block comes out of the same budget.
    opts = EngineOptions(block_size=16, kv_budget=str((num_blocks + 1) * per_block), max_model_len=2048,
                         kv_layout=layout, preempt=preempt, kv_dtype="fp16", **kw)
    return LLMEngine(None, opts, config=cfg)


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_soak_1000_simulated_requests_in_a_tiny_pool(preempt):
    trace = synthetic("sharegpt", 1000, 2048, seed=7)
    # About three requests' worth of blocks at the trace's mean length (and room for the longest).
    per_req = -(-int(trace.mean_prompt + trace.mean_output) // 16)
    longest = max(-(-(t.prompt_len + t.max_tokens) // 16) for t in trace.requests)
    engine = small_engine("paged", max(3 * per_req, longest + 2), preempt, max_num_seqs=64)
    res = run_trace(engine, trace, prompt_ids(trace, None), "soak", check_invariants=True)
    assert res.completed == 1000
    assert all(len(engine.requests[r].output_token_ids) == t.max_tokens
               for r, t in zip(res.outputs, trace.requests))
    assert engine.kv.num_free_blocks == engine.num_blocks  # nothing leaked
    assert res.preemptions > 0  # the pool really was under pressure
    engine.kv.check_invariants()


def test_simulated_paged_vs_contiguous_breakdown():
    trace = synthetic("sharegpt", 300, 2048, seed=3)
    results = {}
    for layout in ("paged", "contiguous"):
        engine = small_engine(layout, 600, max_num_seqs=256)
        results[layout] = run_trace(engine, trace, prompt_ids(trace, None), layout, check_invariants=True)
    paged, contig = results["paged"], results["contiguous"]
    assert paged.token_share_of_allocated >= 0.98
    assert contig.share("token_bytes") <= 0.40
    assert paged.peak_running >= 4 * contig.peak_running
    assert contig.share("external_bytes") > 0
    assert paged.completed == contig.completed == 300


def test_request_larger_than_the_pool_ends_instead_of_looping():
    engine = small_engine("paged", 4)  # 64 tokens of KV
    from kvcli.config import SamplingParams

    req = engine.add_request([5] * 40, SamplingParams(max_tokens=100, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert req.finish_reason == "kv_budget" and req.num_computed_tokens == 64  # the pool, full
    assert engine.kv.num_free_blocks == 4


def test_prefix_cache_hits_full_blocks_and_evicts_lru():
    kv = PagedKVManager(6, block_size=4)
    pool = kv.pool
    a = list(range(100, 111))  # 11 tokens: two full blocks + 3
    assert kv.match_prefix("a", a) == 0
    assert kv.allocate("a", 11, 0)
    kv.cache_blocks("a", lambda s, e: a[s:e], 11)
    kv.free("a")  # its two full blocks stay indexed, cached-free
    assert pool.num_free == 6 and pool.num_cached_free == 2
    # Same first block, different second block: one block hit.
    b = a[:4] + [7, 7, 7, 7, 9]
    assert kv.match_prefix("b", b) == 4
    assert kv.block_table("b")[0] == kv.block_table("b")[0] and pool.blocks[kv.block_table("b")[0]].ref_cnt == 1
    # A prompt made only of cached blocks still leaves its last token to compute.
    assert kv.match_prefix("c", a[:8]) == 4
    kv.check_invariants()
    kv.free("b")
    kv.free("c")
    assert kv.prefix_hit_tokens == 8 and kv.prefix_query_tokens == 11 + 9 + 8
    # Filling the pool evicts the cached blocks (least recently freed first) and clears the index.
    assert kv.allocate("d", 24, 0)
    assert pool.cached == {} and kv.match_prefix("e", a) == 0
    kv.check_invariants()


def test_prefix_hit_compares_tokens_not_only_hashes():
    kv = PagedKVManager(4, block_size=2)
    pool = kv.pool
    assert kv.allocate("a", 3, 0)
    kv.cache_blocks("a", lambda s, e: [1, 2, 3][s:e], 3)
    kv.free("a")
    h = next(iter(pool.cached))
    pool.blocks[pool.cached[h]].tokens = (9, 9)  # as if another prefix collided on this hash
    assert kv.match_prefix("b", [1, 2, 3]) == 0
