"""Speculative decoding without a model: the prompt-lookup proposer, the acceptance rule (greedy and
the exact sampling rule, checked statistically), and the scheduler's bookkeeping of guesses (KV slots
given back, prefix cache never hashing a guess, stop tokens inside an accepted run, token budget)."""

from __future__ import annotations

import random

import pytest
import torch

from kvcli.config import SamplingParams
from kvcli.engine.request import Request
from kvcli.engine.scheduler import Scheduler
from kvcli.kvcache.block_manager import PagedKVManager
from kvcli.kvcache.contiguous import ContiguousArena
from kvcli.kvcache.interface import blocks_for
from kvcli.options import ConfigError, EngineOptions
from kvcli.spec_decode.acceptance import accept
from kvcli.spec_decode.backoff import AdaptiveBackoff
from kvcli.spec_decode.draft_length import DraftLength, StepCosts, expected_tokens
from kvcli.spec_decode.prompt_lookup import PromptLookupProposer
from kvcli.step import RunnerOutput, SchedulerOutput


def propose(p: PromptLookupProposer, tokens: list[int], limit: int = 99, rid: str = "r") -> list[int]:
    return p.propose(rid, len(tokens), lambda a, b: tokens[a:b], limit)


# --- proposer ------------------------------------------------------------------------------------------
def test_prompt_lookup_prefers_the_longest_match_then_the_latest():
    p = PromptLookupProposer(3, ngram_min=1, ngram_max=3)
    #        0  1  2  3  4  5  6  7  8  9 10 11
    toks = [7, 1, 2, 3, 40, 41, 9, 2, 3, 50, 1, 2, 3]
    # Suffix [1, 2, 3] occurs at 1..3 (followed by 40 41 9); [2, 3] alone later at 7..8 (followed by 50).
    assert propose(p, toks) == [40, 41, 9]
    p2 = PromptLookupProposer(3, ngram_min=1, ngram_max=2)  # [2, 3] twice: the later one wins
    assert propose(p2, toks) == [50, 1, 2]


def test_prompt_lookup_limits_and_misses():
    p = PromptLookupProposer(4, ngram_min=2, ngram_max=3)
    toks = [5, 6, 7, 8, 9, 5, 6]
    assert propose(p, toks, limit=2) == [7, 8]
    assert propose(p, [1, 2, 3, 4], rid="x") == []  # no earlier occurrence
    assert propose(p, [5, 6], rid="y") == []  # too short
    # Incremental: the proposer catches up with tokens appended since its last call.
    toks += [7, 1, 5, 6]
    assert propose(p, toks) == [7, 1, 5, 6]


# --- acceptance ----------------------------------------------------------------------------------------
def onehot_logits(rows: list[int], vocab: int = 10) -> torch.Tensor:
    x = torch.zeros(len(rows), vocab)
    for i, t in enumerate(rows):
        x[i, t] = 5.0
    return x


def test_greedy_acceptance_keeps_agreeing_guesses_then_the_models_token():
    greedy = SamplingParams(temperature=0.0)
    assert accept(onehot_logits([1, 2, 3, 4]), [1, 2, 3], greedy, None) == [1, 2, 3, 4]  # all + bonus
    assert accept(onehot_logits([1, 2, 3, 4]), [1, 9, 3], greedy, None) == [1, 2]  # stops at a mismatch
    assert accept(onehot_logits([6, 2]), [1], greedy, None) == [6]


def chi2(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)


def test_sampling_acceptance_keeps_the_target_distribution():
    """The first token is distributed as the model's p0 whatever the guess; after an accepted first
    guess, the second as p1. Chi-square at p = 0.001 (df 4: 18.47) over 20,000 draws."""
    torch.manual_seed(0)
    logits = torch.randn(3, 5) * 1.5
    params = SamplingParams(temperature=1.0)
    p = torch.softmax(logits, -1)
    gen = torch.Generator().manual_seed(1)
    first = [0] * 5
    second = [0] * 5
    guesses = [int(torch.argsort(p[0])[2]), 1]  # a middling guess for the first token
    for _ in range(20000):
        out = accept(logits, guesses, params, gen)
        first[out[0]] += 1
        if out[0] == guesses[0]:
            second[out[1]] += 1
    assert chi2(first, p[0].tolist()) < 18.47, (first, p[0])
    assert chi2(second, p[1].tolist()) < 18.47, (second, p[1])


