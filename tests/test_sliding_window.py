"""Sliding-window attention (Mistral): read from config.json / GGUF metadata, applied by the torch and
invariant backends, and exact against transformers' MistralForCausalLM (eager attention, whose mask
lets position p see keys [p - sliding_window + 1, p])."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cli_helpers import one_line_error
from kvcli.cli import app
from kvcli.config import ModelConfig
from kvcli.llm import LLM
from kvcli.model.gguf_file import GGUFFile
from kvcli.model.gguf_loader import read_config
from engine_steps import teacher_forced

WINDOW = 8
BASE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)


# config.json and GGUF metadata --------------------------------------------------------------------

@pytest.mark.parametrize(("extra", "want"), [
    (dict(model_type="mistral", sliding_window=4096), 4096),
    (dict(model_type="mistral", sliding_window=None), None),
    (dict(model_type="mistral"), None),
    (dict(model_type="mistral", sliding_window=8, layer_types=["sliding_attention"] * 2), 8),
    (dict(model_type="qwen2", sliding_window=4096, use_sliding_window=False), None),
    (dict(model_type="qwen2", sliding_window=4096, use_sliding_window=True, max_window_layers=0), 4096),
    (dict(model_type="qwen2", sliding_window=4096, use_sliding_window=True, max_window_layers=2), None),
    (dict(model_type="qwen2", sliding_window=64, use_sliding_window=False, layer_types=["sliding_attention"] * 2),
     None),
    (dict(model_type="llama", sliding_window=4096), None),  # transformers' Llama has no window
])
def test_window_from_config_json(extra, want):
    assert ModelConfig.from_hf_dict({**BASE, **extra}).sliding_window == want


@pytest.mark.parametrize("extra", [
    dict(model_type="qwen2", sliding_window=4096, use_sliding_window=True, max_window_layers=1),
    dict(model_type="mistral", sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    dict(model_type="mistral", sliding_window=0),
    dict(model_type="mistral", sliding_window="8"),
])
def test_unsupported_windows_are_refused_in_one_line(tmp_path, extra):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **extra}))
    needle = "per-layer" if "layer" in json.dumps(extra) else "sliding_window"
    one_line_error(CliRunner().invoke(app, ["plan", "--model", str(tmp_path)]), needle)


def _gguf(meta: dict) -> GGUFFile:
    base = {"general.architecture": "llama", "llama.attention.head_count": 4, "llama.embedding_length": 64,
            "llama.vocab_size": 100, "llama.feed_forward_length": 128, "llama.block_count": 2}
    return GGUFFile(Path("m.gguf"), 3, {**base, **meta}, [])


def test_a_llama_gguf_window_is_ignored_as_llama_cpp_ignores_it():
    """llama.cpp's llama graph attends to the whole context whatever attention.sliding_window says (the
    conformance suite's window-key variants measure it), so kvcli reads such a file the same way; a window
    is a Hugging Face folder's (Mistral's config.json) or Gemma 3's."""
    for meta in ({"llama.attention.sliding_window": 4096}, {"llama.attention.sliding_window": 0}, {}):
        assert read_config(_gguf(meta), Path("m.gguf")).sliding_window is None


def test_window_leaves_kv_arithmetic_alone():
    """A token's K/V is the same size with a window (what a request holds is priced below): plan/inspect
    bytes per token do not change."""
    full = ModelConfig.from_hf_dict({**BASE, "model_type": "mistral"})
    windowed = ModelConfig.from_hf_dict({**BASE, "model_type": "mistral", "sliding_window": WINDOW})
    assert windowed.kv_bytes_per_token("fp16") == full.kv_bytes_per_token("fp16")


# against transformers -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mistral(tmp_path_factory, gguf_path):
    """A tiny random Mistral with sliding_window=8 saved as a Hugging Face folder, and the model."""
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    out = tmp_path_factory.mktemp("mistral")
    AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(str(out))
    cfg = MistralConfig(**BASE, sliding_window=WINDOW, rope_theta=10000.0, tie_word_embeddings=False,
                        initializer_range=0.2, attn_implementation="eager")  # eager honours the window
    torch.manual_seed(0)
    model = MistralForCausalLM(cfg).eval()
    model.save_pretrained(str(out))
    return out, model


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "invariant"])
def test_logits_match_transformers_mistral(mistral, backend):
    path, ref = mistral
    llm = LLM(str(path), quant="none", attention_backend=backend, block_size=8, kv_budget="4MiB",
              max_num_batched_tokens=7)
    assert llm.engine.config.sliding_window == WINDOW
    ids = list(range(300, 342))
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    # Chunks of 7 (ending mid-block; windows span chunk borders and reach into earlier chunks), then 17
    # decode steps, every one of them with more than WINDOW tokens before it.
    got = teacher_forced(llm.engine, ids, prefill=25, chunk=7)
    err = (got - want).abs().max().item()
    assert err < 1e-3, f"max abs logit error {err:.2e}"
    # The same engine with the window dropped is far off after WINDOW tokens: the check above has teeth.
    model = llm.engine.runner.model
    for layer in model.layers:  # each layer's window is fixed when the model is built
        layer.window = 0
    wrong = teacher_forced(llm.engine, ids, prefill=25, chunk=7)
    assert (wrong[:WINDOW] - want[:WINDOW]).abs().max().item() < 1e-3
    assert (wrong[WINDOW:] - want[WINDOW:]).abs().max().item() > 100 * 1e-3


