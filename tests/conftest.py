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