def test_sampling_acceptance_respects_top_k():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(temperature=1.0, top_k=2)
    gen = torch.Generator().manual_seed(3)
    outs = {accept(logits, [3], params, gen)[0] for _ in range(300)}
    assert outs == {0, 1}  # the guess (outside the top 2) is never accepted


# --- back-off ------------------------------------------------------------------------------------------
def test_backoff_pauses_after_a_bad_window_and_doubles():
    b = AdaptiveBackoff(window=2, min_rate=0.5, first_pause=3, max_pause=8)
    assert b.should_propose("r")
    b.record("r", 4, 0)
    assert b.should_propose("r")
    b.record("r", 4, 1)  # 1 of 8 accepted: pause 3 steps
    assert [b.should_propose("r") for _ in range(4)] == [False, False, False, True]
    b.record("r", 4, 0)
    b.record("r", 4, 0)  # again: the pause doubles
    assert [b.should_propose("r") for _ in range(7)] == [False] * 6 + [True]
    b.record("r", 4, 4)
    b.record("r", 4, 3)  # a good window resets the pause
    assert b.should_propose("r")


# --- draft length -----------------------------------------------------------------------------------------
def fitted(t1: float, b: float, rows=(1, 6, 3, 1, 6, 2, 6, 1, 4, 6)) -> StepCosts:
    costs = StepCosts()
    for r in rows:
        costs.observe(r, t1 + b * (r - 1))
    return costs


def test_step_costs_fit_the_line_once_the_rows_vary():
    costs = StepCosts()
    for _ in range(20):
        costs.observe(6, 0.02)  # one row count only: nothing to fit a slope to
    assert costs.line() is None and costs.ratio(6) is None
    costs = fitted(0.010, 0.002)
    t1, b = costs.line()
    assert t1 == pytest.approx(0.010) and b == pytest.approx(0.002)
    assert costs.ratio(6) == pytest.approx(2.0)


def test_expected_tokens_is_the_geometric_run():
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.0, 4) == 1.0


def test_draft_length_follows_acceptance_and_row_costs():
    d = DraftLength()
    assert d.length("r", 5) == 5  # no costs measured yet: the fixed length
    d.costs = fitted(0.010, 0.0005)  # a row 5 % of a step: long drafts pay
    assert d.length("r", 5) == 5  # the prior: a fully accepted run
    for _ in range(6):
        d.record("r", 5, 5, 5)
    assert d.length("r", 5) == 5 and d.acceptance("r", 5) > 0.9
    d.costs = fitted(0.010, 0.0033)  # a third of a step per row (the bundled model at 4k)
    for _ in range(15):
        d.record("r", 5, 0, 5)  # nothing accepted: a ~ 0
    assert d.acceptance("r", 5) < 0.3 and d.length("r", 5) == 1
    # Over acceptances and costs: a dearer row or a lower acceptance never asks for a longer draft.
    for a_runs in (0, 1, 2, 4):
        lengths = []
        for b in (0.0002, 0.001, 0.003, 0.01):
            e = DraftLength(costs=fitted(0.010, b))
            for _ in range(8):
                e.record("r", 5, a_runs, 5)
            lengths.append(e.length("r", 5))
        assert lengths == sorted(lengths, reverse=True), (a_runs, lengths)
    d.release("r")
    assert d.acceptance("r", 5) == pytest.approx(5 / 6)


