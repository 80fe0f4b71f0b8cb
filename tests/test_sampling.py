"""Sampling and stopping: the sampler's filters on known logits, seeds, stop strings and token ids
through the engine (a 2-layer dummy model with the byte tokenizer: fast, deterministic)."""

from __future__ import annotations

import json

import pytest
import torch

from kvcli.config import PRESETS, SamplingParams
from kvcli.llm import LLM
from kvcli.sampler import argmax, argmax_rows, sample


def test_greedy_top_k_top_p_on_known_logits():
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0, 1.0])
    assert sample(logits, SamplingParams(), None) == 1
    g = torch.Generator().manual_seed(0)
    # top-k 2 keeps ids 1 and 2 only
    picks = {sample(logits, SamplingParams(temperature=1.0, top_k=2), g) for _ in range(200)}
    assert picks == {1, 2}
    # top-p: p(1) ~ 0.47, p(2) ~ 0.43: 0.5 keeps both, 0.4 keeps only the first
    picks = {sample(logits, SamplingParams(temperature=1.0, top_p=0.5), g) for _ in range(200)}
    assert picks == {1, 2}
    assert {sample(logits, SamplingParams(temperature=1.0, top_p=0.4), g) for _ in range(50)} == {1}


def test_greedy_fast_path_picks_what_torch_argmax_picks():
    g = torch.Generator().manual_seed(3)
    rows = [torch.randn(49152, generator=g) for _ in range(4)]
    rows[1][[7, 30000, 49151]] = 40.0  # ties: the first wins
    rows[2][[9, 20]] = float("nan")  # NaN counts as the maximum, the first NaN wins
    rows[3][:] = float("-inf")
    rows[3][[5, 6]] = float("inf")
    rows.append(torch.tensor([-0.0, 0.0, -1.0]))
    rows.append(torch.randn(8, 49152, generator=g)[3])  # a row of a batch of logits (a contiguous view)
    for r in rows:
        assert argmax(r) == int(torch.argmax(r))
        assert sample(r, SamplingParams(), None) == int(torch.argmax(r))
    strided = torch.randn(49152, 2, generator=g)[:, 1]  # not contiguous: torch's own kernel
    assert argmax(strided) == int(torch.argmax(strided))
    half = torch.randn(100, generator=g).bfloat16()  # not fp32: torch's own kernel
    assert argmax(half) == int(torch.argmax(half))


def test_greedy_rows_pick_what_torch_argmax_picks():
    """A verification's rows (spec_decode/acceptance.py): argmax_rows is torch.argmax(dim=-1) row for row, ties,
    NaN and infinities included, for a contiguous fp32 batch (NumPy) and the others (torch)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(7, 49152, generator=g)
    x[1, [7, 30000, 49151]] = 40.0
    x[2, [9, 20]] = float("nan")
    x[3, :] = float("-inf")
    x[3, [5, 6]] = float("inf")
    x[4, :] = 0.0
    x[4, 3] = -0.0
    for t in (x, x[2:5], x[:, ::2], x.bfloat16(), x[:1]):
        assert argmax_rows(t) == torch.argmax(t, dim=-1).tolist()


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-0.1), dict(top_p=0), dict(top_p=1.1),
                                 dict(top_k=-1), dict(n=0)])
def test_sampling_params_validation(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    f = tmp_path_factory.mktemp("cfg") / "tiny.json"
    f.write_text(json.dumps(dict(PRESETS["smollm2-135m"], num_hidden_layers=2, vocab_size=259)))
    return LLM(f"dummy:{f}", kv_budget="8MiB", dequantize=True)


def test_seed_makes_sampling_repeatable(tiny_llm):
    p = SamplingParams(max_tokens=20, temperature=1.0, seed=7, ignore_eos=True)
    a, b = tiny_llm.generate(["abc", "abc"], [p, p])
    c = tiny_llm.generate(["abc"], p.with_(seed=8))[0]
    assert a.token_ids == b.token_ids != c.token_ids


def test_stop_token_ids_and_stop_strings(tiny_llm):
    base = tiny_llm.generate(["hello"], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert len(base.token_ids) == 24 and base.finish_reason == "length"
    # Stop on the 6th generated token id: generation ends there (the id is kept, not its text).
    stop_id = base.token_ids[5]
    first = base.token_ids.index(stop_id)
    out = tiny_llm.generate(["hello"], SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=(stop_id,)))[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[:first + 1]
    # A stop string from the middle of the text: the text ends right before it.
    text = base.text
    assert len(text) >= 6, text
    s = text[3:5]
    out = tiny_llm.generate(["hello"], SamplingParams(max_tokens=24, ignore_eos=True, stop=(s,)))[0]
    assert out.finish_reason == "stop" and out.text == text[:text.find(s)]
    assert len(out.token_ids) < len(base.token_ids)


def test_streaming_callback_sees_every_token(tiny_llm):
    seen = []
    outs = tiny_llm.generate(["ab", "xyz"], SamplingParams(max_tokens=9, ignore_eos=True), on_output=seen.append)
    for o in outs:
        assert [t for s in seen if s.req_id == o.req_id for t in s.new_token_ids] == o.token_ids
    assert sum(s.finished for s in seen) == 2


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_llm):
    """A request's seed fixes its tokens whatever runs beside it: alone, or batched with prompts of
    other lengths, other seeds and no seed (each request draws from its own generator)."""
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, top_k=50, seed=11, ignore_eos=True)
    alone = tiny_llm.generate(["the keeper"], p)[0].token_ids
    mix = [("abc", SamplingParams(max_tokens=5, temperature=0.8, seed=3, ignore_eos=True)),
           ("the keeper", p),
           ("a much longer prompt " * 6, SamplingParams(max_tokens=30, temperature=1.2, ignore_eos=True)),
           ("x", SamplingParams(max_tokens=9, temperature=0.7, seed=11, ignore_eos=True))]
    outs = tiny_llm.generate([m[0] for m in mix], [m[1] for m in mix])
    assert outs[1].token_ids == alone
    later = tiny_llm.generate(["x", "the keeper"], [mix[3][1], p])  # another mix, another order
    assert later[1].token_ids == alone and later[0].token_ids == outs[3].token_ids
