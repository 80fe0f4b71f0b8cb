"""Real-model runs under the engine's modes: contiguous vs paged, preemption by recompute and by
swap, and n > 1 samples sharing the prompt's blocks — greedy outputs must not change."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcli.config import SamplingParams
from kvcli.engine.llm_engine import EngineOptions, LLMEngine
from kvcli.model.loader import load_weights
from kvcli.profile import run_trace
from kvcli.workloads import prompt_ids, synthetic

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shared_model():
    """One load of the bundled model; every engine below shares its weights. Dense fp32 (exact)
    weights: recompute turns decode steps into prefill chunks, and the bf16 INT4 kernel rounds
    those differently enough to flip near-ties, which would hide a real KV bug behind noise."""
    loaded = load_weights(None)
    engine = LLMEngine(loaded, EngineOptions(kv_budget="32MiB", max_model_len=512, dequantize=True))
    return loaded, engine.model


def engine_for(shared_model, **opts) -> LLMEngine:
    loaded, model = shared_model
    return LLMEngine(loaded, EngineOptions(max_model_len=512, **opts), model=model)


PER_BLOCK = 737280  # SmolLM2-135M: 16 tokens x 30 layers x 3 KV heads x 64 x 4 B x 2


def run(engine, trace, prompts):
    return run_trace(engine, trace, prompts, engine.kv.name, check_invariants=True)


def test_contiguous_and_paged_give_identical_greedy_outputs(shared_model):
    trace = synthetic("alpaca", 4, 512, seed=11)
    prompts = prompt_ids(trace, shared_model[0].tokenizer)
    budget = str(48 * PER_BLOCK)  # contiguous max-len (32 blocks each): one request at a time
    paged = run(engine_for(shared_model, kv_budget=budget), trace, prompts)
    contig = run(engine_for(shared_model, kv_budget=budget, kv_layout="contiguous"), trace, prompts)
    assert contig.peak_running == 1 < paged.peak_running
    assert list(paged.outputs.values()) == list(contig.outputs.values())
    assert all(len(o) == t.max_tokens for o, t in zip(paged.outputs.values(), trace.requests))


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_preemption_keeps_greedy_outputs(shared_model, preempt):
    trace = synthetic("alpaca", 4, 512, seed=5)
    trace = type(trace)(trace.name, [type(t)(t.prompt_len + 60, 40, 0.0) for t in trace.requests])
    prompts = prompt_ids(trace, shared_model[0].tokenizer)
    free = run(engine_for(shared_model, kv_budget="64MiB"), trace, prompts)
    assert free.preemptions == 0
    # Four requests of ~110-150 tokens in a pool of 14 blocks (224 tokens): they must take turns.
    tight_engine = engine_for(shared_model, kv_budget=str(14 * PER_BLOCK), preempt=preempt, max_num_batched_tokens=64)
    tight = run(tight_engine, trace, prompts)
    assert tight.preemptions > 0
    if preempt == "swap":
        assert any(r.num_swapped for r in tight.records)
        assert not tight_engine.runner.swapped  # every swapped request came back
    assert list(tight.outputs.values()) == list(free.outputs.values())


def generate_alone(shared_model, ids: list[int], params: SamplingParams, **opts) -> list[int]:
    engine = engine_for(shared_model, kv_budget="32MiB", **opts)
    req = engine.add_request(ids, params)
    while engine.has_unfinished():
        engine.step()
    return list(req.output_token_ids)


def test_n_samples_share_prompt_blocks(shared_model):
    """n = 3 seeded samples fork the leader's blocks; the partial prompt block is shared, so each
    sample's first write must copy it. Sampled (not greedy) tokens differ between samples, so a
    write into the shared block without copying would change a neighbour's KV and its tokens."""
    engine = engine_for(shared_model, kv_budget="32MiB")
    ids = engine.tokenizer.encode("The keeper climbed the stairs to the lamp room and")  # 11 tokens: a partial block
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=1.0, seed=40)
    leader = engine.add_request(ids, params.with_(n=3))
    saved = []
    while engine.has_unfinished():
        engine.step()
        saved.append(engine.kv.stats([], None).shared_saved_blocks)
        engine.kv.check_invariants()
    rids = [leader.req_id, f"{leader.req_id}.1", f"{leader.req_id}.2"]
    assert set(engine.requests) == set(rids)
    assert {engine.requests[r].parent_id for r in rids} == {None, leader.req_id}
    outs = [list(engine.requests[r].output_token_ids) for r in rids]
    assert len({tuple(o) for o in outs}) == 3  # the seeds really sample different continuations
    # What LLM.generate returns: one result per prompt, the other samples in .samples, in seed order.
    result = engine.completion(leader.req_id)
    assert [result.token_ids] + [s.token_ids for s in result.samples] == outs
    assert [s.req_id for s in result.samples] == rids[1:] and all(not s.samples for s in result.samples)
    # Sample i carries seed 40 + i: each must equal one request run alone with that seed.
    for i, out in enumerate(outs):
        assert out == generate_alone(shared_model, ids, params.with_(seed=40 + i)), f"sample {i}"
    assert max(saved) >= 2  # the full prompt block was shared by all three
    assert engine.kv.num_free_blocks == engine.num_blocks