def test_scheduler_verifies_the_draft_length_it_is_given():
    kv = PagedKVManager(200, 4, prefix_caching=True)
    draft = DraftLength(costs=fitted(0.010, 0.004))  # rows dear: short drafts
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                      proposer=PromptLookupProposer(5, 1, 3), backoff=AdaptiveBackoff(), draft=draft,
                      eos_token_ids=())
    rng = random.Random(1)
    for i in range(3):
        prompt = [rng.randrange(6) for _ in range(20)]
        sched.add(Request(f"r{i}", prompt, SamplingParams(max_tokens=30, ignore_eos=True)))
    lengths = []
    while sched.has_unfinished():
        out = sched.schedule()
        for c in out.chunks:
            if c.spec_token_ids:
                req_id = c.req_id
                lengths.append(len(c.spec_token_ids))
                assert len(c.spec_token_ids) <= draft.length(req_id, 5)
        sched.update_from_output(out, fake_runner(sched, out, rng))
    assert lengths and max(lengths) < 5
    # per-request state goes with the request, also when its last verification finished it
    assert not draft._req and not sched.backoff._req


# --- the scheduler's bookkeeping, against a fake model ----------------------------------------------------
def fake_next(tokens: list[int]) -> int:
    """A deterministic 'model': the token that followed the previous occurrence of the last token
    (so prompt lookup guesses well), else a counter."""
    last = tokens[-1]
    for i in range(len(tokens) - 2, -1, -1):
        if tokens[i] == last:
            return tokens[i + 1]
    return (last * 7 + 3) % 50


def fake_runner(sched: Scheduler, out: SchedulerOutput, vocab_noise: random.Random) -> RunnerOutput:
    """Verifies guesses greedily against fake_next; sometimes disagrees on purpose (rejections)."""
    sampled = {}
    for c in out.chunks:
        if not c.sample:
            continue
        req = sched.requests[c.req_id]
        ctx = req.token_slice(0, c.start_pos + len(c.token_ids) - len(c.spec_token_ids))
        toks: list[int] = []
        for g in (*c.spec_token_ids, None):
            t = fake_next(ctx) if vocab_noise.random() > 0.2 else 49
            toks.append(t)
            if t != g:
                break
            ctx = ctx + [t]
        sampled[c.req_id] = toks
        for f in c.fork_ids:
            sampled[f] = [toks[0]]
    return RunnerOutput(sampled)


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_guesses_take_and_give_back_slots_and_are_never_hashed(layout):
    bs = 4
    kv = (PagedKVManager(200, bs, prefix_caching=True) if layout == "paged"
          else ContiguousArena(200, bs, reserve="request", max_model_len=256))
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=24, max_model_len=256,
                      proposer=PromptLookupProposer(5, 1, 3), eos_token_ids=())
    rng = random.Random(0)
    reqs = []
    for i in range(6):
        prompt = [rng.randrange(10) for _ in range(rng.randrange(3, 30))]
        r = Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randrange(5, 40), ignore_eos=True,
                                                     stop_token_ids=(49,) if i == 0 else ()))
        sched.add(r)
        reqs.append(r)
    steps = guessed = 0
    while sched.has_unfinished():
        out = sched.schedule()
        assert out.num_tokens <= 24  # guesses count against the step's token budget
        for c in out.chunks:
            req = sched.requests[c.req_id]
            if c.spec_token_ids:
                guessed += len(c.spec_token_ids)
                assert c.sample and c.start_pos + len(c.token_ids) - len(c.spec_token_ids) == req.num_tokens
                # Guesses stay inside what the request may still produce (its own token comes after).
                assert req.num_tokens + len(c.spec_token_ids) < sched.final_tokens(req)
        sched.update_from_output(out, fake_runner(sched, out, rng))
        kv.check_invariants()
        for r in sched.running:
            if r.output_token_ids:  # decoding: everything but the newest token is in the cache
                assert r.num_computed_tokens == r.num_tokens - 1
            if layout == "paged":
                # Rejected guesses' slots are back: no block beyond what the final tokens need.
                assert len(kv.block_table(r.req_id)) == blocks_for(r.num_computed_tokens, bs)
                # The prefix index holds final tokens only.
                hashes = kv.hashes.get(r.req_id, [])
                assert len(hashes) <= r.num_computed_tokens // bs
        steps += 1
    assert guessed > 0
    assert 49 in reqs[0].output_token_ids  # the stop case was exercised
    for r in reqs:
        assert r.finished
        out_ids = r.output_token_ids
        if r.req_id == "r0" and 49 in out_ids:  # a stop token inside an accepted run ends the request there
            assert out_ids.index(49) == len(out_ids) - 1 and r.finish_reason == "stop"
        else:
            assert len(out_ids) == r.params.max_tokens and r.finish_reason == "length"
    assert kv.num_free_blocks == kv.num_blocks  # every block back once all requests ended


