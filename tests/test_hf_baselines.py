"""The transformers baselines of the throughput benchmark (kvcli/bench/hf_baselines.py) on a tiny trace: every
mode yields exactly each request's max_tokens, counts only those as output, and (greedy, fp32) left padding and
continuous batching give the same tokens as `generate` one request at a time."""

from __future__ import annotations

import pytest

from kvcli.bench.hf_baselines import MODES, BaselineResult, run_hf_baselines

# three prompts of different lengths (so the static batch needs left padding), three output lengths
PROMPTS = [
    [504, 3458, 282, 260, 1345, 28],
    [504, 3458, 282, 1000, 1001, 1002, 1003, 1004, 1005, 1006, 1007, 1008, 1009, 1010],
    [9, 10, 11, 12, 13, 14, 15, 16, 17],
]
MAX_TOKENS = [4, 6, 5]


@pytest.fixture(scope="module")
def results(hf_model):
    saved, attn = hf_model.generation_config, hf_model.config._attn_implementation
    seen: list[tuple[str, int, int]] = []
    out = run_hf_baselines(hf_model, PROMPTS, MAX_TOKENS, batch_size=2,
                           progress=lambda mode, done, total: seen.append((mode, done, total)))
    assert hf_model.generation_config is saved  # the model's own generation config is restored
    assert hf_model.config._attn_implementation == attn  # continuous batching switches it and must switch back
    out["_progress"] = seen  # type: ignore[assignment]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_each_mode_yields_exactly_the_requested_tokens(results, mode):
    r = results[mode]
    assert isinstance(r, BaselineResult) and r.mode == mode
    if mode == "generate_batch" and r.tokens_per_s is None:
        pytest.fail(f"continuous batching did not run: {r.note}")
    assert [len(t) for t in r.token_ids] == MAX_TOKENS
    assert r.output_tokens == sum(MAX_TOKENS)
    assert r.wall_seconds > 0 and r.tokens_per_s > 0
    assert r.tokens_per_s == pytest.approx(r.output_tokens / r.wall_seconds)
    assert results["_progress"][-1][0] == "generate_batch"
    assert (mode, len(PROMPTS), len(PROMPTS)) in results["_progress"]


@pytest.mark.slow
def test_static_batches_count_only_useful_tokens(results):
    r = results["static"]
    # batches [0, 1] -> 6 new tokens each, [2] -> 5: 17 computed, 15 useful; 8 prompt pads in the first batch
    assert r.computed_tokens == 2 * 6 + 5
    assert "2 of 17" in r.note and "8 prompt pad tokens" in r.note


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["static", "generate_batch"])
def test_batched_greedy_tokens_equal_sequential(results, mode):
    """Left padding is masked and positions follow the mask, so a padded row computes the same sums as the
    unpadded request up to float noise; over 4-6 tokens no near tie flips (checked on this model and these
    prompts). Continuous batching packs requests into one varlen batch: same argument."""
    assert results[mode].token_ids == results["sequential"].token_ids


@pytest.mark.slow
def test_bad_arguments_are_refused(hf_model):
    with pytest.raises(ValueError, match="max_tokens"):
        run_hf_baselines(hf_model, PROMPTS, [4, 6], modes=("sequential",))
    with pytest.raises(ValueError, match="unknown mode"):
        run_hf_baselines(hf_model, PROMPTS, MAX_TOKENS, modes=("beam",))


@pytest.mark.slow
def test_a_time_limit_stops_a_mode_and_says_so(hf_model):
    """seconds_per_mode: the first request (sequential) or batch (static) always runs; none starts after the
    limit, the rate is over what finished and the note says how much that was."""
    out = run_hf_baselines(hf_model, PROMPTS, MAX_TOKENS, batch_size=2, modes=("sequential", "static"),
                           seconds_per_mode=1e-6, warmup=False)
    seq, st = out["sequential"], out["static"]
    assert [len(t) for t in seq.token_ids] == MAX_TOKENS[:1] and "after 1 of 3 requests" in seq.note
    assert seq.tokens_per_s == pytest.approx(MAX_TOKENS[0] / seq.wall_seconds)
    assert [len(t) for t in st.token_ids] == MAX_TOKENS[:2] and "after 2 of 3 requests" in st.note
    full = run_hf_baselines(hf_model, PROMPTS, MAX_TOKENS, batch_size=2, modes=("sequential",), warmup=False)
    assert "stopped" not in full["sequential"].note