@pytest.mark.slow
def test_scored_through_step_budget_matches_transformers(mistral):
    """The scheduler-driven path (`score`: prefill in chunks of --max-batch-tokens) under the window."""
    path, ref = mistral
    llm = LLM(str(path), quant="none", attention_backend="torch", block_size=8, kv_budget="4MiB",
              max_num_batched_tokens=5)
    ids = list(range(500, 540))
    with torch.no_grad():
        logp = ref(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    want = -logp[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    got = llm.engine.score(ids)
    assert (got - want).abs().max().item() < 1e-3


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_window_survives_to_hf_dict(arch):
    c = ModelConfig.from_hf_dict({**BASE, "model_type": arch, "sliding_window": WINDOW, "use_sliding_window": True,
                                  "max_window_layers": 0})
    assert c.sliding_window == WINDOW
    assert ModelConfig.from_hf_dict(c.to_hf_dict()).sliding_window == WINDOW


# blocks outside the window go back (kvcache/block_manager.py: true positions, null entries) -------------

def test_paged_window_releases_blocks_and_keeps_the_table_aligned():
    """Random admits, chunked growth, guesses rolled back, forks, swap-style trims and frees on a windowed
    layout: invariants hold, every table still covers its tokens (slot = table[p // block]), the entries a
    step reads are held blocks, and no request ever holds more than the window's bound."""
    import random

    from kvcli.kvcache.block_manager import PagedKVManager
    from kvcli.kvcache.interface import NULL_BLOCK

    bs, w, chunk = 4, 6, 5
    recycled = 0
    for seed in range(40):
        rng = random.Random(seed)
        kv = PagedKVManager(30, bs, sliding_window=w)
        kv.step_tokens = chunk + 3  # guesses ride on a chunk
        bound = kv.window_blocks(chunk + 3)
        tokens: dict[str, int] = {}
        for _ in range(80):
            rid = f"r{rng.randrange(5)}"
            op = rng.choice(["admit", "grow", "grow", "guess", "fork", "swap", "free"])
            if op == "admit" and rid not in tokens:
                n = rng.randint(1, chunk)
                if kv.admit(rid, n, 0, n):
                    tokens[rid] = n
            elif op == "grow" and rid in tokens:
                n = rng.randint(1, chunk)
                if kv.allocate(rid, tokens[rid] + n, tokens[rid]):
                    tokens[rid] += n
            elif op == "guess" and rid in tokens:
                if kv.allocate(rid, tokens[rid] + 1 + 3, tokens[rid]):
                    tokens[rid] += 1 + rng.randint(0, 3)
                    kv.truncate(rid, tokens[rid])
            elif op == "fork" and rid in tokens and f"{rid}f" not in tokens:
                kv.fork(rid, f"{rid}f")
                tokens[f"{rid}f"] = tokens[rid]
            elif op == "swap" and rid in tokens:  # out (only the held blocks) and straight back
                kv.trim(rid, tokens[rid])
                held = len(kv.held_blocks(rid))
                kv.free(rid, swapped=True)
                if kv.admit(rid, tokens[rid], tokens[rid], tokens[rid]):
                    assert len(kv.held_blocks(rid)) == held
                else:
                    del tokens[rid]
            elif op == "free" and rid in tokens:
                kv.free(rid)
                del tokens[rid]
            kv.take_copies()
            kv.check_invariants()
            for r, t in tokens.items():
                table = kv.block_table(r)
                assert len(table) == -(-t // bs)
                first = max(0, t - w + 1) // bs  # the block of the oldest key the next step reads
                assert NULL_BLOCK not in table[first:]
                assert len(kv.held_blocks(r)) <= bound
        for r in list(tokens):
            kv.free(r)
        kv.check_invariants()
        assert kv.num_free_blocks == 30
        recycled += kv.recycled_blocks
    assert recycled > 100  # the releases happened (the checks above ran on windowed tables)


def _windowed_config(window: int) -> ModelConfig:
    return ModelConfig.from_hf_dict({**BASE, "model_type": "mistral", "sliding_window": window,
                                     "max_position_embeddings": 4096}, name="sim-mistral")


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_simulated_windowed_requests_hold_only_their_window(preempt):
    """Through the real scheduler (speculation, n = 2 forks, preemption): requests far longer than the pool
    finish, each holding at most the window's bound, because blocks before the window go back; with them
    kept (sliding_window 0 on the layout) the same requests cannot run."""
    from kvcli.config import SamplingParams
    from kvcli.engine.llm_engine import LLMEngine
    from kvcli.engine.scheduler import KVBudgetTooSmall
    from kvcli.kvcache.block_manager import PagedKVManager
    from kvcli.options import EngineOptions

    cfg = _windowed_config(64)
    per_block = cfg.kv_bytes_per_token("fp16") * 16
    opts = EngineOptions(block_size=16, kv_budget=str(25 * per_block), max_model_len=4096, kv_dtype="fp16",
                         max_num_batched_tokens=48, speculate="ngram", preempt=preempt,
                         swap_space=str(64 * per_block))
    e = LLMEngine(None, opts, config=cfg)
    assert isinstance(e.kv, PagedKVManager) and e.kv.sliding_window == 64 and e.kv.num_blocks == 24
    bound = e.kv.window_blocks(48)
    assert bound == 8
    reqs = [e.add_request(list(range(1, 1000 + 37 * i)), SamplingParams(max_tokens=300, ignore_eos=True, n=1 + (i == 0)))
            for i in range(4)]
    while e.has_unfinished():
        e.step()
        e.kv.check_invariants()
        for r in e.scheduler.running:
            assert len(e.kv.held_blocks(r.req_id)) <= bound
    done = [e.requests[r.req_id] for r in reqs] + [e.requests[f"{reqs[0].req_id}.1"]]
    assert all(len(r.output_token_ids) == 300 and r.finish_reason == "length" for r in done)
    assert e.kv.peak_held_blocks <= bound < 24
    assert e.scheduler.num_preemptions > 0  # five of them at once do not fit: the pool was under pressure
    assert e.kv.num_free_blocks == 24
    # Kept whole, one prompt alone needs 63 blocks of the 24: refused at once.
    keep = LLMEngine(None, opts, config=cfg)
    keep.kv.sliding_window = 0
    with pytest.raises(KVBudgetTooSmall, match="holds 24 blocks of 16 tokens; this request needs 63 "):
        keep.add_request(list(range(1, 1000)), SamplingParams(max_tokens=300, ignore_eos=True))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "invariant"])
def test_mistral_holds_its_window_with_logits_unchanged(mistral, backend):
    """The tiny Mistral over 200 tokens (prefill in chunks of 7, then decode steps): the layout holds at most
    ceil((W - 1 + 7) / 8) + 1 = 3 blocks at a time instead of all 25, the logits stay within 1e-3 of
    transformers, and they equal bit for bit those of the same engine keeping every block."""
    path, ref = mistral
    llm = LLM(str(path), quant="none", attention_backend=backend, block_size=8, kv_budget="4MiB",
              max_num_batched_tokens=7)
    kv = llm.engine.kv
    assert kv.sliding_window == WINDOW
    ids = [(i * 7919) % 40000 + 300 for i in range(200)]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    got = teacher_forced(llm.engine, ids, prefill=100, chunk=7)
    assert kv.peak_held_blocks == kv.window_blocks(7) == 3
    assert kv.recycled_blocks >= 25 - 3
    err = (got - want).abs().max().item()
    assert err < 1e-3, f"max abs logit error {err:.2e}"
    kv.sliding_window, kv.peak_held_blocks = 0, 0  # keep every block
    kept = teacher_forced(llm.engine, ids, prefill=100, chunk=7)
    assert kv.peak_held_blocks == 25
    assert torch.equal(got, kept)


@pytest.mark.slow
def test_mistral_generation_is_unchanged_by_releasing_blocks(mistral):
    """Greedy generation through the scheduler (two prompts past the window, one with n = 2, guesses, a
    pool too small to keep both prompts whole, so the run that keeps every block preempts): the same tokens
    with blocks released as without, and the released run never holds more than the bound."""
    from kvcli.config import SamplingParams

    path, _ = mistral
    outs = {}
    for release in (True, False):
        llm = LLM(str(path), quant="none", block_size=8, kv_budget="160KiB", max_num_batched_tokens=16,
                  speculate="ngram", preempt="swap", swap_space="1MiB")
        kv = llm.engine.kv
        if not release:
            kv.sliding_window = 0
        prompts = [[(i * 131) % 30000 + 300 for i in range(150)], [(i * 17) % 97 + 500 for i in range(90)]]
        res = llm.generate(prompts, [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, n=2),
                                     SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)])
        outs[release] = [[list(s.token_ids) for s in (r, *r.samples)] for r in res]
        kv.check_invariants()
        if release:
            assert kv.peak_held_blocks <= kv.window_blocks(16) < -(-190 // 8)
            assert llm.engine.scheduler.num_preemptions == 0
        else:
            assert llm.engine.scheduler.num_preemptions > 0
    assert outs[True] == outs[False]


@pytest.mark.slow
def test_continue_on_a_sliding_window_model(mistral, tmp_path):
    """continue's default bounded cache (--kv-window auto) stands aside for a model with its own window: a
    text that fits runs (the layout releases the blocks before the window instead); a longer one is refused
    in one line naming --truncate head and an explicit --kv-window inside the model's window, not auto; an
    explicit --kv-window that does not fit in the model's window (8 tokens here) is refused in one line."""
    path, _ = mistral
    text = tmp_path / "t.txt"
    text.write_text("The keeper climbed the stairs and lit the lamp. " * 6, encoding="utf-8")
    base = ["continue", str(text), "--model", str(path), "--quant", "none", "--block-size", "8", "-n", "5",
            "--temperature", "0"]
    r = CliRunner().invoke(app, [*base, "--json"])
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["kv_window"] is None and len(d["generated_token_ids"]) == 5
    long = tmp_path / "long.txt"
    long.write_text("The keeper climbed the stairs and lit the lamp. " * 80, encoding="utf-8")  # > 512 tokens
    r = CliRunner().invoke(app, [*base[:1], str(long), *base[2:], "--no-live"])
    one_line_error(r, "8-token sliding window")
    assert "--truncate head" in r.stderr and "--kv-window auto" not in r.stderr
    one_line_error(CliRunner().invoke(app, [*base, "--kv-window", "64", "--no-live"]), "attends to its last 8 tokens")


@pytest.fixture(scope="module")
def mistral_wide(tmp_path_factory, gguf_path):
    """The tiny Mistral with a 64-token window: room for 8 sink slots + a 40-token window + a block of 8."""
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    out = tmp_path_factory.mktemp("mistral64")
    AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(str(out))
    cfg = MistralConfig(**BASE, sliding_window=64, rope_theta=10000.0, tie_word_embeddings=False,
                        initializer_range=0.2, attn_implementation="eager")
    torch.manual_seed(1)
    MistralForCausalLM(cfg).eval().save_pretrained(str(out))
    return out


def test_a_bounded_cache_inside_the_models_window(mistral_wide):
    """--kv-window on a model whose every layer slides (issue #27): sinks + window inside the model's own window,
    so every kept key stays in the layers' sight. A text past the 512-token context streams through holding at
    most the rule's bound; a rebuild of the request (what recompute preemption does: only the sinks and the last
    W tokens, at compact positions) generates what a plain run over exactly those tokens generates; a window that
    would not fit in the model's is refused."""
    from kvcli.config import SamplingParams
    from kvcli.options import ConfigError

    ids = [(i * 131) % 30000 + 300 for i in range(700)]
    p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    opts = dict(quant="none", block_size=8, kv_budget="1MiB", kv_dtype="fp32", max_num_batched_tokens=16)
    bounded = LLM(str(mistral_wide), kv_window=40, sink_tokens=4, **opts)
    kv, r = bounded.engine.kv, bounded.engine.retention
    streamed = bounded.engine.add_request(ids, p)
    while bounded.engine.has_unfinished():
        bounded.engine.step()
        kv.check_invariants()
    assert r.max_slots <= 64 and kv.peak_held_blocks * 8 <= r.max_slots + 8
    assert streamed.dropped_tokens > 0 and len(streamed.output_token_ids) == 8
    rebuilt = bounded.engine.add_request(ids, p)
    rebuilt.skip_to_window = True
    while bounded.engine.has_unfinished():
        bounded.engine.step()
    plain = LLM(str(mistral_wide), **opts).generate([ids[:r.sink_slots] + ids[-r.window:]], p)[0]
    assert rebuilt.output_token_ids == list(plain.token_ids)
    with pytest.raises(ConfigError, match="attends to its last 64 tokens"):
        LLM(str(mistral_wide), kv_window=56, sink_tokens=4, **opts)
