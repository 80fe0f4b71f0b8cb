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


def test_logprobs_match_teacher_forcing(int4_llm):
    e = int4_llm.engine
    req, outs = run(e, PROMPT, SamplingParams(max_tokens=12, ignore_eos=True), 3)
    assert len(outs) == 12 and all(o.logprobs is not None for o in outs)
    for o in outs:
        (tok,) = o.new_token_ids
        assert len(o.logprobs.top) == 3 and o.logprobs.top[0][0] == tok  # greedy: the top entry
        assert o.logprobs.logprob == pytest.approx(o.logprobs.top[0][1])
        assert [lp for _, lp in o.logprobs.top] == sorted((lp for _, lp in o.logprobs.top), reverse=True)
    nll = e.score(req.prompt_token_ids + req.output_token_ids, first_scored=req.num_prompt_tokens)
    got = [o.logprobs.logprob for o in outs]
    assert got == pytest.approx([-float(x) for x in nll], abs=2e-2)
    # a request that did not ask has none
    _, plain = run(e, PROMPT, SamplingParams(max_tokens=3), None)
    assert all(o.logprobs is None for o in plain)


def test_logprobs_with_speculation(int4_llm):
    """Prompt lookup accepts several tokens a step here (the prompt repeats itself): every token still
    gets its own row's log probability."""
    from kvcli.llm import LLM

    base = int4_llm.engine
    spec = LLM(max_num_batched_tokens=512, kv_budget="64MiB", speculate="ngram").engine
    _, plain = run(base, PROMPT, SamplingParams(max_tokens=16, ignore_eos=True), 0)
    _, fast = run(spec, PROMPT, SamplingParams(max_tokens=16, ignore_eos=True), 0)
    assert [o.new_token_ids for o in fast] == [o.new_token_ids for o in plain]
    assert spec.scheduler.spec_accepted > 0
    assert [o.logprobs.logprob for o in fast] == pytest.approx([o.logprobs.logprob for o in plain], abs=2e-2)
    assert all(o.logprobs.top == () for o in fast)
