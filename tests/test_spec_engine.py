"""Speculative decoding on the real model: greedy output with guesses is token-identical to greedy
output without them, in batches, for several k, and under every engine mode a guess touches (chunked
prefill beside speculating decodes, preemption by recompute and by swap, the contiguous layout,
n > 1 forks). On the default INT4 weights through the batch-invariant attention backend
(`--attention-backend invariant`): verifying k + 1 positions in one pass must give each position the
bits a one-row decode would, and the INT4 kernel's bf16 activations turn any last-bit difference in
attention into a flipped near-tie (the default torch backend's SDPA calls round a 6-row chunk and a
1-row decode differently)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcli.config import SamplingParams
from kvcli.engine.llm_engine import EngineOptions, LLMEngine
from kvcli.llm import LLM
from kvcli.model.loader import load_weights

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
PER_BLOCK = 737280  # SmolLM2-135M: 16 tokens x 30 layers x 3 KV heads x 64 x 4 B x 2
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def shared_model():
    loaded = load_weights(None)
    engine = LLMEngine(loaded, EngineOptions(kv_budget="32MiB", max_model_len=512, attention_backend="invariant"))
    return loaded, engine.model


def prompts(tokenizer) -> list[list[int]]:
    """Repetitive texts (code, a table, a config file) and prose, of different lengths."""
    code = (REPO / "kvcli" / "engine" / "request.py").read_text()
    toml = (REPO / "pyproject.toml").read_text()
    prose = (REPO / "samples" / "keepers-log.txt").read_text()
    table = "| id | name | size |\n|---|---|---|\n" + "".join(f"| {i} | block-{i} | {16 * i} |\n" for i in range(1, 9))
    texts = [code[1200:1900], table, toml[:500], prose[:300], prose[2000:2900], code[:250]]
    return [tokenizer.encode(t)[:200] for t in texts]


def generate(shared_model, ids, params=None, **opts):
    loaded, model = shared_model
    engine = LLMEngine(loaded, EngineOptions(max_model_len=512, attention_backend="invariant", **opts), model=model)
    params = params or SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = LLM.from_engine(engine).generate(ids, params)
    engine.kv.check_invariants()
    return [o.token_ids for o in outs], engine


@pytest.fixture(scope="module")
def reference(shared_model):
    ids = prompts(shared_model[0].tokenizer)
    plain, _ = generate(shared_model, ids, kv_budget="64MiB")
    return ids, plain


@pytest.mark.parametrize("opts", [
    dict(num_speculative_tokens=5, kv_budget="64MiB"),
    dict(num_speculative_tokens=5, kv_budget="64MiB", draft_length="fixed"),
    dict(num_speculative_tokens=1, kv_budget="64MiB"),
    dict(num_speculative_tokens=8, ngram_min=1, ngram_max=3, kv_budget="64MiB"),
    # Prompts prefilled in 48-token chunks beside other requests' speculative decodes.
    dict(num_speculative_tokens=5, kv_budget="64MiB", max_num_batched_tokens=48),
    dict(num_speculative_tokens=5, kv_budget=str(24 * PER_BLOCK), max_num_batched_tokens=96),
    dict(num_speculative_tokens=5, kv_budget=str(24 * PER_BLOCK), max_num_batched_tokens=96, preempt="swap"),
    dict(num_speculative_tokens=5, kv_budget="64MiB", kv_layout="contiguous", reserve="request"),
], ids=["k5", "k5-fixed", "k1", "k8-ngram1", "chunked-prefill", "preempt-recompute", "preempt-swap", "contiguous"])
def test_greedy_speculation_is_token_identical(shared_model, reference, opts):
    ids, plain = reference
    spec, engine = generate(shared_model, ids, speculate="ngram", **opts)
    sp = engine.snapshot().spec
    assert sp.proposed > 0 and sp.accepted > 0
    for i, (a, b) in enumerate(zip(spec, plain)):
        assert a == b, f"prompt {i}: first difference at token {next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)}"
    if opts["kv_budget"].isdigit():  # the tight pools: requests must take turns
        assert engine.scheduler.num_preemptions > 0
    if opts.get("preempt") == "swap":
        assert not engine.runner.swapped


def test_n_samples_fork_beside_speculation(shared_model, reference):
    ids, plain = reference
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, n=2, temperature=0.0)
    loaded, model = shared_model
    engine = LLMEngine(loaded, EngineOptions(max_model_len=512, attention_backend="invariant", kv_budget="64MiB",
                                             speculate="ngram"), model=model)
    reqs = [engine.add_request(p, params) for p in ids[:2]]
    while engine.has_unfinished():
        engine.step()
        engine.kv.check_invariants()
    for r, ref in zip(reqs, plain):
        assert engine.requests[r.req_id].output_token_ids == ref
        assert engine.requests[f"{r.req_id}.1"].output_token_ids == ref


def test_seeded_sampling_with_speculation_is_reproducible(shared_model, reference):
    ids, _ = reference
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=7, ignore_eos=True)
    a, ea = generate(shared_model, ids[:2], params, kv_budget="64MiB", speculate="ngram")
    b, _ = generate(shared_model, ids[:2], params, kv_budget="64MiB", speculate="ngram")
    assert a == b and ea.snapshot().spec.proposed > 0


def test_greedy_identity_holds_with_torchs_avx2_kernels():
    """On CPUs without native bf16 (AVX2) kvcli picks matmul paths by row count (the int4 linears'
    fp32 read-back, the vocabulary projection's fp32 slices); the invariant backend must turn them
    off, or a verify chunk and a one-row decode round differently. A subprocess under torch's AVX2
    kernels runs one speculative batch against plain decoding."""
    import os
    import subprocess
    import sys

    script = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_spec_engine import generate, prompts
from kvcli.engine.llm_engine import EngineOptions, LLMEngine
from kvcli.model.loader import load_weights
loaded = load_weights(None)
model = LLMEngine(loaded, EngineOptions(kv_budget="32MiB", max_model_len=512, attention_backend="invariant")).model
assert model.lm_head.fp32_slices is False
ids = prompts(loaded.tokenizer)
plain, _ = generate((loaded, model), ids, kv_budget="64MiB")
spec, engine = generate((loaded, model), ids, kv_budget="64MiB", speculate="ngram", num_speculative_tokens=1)
assert engine.snapshot().spec.accepted > 0
assert spec == plain, "speculation changed greedy output under AVX2 kernels"
print("identical")
"""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and "identical" in r.stdout, r.stderr[-3000:]
