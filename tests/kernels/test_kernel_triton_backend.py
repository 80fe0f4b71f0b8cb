"""TritonAttentionBackend over two engine-like steps, checked against dense causal attention."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not importable; the Triton kernels cannot be tested")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from kernel_test_utils import DEVICE, generator  # noqa: E402

from kvcli.kvcache.kv_cache import LayerKV
from kvcli.attention.base import AttentionMetadata  # noqa: E402
from kvcli.attention.triton_backend import TritonAttentionBackend  # noqa: E402

BLOCK, HQ, HKV, D = 16, 6, 2, 32


def _meta(tables: torch.Tensor, starts: list[int], q_lens: list[int]) -> AttentionMetadata:
    """Metadata for requests whose new tokens sit at positions starts[b] .. starts[b] + q_lens[b] - 1."""
    slots, cu = [], [0]
    for b, (s, n) in enumerate(zip(starts, q_lens)):
        slots += [int(tables[b, p // BLOCK]) * BLOCK + p % BLOCK for p in range(s, s + n)]
        cu.append(cu[-1] + n)
    seq_lens = [s + n for s, n in zip(starts, q_lens)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables.to(DEVICE),
        max_seqlen_q=max(q_lens),
        max_seq_len=max(seq_lens),
        seq_lens_list=tuple(seq_lens),
        query_lens_list=tuple(q_lens),
    )


@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_two_steps_match_dense_attention(num_splits: int | None) -> None:
    gen = generator("backend", num_splits)
    backend = TritonAttentionBackend(num_splits=num_splits)
    assert backend.name == "triton"
    total = [40, 21]  # final lengths of the two requests
    full_q = [torch.randn(n, HQ, D, generator=gen).half().to(DEVICE) for n in total]
    full_k = [torch.randn(n, HKV, D, generator=gen).half().to(DEVICE) for n in total]
    full_v = [torch.randn(n, HKV, D, generator=gen).half().to(DEVICE) for n in total]
    k_cache = torch.full((8, BLOCK, HKV, D), float("nan"), dtype=torch.float16, device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    tables = torch.tensor([[5, 0, 7, 0], [2, 6, 0, 0]], dtype=torch.int32)

    # Step 1: prompts of 30 and 20 tokens. Step 2: a 10-token chunk and a single decode token.
    for starts, q_lens in (([0, 0], [30, 20]), ([30, 20], [10, 1])):
        meta = _meta(tables, starts, q_lens)
        sl = [slice(s, s + n) for s, n in zip(starts, q_lens)]
        key = torch.cat([k[s] for k, s in zip(full_k, sl)])
        value = torch.cat([v[s] for v, s in zip(full_v, sl)])
        q = torch.cat([qq[s] for qq, s in zip(full_q, sl)])
        backend.write_kv(key, value, LayerKV(k_cache, v_cache), meta)
        out = backend.forward(q, LayerKV(k_cache, v_cache), meta, D**-0.5)
        assert out.shape == q.shape and out.dtype == q.dtype

        # Dense reference: each request's full prefix, bottom-right aligned causal mask.
        refs = []
        for b, s in enumerate(sl):
            qb = full_q[b][s].float().transpose(0, 1)  # [H, L, D]
            kb = full_k[b][: s.stop].float().repeat_interleave(HQ // HKV, 1).transpose(0, 1)
            vb = full_v[b][: s.stop].float().repeat_interleave(HQ // HKV, 1).transpose(0, 1)
            mask = torch.ones(s.stop - s.start, s.stop, dtype=torch.bool, device=DEVICE).tril(s.start)
            refs.append(F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=D**-0.5).transpose(0, 1))
        torch.testing.assert_close(out.float(), torch.cat(refs), atol=4e-3, rtol=4e-3)


def test_rejects_bad_num_splits() -> None:
    with pytest.raises(ValueError):
        TritonAttentionBackend(num_splits=0)


@pytest.mark.parametrize("kv_format", ["int8", "fp8"])
def test_quantized_cache_two_steps_match_torch_backend(kv_format: str) -> None:
    """The backend over an int8 / fp8 LayerKV (codes + scales, unused slots poisoned): the cache-write
    kernel stores the same codes and scales as the torch backend, bit for bit, and attention equals
    the torch backend's (which dequantizes before attending) over a prompt step and a chunk + decode step."""
    from kvcli.attention.torch_backend import TorchAttentionBackend
    from kvcli.kvcache.kv_dtype import kv_dtype_of

    storage = kv_dtype_of(kv_format).storage
    gen = generator("backend-quant", kv_format)
    total = [40, 21]
    full_q = [torch.randn(n, HQ, D, generator=gen) for n in total]
    full_k = [torch.randn(n, HKV, D, generator=gen) * 3 for n in total]
    full_v = [torch.randn(n, HKV, D, generator=gen) for n in total]

    def layer(device: torch.device) -> LayerKV:
        codes = [torch.full((8, BLOCK, HKV, D), 0x7F, dtype=torch.uint8).view(storage) for _ in range(2)]
        scales = [torch.full((8, BLOCK, HKV), float("nan")) for _ in range(2)]
        return LayerKV(*(t.to(device) for t in (*codes, *scales)))

    tri, ref = layer(DEVICE), layer(torch.device("cpu"))  # the torch backend runs on CPU
    tables = torch.tensor([[5, 0, 7, 0], [2, 6, 0, 0]], dtype=torch.int32)
    backend, torch_backend = TritonAttentionBackend(), TorchAttentionBackend()
    for starts, q_lens in (([0, 0], [30, 20]), ([30, 20], [10, 1])):
        meta = _meta(tables, starts, q_lens)
        sl = [slice(s, s + n) for s, n in zip(starts, q_lens)]
        key, value, q = (torch.cat([x[s] for x, s in zip(full, sl)]) for full in (full_k, full_v, full_q))
        backend.write_kv(key.to(DEVICE), value.to(DEVICE), tri, meta)
        torch_backend.write_kv(key, value, ref, _cpu(meta))
        for got, want in zip(tri.tensors(), ref.tensors()):
            got = got.cpu()
            if got.dtype == torch.float32:
                assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
            else:
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        out = backend.forward(q.to(DEVICE), tri, meta, D**-0.5)
        expect = torch_backend.forward(q, ref, _cpu(meta), D**-0.5)
        torch.testing.assert_close(out.cpu(), expect, atol=2e-4, rtol=2e-4)


