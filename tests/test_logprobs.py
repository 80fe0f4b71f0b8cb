"""Per-token log probabilities from the engine (issue #31, item 4): each sampled token's log
probability under the model's raw distribution and its top alternatives, one per token output, with
and without speculative decoding, and equal to the teacher-forced scores of the same tokens."""

from __future__ import annotations

import pytest

from kvcli.config import SamplingParams

pytestmark = pytest.mark.slow
PROMPT = "The keeper wrote in his log that the lamp had gone out. The keeper wrote in his log that"


def run(engine, prompt, params, logprobs):
    req = engine.add_request(prompt, params.with_(logprobs=logprobs))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.req_id == req.req_id]
    return req, outs


def _check_against_teacher_forcing(e, abs_tol: float) -> None:
    req, outs = run(e, PROMPT, SamplingParams(max_tokens=12, ignore_eos=True), 3)
    assert len(outs) == 12 and all(o.logprobs is not None for o in outs)
    for o in outs:
        (tok,) = o.new_token_ids
        assert len(o.logprobs.top) == 3 and o.logprobs.top[0][0] == tok  # greedy: the top entry
        assert o.logprobs.logprob == pytest.approx(o.logprobs.top[0][1])
        assert [lp for _, lp in o.logprobs.top] == sorted((lp for _, lp in o.logprobs.top), reverse=True)
    nll = e.score(req.prompt_token_ids + req.output_token_ids, first_scored=req.num_prompt_tokens)
    got = [o.logprobs.logprob for o in outs]
    assert got == pytest.approx([-float(x) for x in nll], abs=abs_tol)
    # a request that did not ask has none
    _, plain = run(e, PROMPT, SamplingParams(max_tokens=3), None)
    assert all(o.logprobs is None for o in plain)


def test_logprobs_match_teacher_forcing():
    """Row-invariant, a decoded token's log probability is its teacher-forced score (the same rows' numbers)."""
    from kvcli.llm import LLM

    _check_against_teacher_forcing(LLM(max_num_batched_tokens=512, kv_budget="64MiB",
                                       attention_backend="invariant").engine, 1e-4)


def test_logprobs_match_teacher_forcing_on_the_default_path(int4_llm):
    """On the default path score()'s prefill rows may take another matmul than decode's single rows: on CPUs
    without AMX 32+ rows of Q4_0 / Q4_1 codes take the int8 GEMM's one activation level (weight_plan.py), decode
    rows the kernel's two; up to 0.07 nats apart on the bundled model (2026-12-06), so the bound is 0.15: a
    token's logprob reported for another row or position is off by far more."""
    _check_against_teacher_forcing(int4_llm.engine, 0.15)


def test_logprobs_with_speculation():
    """Prompt lookup accepts several tokens a step here (the prompt repeats itself): every token still
    gets its own row's log probability. Both engines fresh: int4_llm's prefix cache already holds this prompt
    from the tests above, and a prompt prefilled over cached blocks rounds its last rows' activations from
    slightly other inputs (the cached keys are fp16, a chunk's own are not yet): up to 0.03 nats apart at one
    activation level (Q4_0 / Q4_1 forms since 2026-12-07), where speculation and plain decoding from the same
    start agree (exactly, on the bundled model on AVX-512, 2026-12-07)."""
    from kvcli.llm import LLM

    base = LLM(max_num_batched_tokens=512, kv_budget="64MiB").engine
    spec = LLM(max_num_batched_tokens=512, kv_budget="64MiB", speculate="ngram").engine
    _, plain = run(base, PROMPT, SamplingParams(max_tokens=16, ignore_eos=True), 0)
    _, fast = run(spec, PROMPT, SamplingParams(max_tokens=16, ignore_eos=True), 0)
    assert [o.new_token_ids for o in fast] == [o.new_token_ids for o in plain]
    assert spec.scheduler.spec_accepted > 0
    assert [o.logprobs.logprob for o in fast] == pytest.approx([o.logprobs.logprob for o in plain], abs=2e-2)
    assert all(o.logprobs.top == () for o in fast)


# --- the prompt's log probabilities (SamplingParams.prompt_logprobs; serve's echo with logprobs) ----------
def _first(outs):
    assert outs[0].prompt_logprobs is not None and all(o.prompt_logprobs is None for o in outs[1:])
    return outs[0].prompt_logprobs


@pytest.mark.parametrize("chunk", [512, 7])
def test_prompt_logprobs_are_the_teacher_forced_scores(chunk, sample_text):
    """Each prompt token after the first, given those before it: the same numbers as score(), whole or in
    chunks of 7 tokens (rows of one chunk score the next chunk's first token), with top entries sorted."""
    from kvcli.llm import LLM

    e = LLM(dequantize=True, max_num_batched_tokens=chunk, kv_budget="64MiB").engine
    text = sample_text[:300]
    req, outs = run(e, text, SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=2), None)
    plps = _first(outs)
    ids = req.prompt_token_ids
    assert len(plps) == len(ids) - 1
    want = [-float(x) for x in e.score(ids)]
    assert [p.logprob for p in plps] == pytest.approx(want, abs=1e-4)
    for p in plps:
        assert len(p.top) == 2 and p.top[0][1] >= p.top[1][1] and p.top[0][1] >= p.logprob - 1e-6


def test_prompt_logprobs_skip_the_prefix_cache_and_reach_every_sample(exact_llm):
    """A prompt already in the prefix cache is computed again when its scores are asked (a cached block has
    no logits); n = 2 samples share the prompt's one list; a request beside it is unaffected."""
    e = exact_llm.engine
    text = PROMPT * 6
    _, first = run(e, text, SamplingParams(max_tokens=1), None)  # fills the prefix cache
    assert first[0].prompt_logprobs is None
    a = e.add_request(text, SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=0, n=2, temperature=1.0,
                                           seed=3))
    b = e.add_request(PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))
    got: dict[str, list] = {}
    while e.has_unfinished():
        for o in e.step():
            got.setdefault(o.req_id, []).append(o)
    ids = a.prompt_token_ids
    want = [-float(x) for x in e.score(ids)]
    for rid in (a.req_id, f"{a.req_id}.1"):
        plps = _first(got[rid])
        assert len(plps) == len(ids) - 1 and all(p.top == () for p in plps)
        assert [p.logprob for p in plps] == pytest.approx(want, abs=1e-4)
    assert all(o.prompt_logprobs is None for o in got[b.req_id])
    assert e.scheduler.requests[a.req_id].num_cached_tokens == 0


def test_prompt_logprobs_survive_a_recompute_preemption(sample_text):
    """Two long prompts in a pool that holds one: the one preempted mid-prompt scores its prompt again from
    the start, and its list still has one entry per prompt token."""
    from kvcli.llm import LLM

    e = LLM(dequantize=True, max_num_batched_tokens=32, kv_budget="12MiB", preempt="recompute").engine
    reqs = [e.add_request(sample_text[i * 400:(i + 1) * 400 + 300],
                          SamplingParams(max_tokens=40, ignore_eos=True, prompt_logprobs=0)) for i in range(2)]
    got: dict[str, list] = {}
    while e.has_unfinished():
        for o in e.step():
            got.setdefault(o.req_id, []).append(o)
    assert e.scheduler.num_preemptions > 0
    for r in reqs:
        plps = _first(got[r.req_id])
        assert [p.logprob for p in plps] == pytest.approx([-float(x) for x in e.score(r.prompt_token_ids)], abs=1e-4)
