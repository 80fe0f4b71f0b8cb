"""Shared fixtures: the bundled model through kvcli (exact and INT4 paths) and transformers'
reference model built from the same GGUF. Loading is slow, so these are session-scoped."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "samples" / "keepers-log.txt"


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    from kvcli.model.loader import bundled_gguf_path

    return bundled_gguf_path()


@pytest.fixture(scope="session")
def sample_text() -> str:
    return SAMPLE.read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def exact_llm():
    """Dense fp32 weights dequantized exactly as transformers does: the 1e-3 reference path."""
    from kvcli.llm import LLM

    return LLM(dequantize=True, max_num_batched_tokens=512, kv_budget="256MiB")


@pytest.fixture(scope="session")
def int4_llm():
    """The default path on CPU: weights resident in INT4."""
    from kvcli.llm import LLM

    return LLM(max_num_batched_tokens=512, kv_budget="256MiB")


@pytest.fixture(scope="session")
def hf_model(gguf_path):
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                             dtype=torch.float32)
    m.eval()
    return m


@pytest.fixture(scope="session")
def tiny_kquant(tmp_path_factory) -> Path:
    """A 2-layer llama GGUF with K-quant (and Q5/Q8) linears, written once per session (kquant_model.py)."""
    from kquant_model import write_tiny_kquant_gguf

    return write_tiny_kquant_gguf(tmp_path_factory.mktemp("kq") / "tiny-kquant.gguf")


@pytest.fixture(scope="session")
def gemma3_folder(tmp_path_factory, gguf_path):
    """A tiny random Gemma 3 text model saved by transformers (the bundled model's tokenizer) and the model:
    6 layers, 5 sliding (window 8) per global one, local and global rotary bases, linear scaling on the global
    layers, GeGLU, sandwich norms with weights away from 0 (transformers adds 1), query_pre_attn_scalar unlike
    head_dim, tied embeddings scaled by sqrt(hidden)."""
    import torch
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    out = tmp_path_factory.mktemp("gemma3")
    cfg = Gemma3TextConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                           tie_word_embeddings=True, initializer_range=0.2, head_dim=16, sliding_window=8,
                           query_pre_attn_scalar=24, final_logit_softcapping=None,
                           rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
                           pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="eager")
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)
    AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(str(out))
    model.save_pretrained(str(out))
    return out, model