def test_contiguous_with_swap_preemption_keeps_greedy_outputs(shared_model):
    """The contiguous layout under --preempt swap in a pool too small for the trace at once: the
    requests take turns and their greedy outputs equal an unpressured run's. A contiguous request
    reserves its final length at admission, so it never runs out of room mid-run: nothing is
    preempted, and so nothing is swapped."""
    trace = synthetic("alpaca", 3, 512, seed=5)
    trace = type(trace)(trace.name, [type(t)(t.prompt_len + 20, 4, 0.0) for t in trace.requests])
    prompts = prompt_ids(trace, shared_model[0].tokenizer)
    free = run(engine_for(shared_model, kv_budget="64MiB"), trace, prompts)
    # Each request reserves ~40-60 tokens (3-4 blocks): a 5-block pool runs one at a time.
    tight_engine = engine_for(shared_model, kv_budget=str(6 * PER_BLOCK), kv_layout="contiguous",
                              reserve="request", preempt="swap", max_num_batched_tokens=64)
    tight = run(tight_engine, trace, prompts)
    assert free.peak_running == 3 > tight.peak_running  # the pool forced the requests to wait
    assert tight.preemptions == 0 and not any(r.num_swapped for r in tight.records)
    assert not tight_engine.runner.swapped
    assert list(tight.outputs.values()) == list(free.outputs.values())


@pytest.mark.parametrize("block_size", [8, 128])
def test_block_sizes_give_the_same_logits(shared_model, block_size):
    """Block tables of 8- and 128-token blocks (a 237-token text spanning many 8-blocks and crossing a
    128-block boundary, prefilled in 64-token chunks) give block size 16's teacher-forced
    log-likelihoods on the exact fp32 path, to 1e-4: every position's logits, not just 4 greedy tokens."""
    tok = shared_model[0].tokenizer
    ids = sample_ids(tok)[:237]
    if 16 not in BY_BLOCK_SIZE:
        BY_BLOCK_SIZE[16] = scored(shared_model, ids, 16)
    got = scored(shared_model, ids, block_size)
    assert got.shape == BY_BLOCK_SIZE[16].shape
    assert float((got - BY_BLOCK_SIZE[16]).abs().max()) < 1e-4


BY_BLOCK_SIZE: dict[int, "torch.Tensor"] = {}  # block size 16's NLLs, computed once for both cases


def scored(shared_model, ids: list[int], block_size: int):
    engine = engine_for(shared_model, kv_budget="32MiB", block_size=block_size, max_num_batched_tokens=64,
                        prefix_caching=False)
    nll = engine.score(ids)
    engine.kv.check_invariants()
    assert engine.options.block_size == block_size and engine.kv.block_size == block_size
    return nll


SAMPLE = Path(__file__).resolve().parents[1] / "samples" / "keepers-log.txt"


def sample_ids(tok) -> list[int]:
    # Not `from conftest import SAMPLE`: in a full run that name resolves to tests/kernels/conftest.py.
    return tok.encode(SAMPLE.read_text(encoding="utf-8")[:4000])


def test_prefix_cache_second_turn_prefills_less_same_reply(shared_model):
    loaded, _ = shared_model
    tok = loaded.tokenizer
    turn1 = [{"role": "user", "content": "Describe a lighthouse at night in two sentences."}]
    results = {}
    for cache in (True, False):
        engine = engine_for(shared_model, kv_budget="32MiB", prefix_caching=cache)
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        r1 = engine.add_request(tok.apply_chat_template(turn1), params)
        while engine.has_unfinished():
            engine.step()
        turn2 = turn1 + [{"role": "assistant", "content": tok.decode(r1.output_token_ids)},
                         {"role": "user", "content": "Now describe the keeper."}]
        ids2 = tok.apply_chat_template(turn2)
        before = engine.snapshot().prompt_tokens
        r2 = engine.add_request(ids2, params)
        while engine.has_unfinished():
            engine.step()
        results[cache] = (engine.snapshot().prompt_tokens - before, len(ids2), list(r2.output_token_ids),
                          engine.kv.prefix_hit_tokens)
        engine.kv.check_invariants()
    computed_cached, total, reply_cached, hits = results[True]
    computed_plain, _, reply_plain, _ = results[False]
    assert computed_plain == total
    assert hits >= 16 and computed_cached == total - hits < total
    assert reply_cached == reply_plain


def test_compute_dtype_option_sets_model_and_kv_dtype(tmp_path):
    """EngineOptions.dtype picks the compute dtype (KV follows unless kv_dtype says otherwise);
    an unknown name is a one-line ConfigError naming the option."""
    import json

    import torch

    from kvcli.config import PRESETS
    from kvcli.options import ConfigError
    from kvcli.llm import LLM

    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(dict(PRESETS["smollm2-135m"], num_hidden_layers=2, vocab_size=512)))
    outs = {}
    for dtype in ("fp32", "bf16"):
        llm = LLM(f"dummy:{cfg}", kv_budget="4MiB", dtype=dtype, dequantize=True)
        assert llm.engine.kv_dtype.storage == {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
        outs[dtype] = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
        assert len(outs[dtype]) == 4
    with pytest.raises(ConfigError, match=r"--dtype must be fp32, fp16 or bf16 \(got 'fp8'\)"):
        LLM(f"dummy:{cfg}", kv_budget="4MiB", dtype="fp8")
