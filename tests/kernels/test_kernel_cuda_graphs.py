"""Decode steps through runner/cuda_graphs.py's static buffers (padded to a batch bucket, stale block-table
entries, KV length 0 on padding rows) give the logits and tokens of the plain path. On CPU the Triton
kernels run under the interpreter and nothing is captured (capture=False runs the same buffers eagerly);
on a GPU the graphs are captured and replayed (scripts/gpu_check.py, section g, times them)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton", reason="triton is not importable")

from kvcli.config import PRESETS, SamplingParams  # noqa: E402
from kvcli.kvcache.interface import blocks_for  # noqa: E402
from kvcli.llm import LLM  # noqa: E402
from kvcli.runner.cuda_graphs import DecodeGraphs, batch_buckets, graphable  # noqa: E402
from kvcli.runner.model_runner import build_metadata  # noqa: E402
from kvcli.step import ScheduledChunk, SchedulerOutput  # noqa: E402


def test_buckets_cover_every_batch_up_to_the_limit():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(6) == (1, 2, 4, 6)
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert batch_buckets(20) == (1, 2, 4, 8, 16, 20)


def test_only_plain_decode_steps_are_graphed():
    dec = ScheduledChunk("a", [5], 9, [1], True)
    assert graphable([dec, ScheduledChunk("b", [6], 3, [2], True)])
    assert not graphable([])
    assert not graphable([dec, ScheduledChunk("b", [6, 7], 3, [2], True)])  # a prefill chunk
    assert not graphable([ScheduledChunk("a", [5], 9, [1], False)])  # nothing sampled
    assert not graphable([ScheduledChunk("a", [5], 9, [1], True, spec_token_ids=(3, 4))])  # guesses to verify


GEMMA3 = dict(model_type="gemma3_text", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
              sliding_window=8, sliding_window_pattern=2, query_pre_attn_scalar=24)


def _tiny_llm(tmp_path, config: dict | None = None, **kw) -> LLM:
    cfg = config or dict(PRESETS["smollm2-135m"], num_hidden_layers=2, vocab_size=512)
    f = tmp_path / "tiny.json"
    f.write_text(json.dumps(cfg))
    return LLM(f"dummy:{f}", kv_budget="4MiB", attention_backend="triton", max_num_batched_tokens=64,
               max_model_len=256, **kw)


def _graphs(llm: LLM, max_batch: int = 8) -> DecodeGraphs:
    eng = llm.engine
    return DecodeGraphs(eng.model, eng.kv_cache, eng.backend, max_batch,
                        blocks_for(eng.max_model_len, eng.options.block_size), capture=False)


def test_padded_static_step_gives_the_plain_steps_logits(tmp_path):
    """Three requests of ragged contexts (bucket 4: one padding row), then one request alone with a shorter
    block table than the rows left in the static table: each time the logits of the plain metadata path."""
    llm = _tiny_llm(tmp_path)
    eng = llm.engine
    graphs = _graphs(llm)
    lens = {"a": 40, "b": 3, "c": 17}
    for rid, n in lens.items():  # prefill each prompt into the cache
        ids = [(i * 31 + len(rid) * 7 + n) % 500 + 3 for i in range(n)]
        assert eng.kv.allocate(rid, n + 1, 0)
        eng.runner.execute(SchedulerOutput([ScheduledChunk(rid, ids, 0, eng.kv.block_table(rid), False)]))

    def step(rids: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        chunks = [ScheduledChunk(r, [11 + i], lens[r], eng.kv.block_table(r), True) for i, r in enumerate(rids)]
        got = graphs.run(chunks)
        ids, pos, meta, rows = build_metadata(SchedulerOutput(chunks), eng.kv_cache.block_size, eng.device)
        want = eng.model.forward(ids, pos, eng.kv_cache, meta, eng.backend, torch.tensor(rows))
        return got, want

    got, want = step(["a", "b", "c"])
    assert got.shape == want.shape == (3, 512)
    assert want.std() > 0.01
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    got, want = step(["b"])  # table width 1 block; rows 1..3 of the static table hold a/c's stale blocks
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_steps_the_buffers_cannot_take_run_eagerly(tmp_path):
    llm = _tiny_llm(tmp_path)
    eng = llm.engine
    graphs = _graphs(llm, max_batch=2)
    chunks = [ScheduledChunk(f"r{i}", [5], 0, [1], True) for i in range(3)]
    assert graphs.run(chunks) is None  # more requests than the largest bucket
    wide = graphs.max_blocks + 1
    assert graphs.run([ScheduledChunk("r", [5], 0, list(range(1, wide + 1)), True)]) is None  # a longer table


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_generation_through_the_static_buffers_matches_eager(tmp_path, arch):
    """The engine with the graph path wired in (as on a GPU, minus the capture) generates the same greedy
    tokens for a ragged batch whose size shrinks as requests finish (buckets 4, then 2, then 1); a Gemma 3
    (one sliding layer of window 8, one global) fills its sliding layer's own slots and block tables too."""
    prompts = [[5, 9, 200, 31, 7, 88, 100, 3, 41, 17, 250, 66, 12, 19, 23, 45, 301, 11], [400, 401, 402],
               [7] * 21]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (4, 2, 3)]
    cfg = GEMMA3 if arch == "gemma3" else None
    plain = _tiny_llm(tmp_path, cfg)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    graphed = _tiny_llm(tmp_path, cfg)
    assert graphed.engine.kv_groups.hybrid == (arch == "gemma3")
    graphed.engine.runner.graphs = graphs = _graphs(graphed)
    got = [o.token_ids for o in graphed.generate(prompts, params)]
    assert got == want
    assert graphs.status.startswith("static buffers")
    assert [len(t) for t in got] == [4, 2, 3]


def test_graph_key_is_the_decode_split_count_rounded_to_a_power_of_two(monkeypatch):
    """The split count a graph is captured with is the launcher's own choice for that decode step (on a
    132-SM device), rounded down to a power of two."""
    import kvcli_kernels.paged_attention as pa

    from kvcli.attention.triton_backend import TritonAttentionBackend
    from kvcli.kvcache.kv_cache import LayerKV

    monkeypatch.setattr(pa, "_num_sms", lambda device: 132)
    k = torch.zeros(64, 16, 8, 128, dtype=torch.float16)
    layer = LayerKV(k, k.clone())
    backend = TritonAttentionBackend()
    seen = set()
    for batch in (1, 2, 3, 8, 17, 64):
        for ctx in (100, 700, 2048, 9000, 40000):
            q = torch.zeros(batch, 32, 128, dtype=torch.float16)
            auto = pa.auto_num_splits(q, k, batch, 1, ctx)
            assert pa.decode_num_splits(batch, 32, torch.float16, k, ctx) == auto
            key = backend.decode_graph_key(batch, ctx, layer, 32, torch.float16)
            assert key & (key - 1) == 0 and key <= auto < 2 * key
            seen.add(key)
    assert {1, 2, 8, 32} <= seen
    assert TritonAttentionBackend(num_splits=3).decode_graph_key(1, 40000, layer, 32, torch.float16) == 3
