"""The last layer computed only for the rows whose logits are wanted (LlamaModel._last_layer_rows) against
every row computed: the KV cache must be equal bit for bit (every layer's K/V, the last one's included,
are stored before the cut) and the sampled rows' logits equal to float rounding (their last layer runs
through the decode kernel instead of the prefill kernel). Prompts longer than a step's token budget, so
steps of prefill chunks only (no row wanted) come before the sampling one; two requests side by side."""

from __future__ import annotations

import pytest
import torch

from kvcli.config import SamplingParams
from kvcli.engine.llm_engine import EngineOptions, LLMEngine
from kvcli.model.loader import load_weights

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shared():
    loaded = load_weights(None)
    # Exact weights: on the INT4 path a row's linears take the integer kernel alone and the fp32 GEMM in a
    # chunk (logits ~0.04 apart, the path's known error), which would hide the cut's own effect.
    return loaded, LLMEngine(loaded, EngineOptions(kv_budget="32MiB", max_model_len=1024, dequantize=True)).model


def _run(shared, sample_text, monkeypatch, cut: bool, kv: str):
    loaded, model = shared
    logits: list[torch.Tensor] = []
    cuts: list[object] = []
    real_head, real_rows = model.lm_head, model._last_layer_rows

    class Head:
        def __call__(self, h):
            out = real_head(h)
            logits.append(out.clone())
            return out

        def __getattr__(self, name):
            return getattr(real_head, name)

    def rows(*args):
        got = real_rows(*args)
        cuts.append(got)
        return got if cut else None

    with monkeypatch.context() as m:
        m.setattr(model, "lm_head", Head())
        m.setattr(model, "_last_layer_rows", rows)
        engine = LLMEngine(loaded, EngineOptions(kv_budget="32MiB", max_model_len=1024, max_num_batched_tokens=256,
                                                 kv_dtype=kv, prefix_caching=False, dequantize=True), model=model)
        for layer in engine.kv_cache.layers:
            for t in layer.tensors():
                t.zero_()
        ids = engine.tokenizer.encode(sample_text)
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        reqs = [engine.add_request(ids[:600], params), engine.add_request(ids[700:1000], params)]
        while engine.has_unfinished():
            engine.step()
    return logits, engine, cuts, [list(r.output_token_ids) for r in reqs]


@pytest.mark.parametrize("kv", ["fp16", "int8"])
def test_cache_bitwise_and_logits_close_with_the_cut(shared, sample_text, monkeypatch, kv):
    with_cut, eng_a, cuts, tokens_a = _run(shared, sample_text, monkeypatch, True, kv)
    every_row, eng_b, _, tokens_b = _run(shared, sample_text, monkeypatch, False, kv)
    assert any(c is not None and c[1] is None for c in cuts)  # prefill-only steps skipped the last layer's rest
    assert any(c is not None and c[1] is not None for c in cuts)  # sampling steps after a chunk kept one row
    assert len(with_cut) == len(every_row)
    for a, b in zip(with_cut, every_row):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)
    for la, lb in zip(eng_a.kv_cache.layers, eng_b.kv_cache.layers):
        for ta, tb in zip(la.tensors(), lb.tensors()):
            assert torch.equal(ta, tb)
    assert tokens_a == tokens_b


def test_no_cut_where_rows_are_not_each_requests_last(shared):
    from kvcli.attention.base import AttentionMetadata
    from kvcli.attention.torch_backend import TorchAttentionBackend

    _, model = shared
    meta = AttentionMetadata(slot_mapping=torch.arange(7), cu_seqlens_q=torch.tensor([0, 4, 7], dtype=torch.int32),
                             seq_lens=torch.tensor([4, 9], dtype=torch.int32),
                             block_tables=torch.tensor([[1], [2]], dtype=torch.int32), max_seqlen_q=4, max_seq_len=9,
                             seq_lens_list=(4, 9), query_lens_list=(4, 3))
    be, cpu = TorchAttentionBackend(), torch.device("cpu")
    rows, cut = model._last_layer_rows(meta, torch.tensor([3, 6]), be, cpu)
    assert rows.tolist() == [3, 6] and cut.query_lens_list == (1, 1) and cut.seq_lens_list == (4, 9)
    assert model._last_layer_rows(meta, torch.tensor([6]), be, cpu)[1].seq_lens.tolist() == [9]
    assert model._last_layer_rows(meta, torch.tensor([4, 5, 6]), be, cpu) is None  # a verify's several rows
    assert model._last_layer_rows(meta, torch.tensor([2]), be, cpu) is None  # not a request's last row
    assert model._last_layer_rows(meta, None, be, cpu) is None  # teacher forcing: every row
