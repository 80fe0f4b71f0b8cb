"""The engine with the Triton attention backend gives the same greedy tokens as the torch backend
on the same weights (CPU under TRITON_INTERPRET=1, set by this folder's conftest)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton", reason="triton is not importable")

from kvcli.config import PRESETS, SamplingParams  # noqa: E402
from kvcli.llm import LLM  # noqa: E402


def test_triton_and_torch_backends_same_greedy_tokens(tmp_path):
    cfg = dict(PRESETS["smollm2-135m"], num_hidden_layers=2, vocab_size=512)
    f = tmp_path / "tiny.json"
    f.write_text(json.dumps(cfg))
    prompts = [[5, 9, 200, 31, 7, 88, 100, 3, 41, 17, 250, 66, 12, 19, 23, 45, 301, 2 + 9], [400, 401, 402]]
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(f"dummy:{f}", kv_budget="4MiB", attention_backend=backend, max_num_batched_tokens=12)
        assert llm.engine.backend.name == backend
        outs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["torch"] == outs["triton"]


@pytest.mark.parametrize("kv_dtype", [None, "int8", "fp8"])
def test_triton_and_torch_backends_same_logits_over_chunks(tmp_path, kv_dtype):
    """Stronger than tokens for a random model: logits at every position of a chunked prompt, over the
    default (fp32) cache and over int8 / fp8 caches (the Triton kernels quantize on write and
    dequantize in registers; the torch backend quantizes with kv_dtype.quantize and dequantizes)."""
    import torch

    from kvcli.step import ScheduledChunk, SchedulerOutput

    cfg = dict(PRESETS["smollm2-135m"], num_hidden_layers=2, vocab_size=512)
    f = tmp_path / "tiny.json"
    f.write_text(json.dumps(cfg))
    ids = [(i * 37) % 500 + 3 for i in range(45)]
    logits = {}
    for backend in ("torch", "triton"):
        eng = LLM(f"dummy:{f}", kv_budget="4MiB", attention_backend=backend, dequantize=True, kv_dtype=kv_dtype).engine
        assert eng.kv_dtype.name == (kv_dtype or "fp32")
        rows = []
        for pos in range(0, len(ids), 20):  # chunks of 20 over 16-token blocks: ends mid-block
            part = ids[pos:pos + 20]
            assert eng.kv.allocate("x", pos + len(part), pos)
            step = SchedulerOutput([ScheduledChunk("x", part, pos, eng.kv.block_table("x"), True)])
            rows.append(eng.runner.execute(step, all_logits=True).logits)
        logits[backend] = torch.cat(rows)
    assert logits["torch"].std() > 0.01
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-4, rtol=1e-4)
