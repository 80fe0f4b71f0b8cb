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


ARCH_CONFIGS = {  # tiny shapes of each architecture beyond Llama (issue #29: every backend)
    "gemma2": dict(model_type="gemma2", sliding_window=8, attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
                   query_pre_attn_scalar=24),
    "gemma3": dict(model_type="gemma3_text", sliding_window=8, sliding_window_pattern=2, query_pre_attn_scalar=24,
                   rope_local_base_freq=500.0),
    "qwen3": dict(model_type="qwen3"),
    "phi3": dict(model_type="phi3"),
}


@pytest.mark.parametrize("arch", list(ARCH_CONFIGS))
def test_architectures_through_the_triton_backend(tmp_path, arch):
    """Each architecture's logits at every position of a chunked prompt (chunks past Gemma's window of 8), the
    Triton backend against the torch backend: q/k norms, sliding layers, Gemma 2's attention soft-cap, and
    Gemma's KV groups (its sliding layer's own block table, whose blocks before the window go back)."""
    import torch

    from engine_steps import forced_step

    cfg = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
               **ARCH_CONFIGS[arch])
    f = tmp_path / f"{arch}.json"
    f.write_text(json.dumps(cfg))
    ids = [(i * 37) % 500 + 3 for i in range(45)]
    logits = {}
    for backend in ("torch", "triton"):
        eng = LLM(f"dummy:{f}", kv_budget="4MiB", attention_backend=backend, dequantize=True).engine
        assert eng.config.architecture == arch
        rows, pos = [], 0
        assert eng.kv_groups.hybrid == arch.startswith("gemma")
        while pos < len(ids):  # two chunks of 20, then one-token decode steps
            part = ids[pos:pos + (20 if pos < 40 else 1)]
            rows.append(eng.runner.execute(forced_step(eng, "x", part, pos), all_logits=True).logits)
            pos += len(part)
        if eng.kv_groups.hybrid:  # the sliding layer's table gave back the blocks before its window
            assert eng.kv.group_tables("x")[1][:2] == [0, 0] and 0 not in eng.kv.group_tables("x")[0]
        logits[backend] = torch.cat(rows)
    assert logits["torch"].std() > 0.01
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-4, rtol=1e-4)
