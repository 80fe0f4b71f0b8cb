"""The bounded KV cache under contiguous preallocation (issue #27, item 1): a windowed request reserves the
retention bound (sink slots + W + one block), not the context, and inside that region it follows the paged
layout's rule exactly: the same tables' lengths, dropped counts, cache positions and key shifts, and on the
bundled model the same greedy tokens as the paged layout."""

from __future__ import annotations

import pytest

from kvcli.config import SamplingParams
from kvcli.engine.llm_engine import LLMEngine
from kvcli.kvcache.block_manager import PagedKVManager
from kvcli.kvcache.contiguous import ContiguousArena
from kvcli.kvcache.interface import blocks_for
from kvcli.kvcache.retention import Retention
from kvcli.model.loader import load_config, load_weights
from kvcli.options import EngineOptions

BS = 4


@pytest.mark.parametrize("reserve", ["max-len", "request"])
@pytest.mark.parametrize(("sinks", "window", "chunk"), [(4, 10, 3), (0, 8, 1), (5, 9, 9), (4, 12, 7)])
def test_a_region_of_the_bound_follows_the_paged_rule(sinks, window, chunk, reserve):
    r = Retention(sinks, window, BS)
    paged = PagedKVManager(64, BS, retention=r, prefix_caching=False)
    arena = ContiguousArena(64, BS, reserve=reserve, max_model_len=128, retention=r)
    computed = 0
    assert paged.admit("a", chunk, 0, 500) and arena.admit("a", chunk, 0, 500)
    region = arena.regions["a"]
    assert region[1] == blocks_for(r.max_slots, BS) == arena.blocks_to_admit(500, 500)
    while computed < 200:
        n = min(chunk, window)
        if computed:
            assert paged.allocate("a", computed + n, computed) and arena.allocate("a", computed + n, computed)
        computed += n
        pt, at = paged.block_table("a"), arena.block_table("a")
        assert len(at) == len(pt) and set(at) <= set(range(region[0], region[0] + region[1]))
        assert arena.dropped_tokens("a") == paged.dropped_tokens("a")
        ps, as_ = paged.take_shifts(), arena.take_shifts()
        assert [(s.delta, len(s.blocks)) for s in ps] == [(s.delta, len(s.blocks)) for s in as_]
        for s in as_:
            assert set(s.blocks) <= set(at[r.sink_blocks:])
        assert arena.cache_position("a", computed - 1) == paged.cache_position("a", computed - 1)
        arena.check_invariants()
    assert arena.dropped_total > 0 and arena.recycled_blocks > 0
    assert arena.regions["a"] == region  # the reservation never moved or grew
    assert arena.peak_slots == paged.peak_slots <= r.max_slots
    arena.truncate("a", computed - 2)  # rejected guesses give their tail back to the region's spares
    arena.check_invariants()
    arena.free("a")
    assert arena.num_free_blocks == 64 and not arena.dropped and not arena.tables
    arena.check_invariants()


def test_windowed_reservations_admit_more_requests_than_the_context_would():
    cfg = load_config("dummy:smollm2-135m")
    e = LLMEngine(None, EngineOptions(kv_window=100, max_model_len=2048, kv_layout="contiguous",
                                      kv_budget="24MiB", max_num_seqs=16), config=cfg)
    assert e.kv.blocks_to_admit(5000, 6000) == blocks_for(e.retention.max_slots, 16)
    reqs = [e.add_request(list(range(1, 400 + 11 * i)), SamplingParams(max_tokens=120, ignore_eos=True))
            for i in range(6)]
    peak = 0
    while e.has_unfinished():
        e.step()
        e.kv.check_invariants()
        peak = max(peak, len(e.scheduler.running))
    # 6 regions of the bound fit a pool where not even 2 context-long regions would.
    assert e.kv.num_blocks < 2 * blocks_for(2048, 16) and peak == 6
    assert all(len(r.output_token_ids) == 120 and r.dropped_tokens > 0 for r in reqs)


@pytest.mark.slow
def test_contiguous_and_paged_windows_decode_the_same_tokens(sample_text):
    loaded = load_weights(None)
    ids = loaded.tokenizer.encode(sample_text)[:500]
    out, model = {}, None
    for layout in ("paged", "contiguous"):
        e = LLMEngine(loaded, EngineOptions(kv_window=120, max_model_len=256, kv_budget="16MiB", kv_dtype="fp32",
                                            kv_layout=layout, max_num_batched_tokens=64), model=model)
        model = e.model
        req = e.add_request(ids, SamplingParams(max_tokens=24, ignore_eos=True))
        while e.has_unfinished():
            e.step()
        assert req.dropped_tokens > 300
        out[layout] = req.output_token_ids
    assert out["contiguous"] == out["paged"]
