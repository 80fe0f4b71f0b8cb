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