def test_prefix_cache_entries_match_final_tokens():
    """Every hashed block's tokens are the request's final tokens at that place."""
    bs = 4
    kv = PagedKVManager(100, bs, prefix_caching=True)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
                      proposer=PromptLookupProposer(6, 1, 3))
    rng = random.Random(5)
    r = Request("a", [1, 2, 3, 4, 5, 1, 2, 3], SamplingParams(max_tokens=60, ignore_eos=True))
    sched.add(r)
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update_from_output(out, fake_runner(sched, out, rng))
        if not r.finished:
            for i, h in enumerate(kv.hashes["a"]):
                block = tuple(r.token_slice(i * bs, (i + 1) * bs))
                prev = kv.hashes["a"][i - 1] if i else 0
                assert h == hash((prev, block))
            # The pool's index: whole blocks of final tokens, each where the request has them.
            for i, bid in enumerate(kv.block_table("a")):
                b = kv.pool.blocks[bid]
                if b.block_hash is not None:
                    assert (i + 1) * bs <= r.num_computed_tokens and b.tokens == tuple(r.token_slice(i * bs, (i + 1) * bs))
        for bid in kv.pool.cached.values():
            assert len(kv.pool.blocks[bid].tokens) == bs
    assert sched.spec_accepted > 0 and sched.spec_proposed > sched.spec_accepted


def test_speculation_options_are_validated_with_flag_names():
    with pytest.raises(ConfigError, match="--speculate"):
        EngineOptions(speculate="medusa")
    with pytest.raises(ConfigError, match="--num-speculative-tokens"):
        EngineOptions(num_speculative_tokens=0)
    with pytest.raises(ConfigError, match="--ngram-max"):
        EngineOptions(ngram_min=3, ngram_max=2)
    with pytest.raises(ConfigError, match="--ngram-min"):
        EngineOptions(ngram_min=0)
    with pytest.raises(ConfigError, match="--draft-length"):
        EngineOptions(draft_length="longest")


def test_stop_token_inside_an_accepted_run_ends_the_request_there():
    kv = PagedKVManager(50, 4, prefix_caching=True)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
                      proposer=PromptLookupProposer(4, 1, 2))
    r = Request("a", [1, 2, 3, 9, 1, 2], SamplingParams(max_tokens=20, stop_token_ids=(9,)))
    sched.add(r)
    out = sched.schedule()  # prefill
    sched.update_from_output(out, RunnerOutput({"a": [3]}))
    out = sched.schedule()
    (c,) = out.chunks
    assert c.spec_token_ids == (9, 1, 2, 3)  # after [1 2 3] came [9 1 2 3 ...]
    # The model agrees with all four guesses; the run stops at the stop token, the first of them.
    new = sched.update_from_output(out, RunnerOutput({"a": [9, 1, 2, 3, 7]}))
    assert [t for _, t in new] == [9] and r.output_token_ids == [3, 9] and r.finish_reason == "stop"
    assert kv.num_free_blocks == kv.num_blocks and sched.spec_accepted == 4


# --- the command line ----------------------------------------------------------------------------------
def test_speculation_flags_fail_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from cli_helpers import one_line_error
    from kvcli.cli import app

    src = tmp_path / "t.txt"
    src.write_text("hello")
    runner = CliRunner()
    for args, needle in ((["--num-speculative-tokens", "0"], "--num-speculative-tokens"),
                         (["--num-speculative-tokens", "99"], "--num-speculative-tokens"),
                         (["--ngram-min", "3", "--ngram-max", "2"], "--ngram-max")):
        one_line_error(runner.invoke(app, ["continue", str(src), "--speculate", "ngram", *args]), needle)
        one_line_error(runner.invoke(app, ["profile", "--simulate", "--no-live", *args]), needle)