def _cpu(meta: AttentionMetadata) -> AttentionMetadata:
    from dataclasses import fields

    return AttentionMetadata(**{f.name: (v.cpu() if isinstance(v := getattr(meta, f.name), torch.Tensor) else v)
                                for f in fields(meta)})


def test_sliding_window_matches_torch_backend() -> None:
    """The launcher passes meta.sliding_window to the kernel: prompts, then a chunk + a decode whose
    windows (8) exclude most of their context, equal to the torch backend's windowed attention."""
    from dataclasses import replace

    from kvcli.attention.torch_backend import TorchAttentionBackend

    gen = generator("backend-window")
    total = [40, 21]
    full_q = [torch.randn(n, HQ, D, generator=gen) for n in total]
    full_k = [torch.randn(n, HKV, D, generator=gen) for n in total]
    full_v = [torch.randn(n, HKV, D, generator=gen) for n in total]
    tri = LayerKV(torch.zeros(8, BLOCK, HKV, D, device=DEVICE), torch.zeros(8, BLOCK, HKV, D, device=DEVICE))
    ref = LayerKV(torch.zeros(8, BLOCK, HKV, D), torch.zeros(8, BLOCK, HKV, D))
    tables = torch.tensor([[5, 1, 7, 0], [2, 6, 0, 0]], dtype=torch.int32)
    backend, torch_backend = TritonAttentionBackend(), TorchAttentionBackend()
    for starts, q_lens in (([0, 0], [30, 20]), ([30, 20], [10, 1])):
        meta = replace(_meta(tables, starts, q_lens), sliding_window=8)
        sl = [slice(s, s + n) for s, n in zip(starts, q_lens)]
        key, value, q = (torch.cat([x[s] for x, s in zip(full, sl)]) for full in (full_k, full_v, full_q))
        backend.write_kv(key.to(DEVICE), value.to(DEVICE), tri, meta)
        torch_backend.write_kv(key, value, ref, _cpu(meta))
        out = backend.forward(q.to(DEVICE), tri, meta, D**-0.5)
        expect = torch_backend.forward(q, ref, _cpu(meta), D**-0.5)
        torch.testing.assert_close(out.cpu(), expect, atol=2e-4, rtol=2e-4)
        unwindowed = torch_backend.forward(q, ref, _cpu(replace(meta, sliding_window=0)), D**-0.5)
        assert (unwindowed - expect).abs().max().item() > 0.1
