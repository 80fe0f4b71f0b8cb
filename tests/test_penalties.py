"""Presence, frequency and repetition penalties (issue #31, item 4): the penalty itself against a
hand-written reference, and through the engine with the bundled model, whose greedy text loops
without them: the penalized text repeats itself less, penalties at their neutral values change
nothing, and prompt-lookup speculation gives the same penalized tokens (each guess row is penalized
for the guesses before it)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from kvcli.config import SamplingParams
from kvcli.sampler import Penalties, apply_penalties, penalize_verification_rows


def reference(logits: list[float], pen: Penalties, out: list[int]) -> list[float]:
    x = list(logits)
    counts = Counter(out)
    for t in set(pen.prompt_ids) | set(out):
        if pen.repetition != 1.0:
            x[t] = x[t] / pen.repetition if x[t] > 0 else x[t] * pen.repetition
    for t, c in counts.items():
        x[t] -= pen.frequency * c + pen.presence
    return x


def test_apply_penalties_against_reference():
    rng = random.Random(3)
    for _ in range(200):
        v = rng.randint(2, 40)
        logits = [rng.uniform(-5, 5) for _ in range(v)]
        pen = Penalties(rng.choice([0.0, 0.5, -1.0]), rng.choice([0.0, 0.3, 2.0]), rng.choice([1.0, 1.3, 0.8]),
                        tuple(rng.randrange(v) for _ in range(rng.randint(0, 5))))
        out = [rng.randrange(v) for _ in range(rng.randint(0, 12))]
        got = apply_penalties(torch.tensor(logits), pen, out).tolist()
        assert got == pytest.approx(reference(logits, pen, out), abs=1e-5)
    x = torch.randn(10)
    assert torch.equal(apply_penalties(x, Penalties(), [1, 2, 2]), x)  # neutral: unchanged


def test_verification_rows_count_the_guesses_before_them():
    rng = random.Random(4)
    for _ in range(50):
        v, k = 12, rng.randint(1, 5)
        rows = torch.randn(k + 1, v)
        pen = Penalties(0.4, 0.7, 1.2, (1, 2))
        out = [rng.randrange(v) for _ in range(rng.randint(0, 6))]
        guesses = [rng.randrange(v) for _ in range(k)]
        got = penalize_verification_rows(rows, pen, out, guesses)
        for j in range(k + 1):
            want = reference(rows[j].tolist(), pen, out + guesses[:j])
            assert got[j].tolist() == pytest.approx(want, abs=1e-5)


PROMPT = "The keeper wrote in his log that"


def greedy(engine, penalties, n=40):
    pen = penalties or Penalties()
    params = SamplingParams(max_tokens=n, ignore_eos=True, presence_penalty=pen.presence,
                            frequency_penalty=pen.frequency, repetition_penalty=pen.repetition)
    req = engine.add_request(PROMPT, params)
    while engine.has_unfinished():
        engine.step()
    return list(req.output_token_ids)


@pytest.mark.slow
def test_penalties_through_the_engine(int4_llm):
    from kvcli.llm import LLM

    e = int4_llm.engine
    plain = greedy(e, None)
    assert len(set(plain)) < 0.7 * len(plain)  # the bundled model loops under greedy decoding
    assert greedy(e, Penalties(0.0, 0.0, 1.0)) == plain
    freq = greedy(e, Penalties(frequency=1.0))
    assert freq != plain and len(set(freq)) > len(set(plain))
    pres = greedy(e, Penalties(presence=1.5))
    assert len(set(pres)) > len(set(plain))
    rep = greedy(e, Penalties(repetition=1.5))
    prompt = set(e.tokenizer.encode(PROMPT))
    assert sum(t in prompt for t in rep) < sum(t in prompt for t in plain)
    spec = LLM(max_num_batched_tokens=512, kv_budget="64MiB", speculate="ngram").engine
    assert greedy(spec, None) == plain
    before = spec.scheduler.spec_accepted
    assert greedy(spec, Penalties(frequency=0.2)) == greedy(e, Penalties(frequency=0.2))
    assert spec.scheduler.spec_accepted > before  # guesses were accepted under the penalty


@pytest.mark.slow
def test_continue_and_chat_take_the_penalties(tmp_path):
    """The flags reach the sampler: a repetition penalty breaks the bundled model's greedy loop on `continue`
    (fewer repeated tokens, the same text otherwise identical run to run), chat accepts them too, and an
    out-of-range value is one line naming the flag."""
    import json
    import subprocess
    import sys

    kvcli = [sys.executable, "-c", "from kvcli.cli import main; main()"]
    src = tmp_path / "prompt.txt"
    src.write_text(PROMPT, encoding="utf-8")

    def ids(*flags):
        p = subprocess.run([*kvcli, "continue", str(src), "-n", "40", "--json", "--no-live", *flags],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)["generated_token_ids"]

    plain, pen = ids(), ids("--repetition-penalty", "1.3")
    assert pen != plain and len(set(pen)) > len(set(plain))
    assert ids("--presence-penalty", "0", "--frequency-penalty", "0", "--repetition-penalty", "1") == plain
    p = subprocess.run([*kvcli, "chat", "--no-live", "-n", "8", "--frequency-penalty", "0.5"], input="Hi\n",
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip(), p.stderr
    for cmd, flag, value in (("continue", "--presence-penalty", "2.5"), ("chat", "--repetition-penalty", "-1")):
        args = [*kvcli, cmd, *([str(src)] if cmd == "continue" else []), flag, value, "--no-live"]
        p = subprocess.run(args, input="Hi\n", capture_output=True, text=True, timeout=300)
        assert p.returncode != 0 and "Traceback" not in p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and flag in lines[0], p.stderr
