"""The vocabulary projection's two CPU paths give the logits of the same table: the bf16 GEMM, and the
fp32 slices used where bf16 is emulated (checked against float64, across slice boundaries)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kvcli.model.vocab_head import MIN_ROWS_FOR_FP32_SLICES, SLICE_ROWS, VocabHead
from kvcli.model.weight_plan import HeadPlan
from kvcli.native.capabilities import cpu_flags, native_bf16


@pytest.mark.parametrize("rows", [1, MIN_ROWS_FOR_FP32_SLICES - 1, MIN_ROWS_FOR_FP32_SLICES, 33])
def test_fp32_slices_equal_the_table_in_fp32(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    vocab = 2 * SLICE_ROWS + 77  # a last slice that is not full
    w = torch.randn(vocab, 96, generator=g) * 0.05
    h = torch.randn(rows, 96, generator=g) * 3
    head = VocabHead(HeadPlan("dense", torch.bfloat16, tied=False, fp32_slices=True), w)  # the AVX2 path, anywhere
    wb = head.weight.double()  # the stored (bf16) table, exactly
    out = head(h)
    assert out.dtype == torch.float32 and out.shape == (rows, vocab)
    if rows >= MIN_ROWS_FOR_FP32_SLICES:  # fp32 activations against the bf16 table: float64-close
        torch.testing.assert_close(out.double(), h.double() @ wb.t(), rtol=1e-5, atol=1e-4)
    else:  # one row stays a bf16 GEMV: bitwise what the bf16 path computes
        assert torch.equal(out, F.linear(h.bfloat16(), head.weight).float())
    head.fp32_slices = False
    assert torch.equal(head(h), F.linear(h.bfloat16(), head.weight).float())


def test_avx2_environment_disables_native_bf16() -> None:
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
    code = "from kvcli.native.capabilities import native_bf16 as f; print(f())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    if not ({"avx512_bf16", "amx_bf16"} & cpu_flags()):
        assert not native_bf16()


def test_a_tied_q8_0_table_is_held_once_and_looks_up_the_same_rows(monkeypatch):
    """The bundled model's tied Q8_0 embedding: the vocabulary projection's packed copy serves the lookups
    (issue #30, one copy of each weight), rows bit for bit d * q as before, the same greedy tokens; inspect's
    resident figure counts it once."""
    import torch

    from kvcli.config import SamplingParams
    from kvcli.llm import LLM
    from kvcli.model import layers
    from kvcli.model.loader import load_weights

    shared = LLM(None)
    m = shared.engine.model
    if m.plan.head.form != "int8dot-cpu":
        pytest.skip("kvcli's C kernels are not built here: the table is not packed")
    assert m.embed.packed is not None and m.weight_bytes()["embedding"] == 0
    q = load_weights(None).weights["model.embed_tokens.weight"]
    ids = torch.tensor([0, 7, q.shape[0] - 1, 300, 300])
    want = (q.codes[ids].float().reshape(len(ids), -1, q.group_size) * q.scale[ids].float().unsqueeze(-1)).reshape(
        len(ids), -1)
    assert torch.equal(m.embed(ids), want)
    monkeypatch.setattr(layers.Embedding, "share", lambda self, packed: False)
    two = LLM(None)
    assert two.engine.model.weight_bytes()["embedding"] == q.nbytes
    p = SamplingParams(max_tokens=12)
    assert shared.generate(["The lighthouse keeper"], p)[0].token_ids == two.generate(["The lighthouse keeper"], p)[0].token_ids


def test_a_tied_k_quant_table_is_held_once(tmp_path, monkeypatch):
    """A tied Q6_K table (llama.cpp's Q4_K_M mix, kvcli/bench/shapes.py): looked up from the vocabulary
    projection's packed copy like Q8_0, rows bit for bit the table's dequantization, the same greedy tokens
    as with a second copy held for the lookups."""
    import torch

    from kvcli.bench.shapes import Shape, write_shape
    from kvcli.config import SamplingParams
    from kvcli.llm import LLM
    from kvcli.model import layers
    from kvcli.model.loader import load_weights

    path = write_shape(tmp_path / "q4km.gguf", Shape(256, 512, 2, 4, 2, tied=True), "Q4_K_M")
    shared = LLM(str(path))
    m = shared.engine.model
    if m.plan.head.form != "int8dot-cpu":
        pytest.skip("kvcli's C kernels are not built here: the table is not packed")
    q = load_weights(str(path)).weights["model.embed_tokens.weight"]
    assert q.kind == "q6" and m.embed.packed is not None and m.weight_bytes()["embedding"] == 0
    ids = torch.tensor([0, 9, q.shape[0] - 1, 4321, 4321])
    assert torch.equal(m.embed(ids), q.rows(ids).dequantize(torch.float32))
    monkeypatch.setattr(layers.Embedding, "share", lambda self, packed: False)
    two = LLM(str(path))
    assert two.engine.model.weight_bytes()["embedding"] == q.nbytes
    p = SamplingParams(max_tokens=12, ignore_eos=True)
    assert shared.generate([[1, 2, 3, 4]], p)[0].token_ids == two.generate([[1, 2, 3, 4]], p)[0].token_ids