def test_profile_compare_spec_puts_a_speculative_run_beside_a_plain_one(tmp_path):
    import json

    from typer.testing import CliRunner

    from kvcli.cli import app

    out = tmp_path / "p.json"
    r = CliRunner().invoke(app, ["profile", "--model", "dummy:llama-2-7b", "--simulate", "--no-live", "-N", "6",
                                 "--workload", "alpaca", "--compare", "spec", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "paged + ngram k<=5" in r.stdout and "guesses accepted" in r.stdout  # (--draft-length adaptive)
    plain, spec = json.loads(out.read_text())["runs"]
    assert plain["speculation"]["method"] == "none" and spec["speculation"]["proposed"] > 0
    # The simulated model always says 0 and prompt lookup guesses 0s: fewer steps, same tokens.
    assert spec["output_tokens"] == plain["output_tokens"] and spec["steps"] < plain["steps"]
    assert spec["speculation"]["tokens_per_request_step"] > 1.0


def test_guess_slots_never_cause_a_preemption():
    """A's guesses would take the last free blocks, which B needs for its next token: A runs without
    guesses this step rather than B being preempted."""
    kv = PagedKVManager(6, 4, prefix_caching=False, watermark=0.0)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                      proposer=PromptLookupProposer(5, 1, 2))
    a = Request("a", [1, 2, 3, 4, 5, 1, 2], SamplingParams(max_tokens=20, ignore_eos=True))
    b = Request("b", [9, 8, 7, 6, 5, 4, 3, 2], SamplingParams(max_tokens=20, ignore_eos=True))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.update_from_output(out, RunnerOutput({"a": [3], "b": [1]}))
    assert kv.num_free_blocks == 2  # a: 8 tokens in 2 blocks; b: 9 tokens, the 9th needs a third block
    out = sched.schedule()
    assert not out.preempted and sched.num_preemptions == 0
    chunks = {c.req_id: c for c in out.chunks}
    assert chunks["a"].spec_token_ids == () and len(chunks["b"].token_ids) == 1
    kv.check_invariants()


def test_views_show_the_speculation_figures():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_dashboard import flat, make_snapshot, render_text

    from kvcli.metrics.snapshot import SpecSummary
    from kvcli.view.dashboard import render_dashboard
    from kvcli.view.plain_log import format_log_line
    from kvcli.view.summary import snapshot_dict, summary_table

    sp = SpecSummary(method="ngram", k=5, proposed=800, accepted=328, verifications=200, request_steps=250,
                     request_step_tokens=578, paused=1, last_step_guesses=5)
    s = make_snapshot(spec=sp)
    text = flat(render_text(render_dashboard(s, width=140), width=140))
    assert "ngram k=5: 41.0% of 800 accepted" in text and "2.31 tok/step/req" in text
    assert "5 guess slots last step" in text and "1 paused" in text
    assert "spec 41.0% accepted, 2.31 tok/step/req" in format_log_line(s)
    summary = flat(render_text(summary_table(s), width=140))
    assert "328 of 800 guesses accepted (41.0%)" in summary
    assert snapshot_dict(s)["speculation"]["acceptance_rate"] == 0.41
    assert "4.0/verify" in text and "in 200 verifications (4.0 each)" in summary
    assert snapshot_dict(s)["speculation"]["mean_draft"] == 4.0
    adaptive = make_snapshot(spec=SpecSummary(method="ngram", k=5, adaptive=True, proposed=300, verifications=120))
    assert "ngram k<=5 adaptive:" in flat(render_text(render_dashboard(adaptive, width=140), width=140))
    assert "2.5/verify" in flat(render_text(render_dashboard(adaptive, width=140), width=140))
    assert snapshot_dict(adaptive)["speculation"]["adaptive"] is True
    assert "speculation" not in flat(render_text(render_dashboard(make_snapshot(), width=140), width=140))
