"""The bounded KV cache (issue #27, kvcache/retention.py): attention sinks + a recent window, owned by the
paged layout. Block-table invariants and the bound, prefix-cache and sharing rules, key re-rotation against
keys computed at the shifted positions, and the bundled model: windowed == plain before any drop, kept keys
== keys recomputed at compact positions after drops, a rebuild == a plain run over sinks + window."""

from __future__ import annotations

import pytest
import torch

from kvcli.config import SamplingParams
from kvcli.engine.llm_engine import LLMEngine
from kvcli.kvcache.block_manager import PagedKVManager
from kvcli.kvcache.kv_cache import KVCache
from kvcli.kvcache.kv_dtype import dequantize
from kvcli.kvcache.retention import Retention
from kvcli.model.layers import Rotary
from kvcli.model.loader import load_config, load_weights
from kvcli.options import ConfigError, EngineOptions

BS = 4


def tokens(req_len: int):
    return lambda a, b: list(range(a, b))


# --- the layout ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("sinks", "window", "chunk"), [(4, 10, 3), (0, 8, 1), (5, 9, 9), (1, 4, 4), (4, 12, 7)])
def test_streaming_keeps_sinks_and_window_within_the_bound(sinks, window, chunk):
    r = Retention(sinks, window, BS)
    kv = PagedKVManager(64, BS, retention=r)
    computed = 0
    sink_table = None
    dropped_seen = 0
    while computed < 200:
        n = min(chunk, window)
        assert kv.allocate("a", computed + n, computed)
        table = kv.block_table("a")
        if sink_table is None and len(table) >= r.sink_blocks:
            sink_table = table[:r.sink_blocks]
        if sink_table is not None:
            assert table[:r.sink_blocks] == sink_table  # the sink blocks never move
        computed += n
        d = kv.dropped_tokens("a")
        held = computed - d
        assert held <= r.max_slots == r.sink_slots + window + BS - 1
        assert d % BS == 0 and d >= dropped_seen
        if d:
            assert held - r.sink_slots >= window  # the window is never cut below W
        for shift in kv.take_shifts():
            assert shift.delta == d - dropped_seen and set(shift.blocks) <= set(table[r.sink_blocks:])
        dropped_seen = d
        assert len(table) == -(-held // BS)  # compact: no holes
        kv.cache_blocks("a", tokens(computed), computed)
        kv.check_invariants()
    assert dropped_seen > 0
    # text token t sits at t - D past the sinks
    assert kv.cache_position("a", computed - 1) == computed - 1 - dropped_seen
    kv.free("a")
    assert kv.pool.num_free == 64 and not kv.dropped
    kv.check_invariants()


def test_prefix_index_holds_only_blocks_written_before_the_first_drop():
    r = Retention(4, 8, BS)
    kv = PagedKVManager(32, BS, retention=r)
    assert kv.allocate("a", 12, 0)
    kv.cache_blocks("a", tokens(12), 12)  # 3 full blocks indexed, at true positions with their whole context
    first = list(kv.block_table("a"))
    assert all(kv.pool.blocks[b].block_hash is not None for b in first)
    assert kv.allocate("a", 16, 12)  # window part 12 >= 8 + 4: one block drops
    assert kv.dropped_tokens("a") == 4
    shifts = kv.take_shifts()
    kept = kv.block_table("a")
    assert kept[0] == first[0] and first[1] not in kept
    assert kv.pool.blocks[first[1]].block_hash is not None  # the dropped block is still a valid prefix
    moved = shifts[0].blocks
    assert first[2] in moved and kv.pool.blocks[first[2]].block_hash is None  # rotated: out of the index
    kv.cache_blocks("a", tokens(16), 16)
    assert len(kv.hashes["a"]) == r.sink_blocks  # after a drop only the sinks are indexed
    kv.check_invariants()
    # a new request with the same text matches the sinks and the dropped block, not the rotated ones
    assert kv.match_prefix("b", list(range(40))) == 8


def test_a_shared_kept_block_is_copied_before_its_keys_rotate():
    r = Retention(4, 8, BS)
    kv = PagedKVManager(32, BS, retention=r)
    assert kv.allocate("a", 14, 0)
    kv.fork("a", "b")  # every block shared
    assert kv.allocate("a", 18, 14)  # a drops a block; its kept blocks are shared with b
    copies = kv.take_copies()
    shift = kv.take_shifts()[0]
    assert copies and {d for _, d in copies} >= set(shift.blocks)
    b_table = kv.block_table("b")
    assert not set(shift.blocks) & set(b_table)  # b's keys are never touched
    assert kv.dropped_tokens("b") == 0
    kv.check_invariants()


def test_swap_keeps_the_dropped_count_and_recompute_forgets_it():
    r = Retention(4, 8, BS)
    kv = PagedKVManager(32, BS, retention=r)
    assert kv.allocate("a", 20, 0) and kv.allocate("a", 28, 20)
    d = kv.dropped_tokens("a")
    held = len(kv.block_table("a"))
    assert d > 0
    kv.free("a", swapped=True)
    assert kv.dropped_tokens("a") == d
    assert kv.admit("a", 28, 28, 40) and len(kv.block_table("a")) == held  # back as it was
    kv.free("a")
    assert kv.dropped_tokens("a") == 0
    kv.check_invariants()


def test_skip_counts_the_middle_as_dropped_without_computing_it():
    r = Retention(4, 8, BS)
    kv = PagedKVManager(32, BS, retention=r)
    assert kv.allocate("a", 4, 0)
    assert kv.skip("a", 4, 100) == 100 - 4 - 8
    assert kv.skip("a", 4, 100) == 0  # once
    assert kv.allocate("a", 100, 92)
    assert len(kv.block_table("a")) == 3 and kv.cache_position("a", 92) == 4
    assert not kv.take_shifts()  # nothing was ever at another position
    kv.check_invariants()


def test_check_invariants_sees_an_index_entry_after_a_drop():
    kv = PagedKVManager(32, BS, retention=Retention(4, 8, BS))
    assert kv.allocate("a", 20, 0) and kv.allocate("a", 24, 20)
    kv.hashes["a"] = [1, 2, 3]
    with pytest.raises(AssertionError, match="indexed after a drop"):
        kv.check_invariants()


def test_options_refuse_what_is_not_supported_in_one_line():
    with pytest.raises(ConfigError, match="--kv-window must be"):
        EngineOptions(kv_window="lots")
    with pytest.raises(ConfigError, match="--kv-window must be"):
        EngineOptions(kv_window=0)
    with pytest.raises(ConfigError, match="--sink-tokens"):
        EngineOptions(kv_window=64, sink_tokens=-1)
    assert EngineOptions(kv_window="none").kv_window is None
    assert EngineOptions(kv_window="1,024").kv_window == 1024
    cfg = load_config("dummy:smollm2-135m")
    with pytest.raises(ConfigError, match="must fit the 256-token context"):
        LLMEngine(None, EngineOptions(kv_window=250, max_model_len=256), config=cfg)
    e = LLMEngine(None, EngineOptions(kv_window="auto", kv_window_margin=40, max_model_len=256), config=cfg)
    assert e.retention.window == 256 - 16 - 40


def test_simulated_engine_long_requests_with_preemption_and_speculation():
    """Through the real scheduler: longer than the context, bounded, preempted (recompute and swap), guessing."""
    cfg = load_config("dummy:smollm2-135m")
    for preempt in ("recompute", "swap"):
        e = LLMEngine(None, EngineOptions(kv_window=100, max_model_len=256, max_num_batched_tokens=64,
                                          speculate="ngram", kv_budget="6MiB", preempt=preempt), config=cfg)
        reqs = [e.add_request(list(range(1, 300 + 37 * i)), SamplingParams(max_tokens=300, ignore_eos=True))
                for i in range(3)]
        while e.has_unfinished():
            e.step()
            e.kv.check_invariants()
            for r in e.scheduler.running:
                assert len(e.kv.block_table(r.req_id)) * 16 <= e.retention.max_slots + 15
        assert all(len(r.output_token_ids) == 300 and r.finish_reason == "length" for r in reqs)
        assert all(r.num_tokens - r.dropped_tokens <= e.retention.max_slots for r in reqs)
        assert sum(r.num_preemptions for r in reqs) > 0
        assert e.kv.peak_slots <= e.retention.max_slots


# --- key re-rotation -----------------------------------------------------------------------------------
@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0}])
def test_shift_keys_equals_the_keys_rotated_at_the_shifted_positions(scaling):
    rot = Rotary(64, 8192, 100000.0, scaling, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(40, 3, 64, generator=g) * 4
    p = torch.randint(3000, 8000, (40,), generator=g)
    for delta in (16, 64, 2960):
        at_p = rot.apply(raw, rot.at(p, torch.float32))
        want = rot.apply(raw, rot.at(p - delta, torch.float32))
        got = rot.shift_keys(at_p, delta)
        assert (got - want).abs().max() < 2e-3 * raw.abs().max()
        assert not torch.allclose(at_p, want, atol=1e-2)  # the shift is not a no-op


@pytest.mark.parametrize(("kv_dtype", "tol"), [("fp32", 1e-5), ("fp16", 2e-3), ("int8", 2e-2), ("fp8", 8e-2)])
def test_kv_cache_rotates_only_the_keys_of_the_named_blocks(kv_dtype, tol):
    cfg = load_config("dummy:smollm2-135m")
    cache = KVCache(cfg, 6, 4, kv_dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    layer = cache.layers[3]
    x = torch.randn(7, 4, cfg.num_kv_heads, cfg.head_dim, generator=g)
    from kvcli.kvcache.kv_dtype import quantize

    for L in cache.layers:
        if L.k_scale is not None:
            c, s = quantize(x, L.k.dtype)
            L.k.copy_(c); L.k_scale.copy_(s); L.v.copy_(c); L.v_scale.copy_(s)
        else:
            L.k.copy_(x); L.v.copy_(x)

    def read(t, s):
        return dequantize(t, s, torch.float32)

    before_k, before_v = read(layer.k, layer.k_scale).clone(), read(layer.v, layer.v_scale).clone()
    cache.rotate_keys([2, 5], lambda k, layer: -k)
    after_k = read(layer.k, layer.k_scale)
    assert torch.allclose(after_k[[2, 5]], -before_k[[2, 5]], atol=tol * before_k.abs().max())
    assert torch.equal(after_k[[0, 1, 3, 4, 6]], before_k[[0, 1, 3, 4, 6]])
    assert torch.equal(read(layer.v, layer.v_scale), before_v)  # values never move


# --- the bundled model ---------------------------------------------------------------------------------
def _bundled(**opts):
    loaded = load_weights(None)
    engine = LLMEngine(loaded, EngineOptions(kv_budget="64MiB", max_model_len=2048, **opts))
    return loaded, engine.model


@pytest.fixture(scope="module")
def loaded_model():
    return _bundled()


def engine_for(loaded_model, **opts) -> LLMEngine:
    loaded, model = loaded_model
    opts = {"max_model_len": 2048, "kv_budget": "64MiB", "kv_dtype": "fp32", "max_num_batched_tokens": 64} | opts
    return LLMEngine(loaded, EngineOptions(**opts), model=model)


@pytest.fixture(scope="module")
def text_ids(loaded_model, sample_text):
    return loaded_model[0].tokenizer.encode(sample_text)


def test_windowed_equals_plain_before_any_drop(loaded_model, text_ids):
    ids = text_ids[:300]
    plain = engine_for(loaded_model).score(ids)
    windowed_engine = engine_for(loaded_model, kv_window=400)
    windowed = windowed_engine.score(ids)
    assert torch.equal(plain, windowed)
    assert windowed_engine.kv.dropped_total == 0


def layer_cache(engine: LLMEngine, req_id: str, n: int, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's first n cache slots of one layer, fp32 [n, kv_heads, D] (K, V)."""
    L = engine.kv_cache.layers[layer]
    table = torch.tensor(engine.kv.group_tables(req_id)[engine.kv_cache.groups.group_of[layer]])

    def read(t, s):
        x = dequantize(t[table], None if s is None else s[table], torch.float32)
        return x.reshape(-1, *x.shape[2:])[:n]

    return read(L.k, L.k_scale), read(L.v, L.v_scale)


def run_until_prefilled(engine: LLMEngine, req) -> None:
    while req.num_computed_tokens < req.num_prompt_tokens:
        engine.step()


@pytest.fixture(scope="module")
def invariant_model():
    """The bundled model planned row-invariant (one kernel at every row count): a token's K/V then do not depend on
    how many rows its step had (prefill chunks of 32+ rows otherwise take the int8 GEMM's one activation level on
    CPUs without AMX, decode rows the kernel's two)."""
    return _bundled(attention_backend="invariant")


@pytest.mark.parametrize(("kv_dtype", "tol"), [("fp32", 1e-4), ("int8", 6e-2)])
def test_kept_keys_equal_keys_recomputed_at_compact_positions(invariant_model, text_ids, kv_dtype, tol):
    """Layer 0's K/V depend only on the token and its position: after drops (and their re-rotations), the kept
    keys must be those of the kept tokens computed from scratch at their compact positions."""
    ids = text_ids[:330]
    w = engine_for(invariant_model, kv_window=100, kv_dtype=kv_dtype, attention_backend="invariant")
    req = w.add_request(ids, SamplingParams(max_tokens=50, ignore_eos=True))
    run_until_prefilled(w, req)
    for _ in range(20):
        w.step()
    d = w.kv.dropped_tokens(req.req_id)
    held = req.num_computed_tokens - d
    assert d >= 200 and held <= w.retention.max_slots
    kept = req.all_token_ids[:16] + req.all_token_ids[16 + d:req.num_computed_tokens]
    assert len(kept) == held
    p = engine_for(invariant_model, kv_dtype=kv_dtype, attention_backend="invariant")
    ref = p.add_request(kept, SamplingParams(max_tokens=5, ignore_eos=True))
    run_until_prefilled(p, ref)
    (wk, wv), (pk, pv) = layer_cache(w, req.req_id, held), layer_cache(p, ref.req_id, held)
    scale = pk.abs().max()
    assert (wk - pk).abs().max() <= tol * scale
    assert (wv - pv).abs().max() <= tol * pv.abs().max()
    # without the re-rotation the kept window keys would sit at their old positions
    assert (wk[16:] - pk[16:]).abs().max() > 0 or d == 0


def test_a_rebuild_equals_a_plain_run_over_sinks_and_window(loaded_model, text_ids):
    """skip_to_window (what recompute preemption sets): only the sinks and the last W tokens are computed, at
    compact positions, so greedy decoding matches a plain run over exactly those tokens."""
    ids = text_ids[:600]
    window = 200
    w = engine_for(loaded_model, kv_window=window)
    req = w.add_request(ids, SamplingParams(max_tokens=6, ignore_eos=True))
    req.skip_to_window = True
    p = engine_for(loaded_model)
    ref = p.add_request(ids[:16] + ids[-window:], SamplingParams(max_tokens=6, ignore_eos=True))
    for e in (w, p):
        while e.has_unfinished():
            e.step()
    assert req.dropped_tokens == 600 - 16 - window
    assert req.output_token_ids == ref.output_token_ids


def test_gemma3_local_layers_shift_by_their_own_rotary(tmp_path):
    """A bounded cache on a Gemma 3 (layer 0 sliding with rotary base 500, layer 1 global at 10,000): after
    drops, layer 0's kept keys equal keys computed from scratch at their compact positions, so the shift turned
    them by the local rotary; turned by the global one they are far off."""
    from kquant_model import write_tiny_kquant_gguf

    path = write_tiny_kquant_gguf(tmp_path / "g3.gguf", arch="gemma3")
    loaded = load_weights(str(path))
    opts = dict(max_model_len=512, kv_budget="16MiB", kv_dtype="fp32", max_num_batched_tokens=64)
    model = LLMEngine(loaded, EngineOptions(**opts)).model
    assert model.layers[0].rotary is not model.layers[1].rotary
    ids = [(i * 37) % 4000 + 100 for i in range(330)]

    def kept_keys(**patch) -> tuple[torch.Tensor, torch.Tensor, int]:
        w = LLMEngine(loaded, EngineOptions(**opts, kv_window=100), model=model)
        req = w.add_request(ids, SamplingParams(max_tokens=30, ignore_eos=True))
        run_until_prefilled(w, req)
        for _ in range(10):
            w.step()
        d = w.kv.dropped_tokens(req.req_id)
        held = req.num_computed_tokens - d
        kept = req.all_token_ids[:16] + req.all_token_ids[16 + d:req.num_computed_tokens]
        p = LLMEngine(loaded, EngineOptions(**opts, kv_groups=False), model=model)  # every key kept, every layer
        ref = p.add_request(kept, SamplingParams(max_tokens=2, ignore_eos=True))
        run_until_prefilled(p, ref)
        assert d >= 200
        return layer_cache(w, req.req_id, held)[0], layer_cache(p, ref.req_id, held)[0], d

    wk, pk, _ = kept_keys()
    assert (wk - pk).abs().max() <= 1e-4 * pk.abs().max()
    local = model.layers[0].rotary
    try:  # the local layers turned by the global rotary (what the runner did before)
        local.shift_keys = model.rotary.shift_keys
        wk, pk, _ = kept_keys()
    finally:
        del local.shift_keys
    assert (wk - pk).abs().max() > 1e-2 * pk.abs().max()
