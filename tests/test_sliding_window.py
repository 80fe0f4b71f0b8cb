"""Sliding-window attention (Mistral): read from config.json / GGUF metadata, applied by the torch and
invariant backends, and exact against transformers' MistralForCausalLM (eager attention, whose mask
lets position p see keys [p - sliding_window + 1, p])."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cli_helpers import one_line_error
from kvcli.cli import app
from kvcli.config import ModelConfig
from kvcli.llm import LLM
from kvcli.model.gguf_file import GGUFFile
from kvcli.model.gguf_loader import GGUFError, read_config
from kvcli.step import ScheduledChunk, SchedulerOutput

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


def test_window_from_gguf_metadata():
    assert read_config(_gguf({"llama.attention.sliding_window": 4096}), Path("m.gguf")).sliding_window == 4096
    assert read_config(_gguf({"llama.attention.sliding_window": 0}), Path("m.gguf")).sliding_window is None
    assert read_config(_gguf({}), Path("m.gguf")).sliding_window is None
    with pytest.raises(GGUFError, match="sliding_window"):
        read_config(_gguf({"llama.attention.sliding_window": [4096, 0]}), Path("m.gguf"))


def test_window_leaves_kv_arithmetic_alone():
    """Every token's K/V is still stored: plan/inspect bytes per token do not change."""
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


def teacher_forced(engine, ids: list[int], prefill: int, chunk: int) -> torch.Tensor:
    """Logits at every position: `prefill` tokens in chunks of `chunk`, then one decode step per token."""
    rows, pos, seen = [], 0, set()
    while pos < len(ids):
        n = min(chunk, prefill - pos) if pos < prefill else 1
        assert engine.kv.allocate("tf", pos + n, pos)
        table = engine.kv.block_table("tf")
        # Zero blocks on first use, as the scheduler has the runner do (new_blocks): attention reads
        # past a request's last token inside its last block (masked), which must not hold NaN.
        engine.kv_cache.zero_blocks([b for b in table if b not in seen])
        seen.update(table)
        step = SchedulerOutput([ScheduledChunk("tf", ids[pos:pos + n], pos, table, True)])
        rows.append(engine.runner.execute(step, all_logits=True).logits)
        pos += n
    engine.kv.free("tf")
    return torch.cat(rows)


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
    model.config = replace(model.config, sliding_window=None)
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
