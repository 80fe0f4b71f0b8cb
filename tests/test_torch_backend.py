"""The torch paged-attention backend against a dense reference on random ragged batches."""

from __future__ import annotations

import math

import pytest
import torch

from kvcli.attention.base import AttentionMetadata
from kvcli.attention.invariant_backend import InvariantAttentionBackend
from kvcli.attention.torch_backend import TorchAttentionBackend
from kvcli.kvcache.kv_cache import LayerKV


def make_batch(q_lens, kv_lens, kvh, g, d, bs, num_blocks, permute, dtype=torch.float32, seed=0, window=0,
               storage="head"):
    """storage "head": the pool stored head-major like KVCache allocates it; "token": token-major (the
    backends read either through the same block indexing)."""
    gen = torch.Generator().manual_seed(seed)
    # Blocks no request owns are NaN. Owned blocks (and block 0, the padding entry of block tables)
    # start as large finite garbage, as stale data from an earlier owner would be: the runner zeroes
    # a block on first use, so owned blocks are never NaN, but their unused slots must be masked.
    k_cache = torch.full((num_blocks, bs, kvh, d), float("nan"), dtype=dtype)
    v_cache = torch.full((num_blocks, bs, kvh, d), float("nan"), dtype=dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist() if permute else list(range(num_blocks))
    for c in (k_cache, v_cache):
        c[0] = 1e4
    tables, dense_k, dense_v, slots = [], [], [], []
    for q_len, kv_len in zip(q_lens, kv_lens):
        n = -(-kv_len // bs)
        blocks, order = order[:n], order[n:]
        tables.append(blocks)
        for c in (k_cache, v_cache):
            c[blocks] = 1e4 * torch.rand((n, bs, kvh, d), generator=gen).to(dtype)
        k = torch.randn(kv_len, kvh, d, generator=gen)
        v = torch.randn(kv_len, kvh, d, generator=gen)
        dense_k.append(k)
        dense_v.append(v)
        for p in range(kv_len):
            slot = blocks[p // bs] * bs + p % bs
            if p < kv_len - q_len:  # the cached prefix is already there; the new tokens get written
                k_cache.view(-1, kvh, d)[slot] = k[p].to(dtype)
                v_cache.view(-1, kvh, d)[slot] = v[p].to(dtype)
            else:
                slots.append(slot)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    cu = [0]
    for q_len in q_lens:
        cu.append(cu[-1] + q_len)
    meta = AttentionMetadata(torch.tensor(slots), torch.tensor(cu, dtype=torch.int32),
                             torch.tensor(kv_lens, dtype=torch.int32), bt, max(q_lens), max(kv_lens),
                             tuple(kv_lens), tuple(q_lens), sliding_window=window)
    q = torch.randn(cu[-1], kvh * g, d, generator=gen)
    if storage == "head":
        k_cache, v_cache = (c.movedim(2, 0).contiguous().movedim(0, 2) for c in (k_cache, v_cache))
    new_k = torch.cat([k[kv - ql:] for k, ql, kv in zip(dense_k, q_lens, kv_lens)])
    new_v = torch.cat([v[kv - ql:] for v, ql, kv in zip(dense_v, q_lens, kv_lens)])
    return q, new_k, new_v, k_cache, v_cache, meta, dense_k, dense_v


def reference(q, dense_k, dense_v, q_lens, kv_lens, g, scale, window=0, softcap=0.0):
    """Dense causal attention; window > 0: the row at position p sees keys [p - window + 1, p]; softcap > 0:
    scores softcap * tanh(s / softcap) before the mask."""
    out, start = [], 0
    for k, v, q_len, kv_len in zip(dense_k, dense_v, q_lens, kv_lens):
        qb = q[start:start + q_len].transpose(0, 1)
        kb = k.transpose(0, 1).repeat_interleave(g, 0)
        vb = v.transpose(0, 1).repeat_interleave(g, 0)
        s = qb @ kb.transpose(1, 2) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        pos = torch.arange(kv_len - q_len, kv_len).unsqueeze(1)
        kpos = torch.arange(kv_len).unsqueeze(0)
        s = s.masked_fill(kpos > pos, float("-inf"))
        if window:
            s = s.masked_fill(kpos <= pos - window, float("-inf"))
        out.append((s.softmax(-1) @ vb).transpose(0, 1))
        start += q_len
    return torch.cat(out)


@pytest.mark.parametrize("backend", [TorchAttentionBackend, InvariantAttentionBackend])
@pytest.mark.parametrize("g", [1, 3, 8])
@pytest.mark.parametrize("permute", [False, True])
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("storage", ["head", "token"])
def test_mixed_batch_matches_reference(g, permute, bs, backend, storage):
    # decode, prefill chunk on a cached prefix, fresh prompt, another decode: ragged, not block multiples
    q_lens, kv_lens = [1, 37, 50, 1], [75, 100, 50, 17]
    kvh, d = 2, 64
    q, nk, nv, kc, vc, meta, dk, dv = make_batch(q_lens, kv_lens, kvh, g, d, bs, 64, permute, seed=g + bs,
                                                 storage=storage)
    be = backend()
    be.write_kv(nk, nv, LayerKV(kc, vc), meta)
    scale = 1 / math.sqrt(d)
    got = be.forward(q, LayerKV(kc, vc), meta, scale)
    want = reference(q, dk, dv, q_lens, kv_lens, g, scale)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", [TorchAttentionBackend, InvariantAttentionBackend])
@pytest.mark.parametrize("kv", ["fp32", "int8"])
@pytest.mark.parametrize("window", [13, 16])
def test_sliding_window_matches_reference(backend, kv, window):
    """Ragged batch under a sliding window: five decodes (batched on the torch path), one inside its
    window; a lone long decode (the per-request path); a chunk on a cached prefix longer than the
    window; a fresh prompt longer than the window; a short prompt. Row p sees keys [p - window + 1, p]."""
    from kvcli.kvcache.kv_dtype import quantize
    q_lens, kv_lens = [1, 1, 37, 1, 1, 50, 1, 9, 1], [75, 70, 100, 66, 64, 50, 9, 9, 900]
    kvh, g, d = 2, 3, 64
    q, nk, nv, kc, vc, meta, dk, dv = make_batch(q_lens, kv_lens, kvh, g, d, 16, 128, True, seed=window,
                                                 window=window)
    if kv == "int8":  # the torch path's int8 decode reads codes through its scratch buffers
        kc, vc = kc.nan_to_num(), vc.nan_to_num()
        cache = LayerKV(*quantize(kc, torch.int8)[:1], *quantize(vc, torch.int8)[:1],
                        quantize(kc, torch.int8)[1], quantize(vc, torch.int8)[1])
    else:
        cache = LayerKV(kc, vc)
    be = backend()
    be.native = False  # torch's decode paths (the C kernel's: test_cpu_attention.py)
    be.write_kv(nk, nv, cache, meta)
    got = be.forward(q, cache, meta, 0.125)
    want = reference(q, dk, dv, q_lens, kv_lens, g, 0.125, window)
    tol = dict(atol=3e-2, rtol=1e-2) if kv == "int8" else dict(atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got, want, **tol)
    if backend is TorchAttentionBackend:
        assert sum(len(b[0]) for b in be._batches) == 5  # the batched decode path ran too


@pytest.mark.parametrize("backend", [TorchAttentionBackend, InvariantAttentionBackend])
@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("window", [0, 13])
def test_softcap_matches_reference(backend, native, window):
    """Gemma 2's attention soft-cap (meta.softcap) on every path of a ragged batch: batched decodes, a lone
    long decode, a chunk on a cached prefix, fresh prompts; with and without the C kernels and a window."""
    from dataclasses import replace

    q_lens, kv_lens = [1, 1, 37, 1, 1, 50, 1, 9, 1], [75, 70, 100, 66, 64, 50, 9, 9, 900]
    kvh, g, d = 2, 3, 64
    q, nk, nv, kc, vc, meta, dk, dv = make_batch(q_lens, kv_lens, kvh, g, d, 16, 128, True, seed=5 + window,
                                                 window=window)
    meta = replace(meta, softcap=1.5)
    q = 8 * q  # scores of several units: a cap of 1.5 bends them
    be = backend()
    be.native = native and backend is TorchAttentionBackend
    cache = LayerKV(kc, vc)
    be.write_kv(nk, nv, cache, meta)
    got = be.forward(q, cache, meta, 0.125)
    want = reference(q, dk, dv, q_lens, kv_lens, g, 0.125, window, softcap=1.5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert (want - reference(q, dk, dv, q_lens, kv_lens, g, 0.125, window)).abs().max() > 0.05


def test_negative_slots_are_skipped():
    q, nk, nv, kc, vc, meta, dk, dv = make_batch([3], [3], 1, 1, 64, 16, 4, False)
    meta = AttentionMetadata(torch.tensor([0, -1, 2]), meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
                             3, 3, (3,), (3,))
    untouched = kc[0, 1].clone()
    TorchAttentionBackend().write_kv(nk, nv, LayerKV(kc, vc), meta)
    assert torch.equal(kc[0, 0], nk[0]) and torch.equal(kc[0, 2], nk[2]) and torch.equal(kc[0, 1], untouched)


@pytest.mark.parametrize("g", [1, 3])
def test_batched_decode_rows_match_reference(g):
    """Five decode requests (batched into one masked call) beside two prefill chunks."""
    q_lens, kv_lens = [1, 1, 37, 1, 1, 50, 1], [75, 70, 100, 66, 64, 50, 73]
    kvh, d = 2, 64
    q, nk, nv, kc, vc, meta, dk, dv = make_batch(q_lens, kv_lens, kvh, g, d, 16, 64, True, seed=5 + g)
    be = TorchAttentionBackend(native=False)  # torch's batched decode (the C kernel's: test_cpu_attention.py)
    be.write_kv(nk, nv, LayerKV(kc, vc), meta)
    got = be.forward(q, LayerKV(kc, vc), meta, 0.125)
    assert sum(len(b[0]) for b in be._batches) == 5  # the batched path really ran
    want = reference(q, dk, dv, q_lens, kv_lens, g, 0.125)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_decode_rows_grouped_by_length():
    """Very different contexts go to separate padded calls; a lone outlier stays per request."""
    q_lens = [1] * 7
    kv_lens = [20, 22, 25, 300, 310, 320, 900]
    q, nk, nv, kc, vc, meta, dk, dv = make_batch(q_lens, kv_lens, 1, 3, 64, 16, 128, True, seed=9)
    be = TorchAttentionBackend(native=False)  # torch's batched decode (the C kernel's: test_cpu_attention.py)
    be.write_kv(nk, nv, LayerKV(kc, vc), meta)
    got = be.forward(q, LayerKV(kc, vc), meta, 0.125)
    assert len(be._batches) >= 2  # not one call padded to the 900-token outlier
    for ids, _, tables, mask in be._batches:  # padding bounded: 1.5x the real work plus 64 per row
        real = sum(kv_lens[i] for i in ids)
        assert mask.shape[-1] * len(ids) <= 1.5 * real + 64 * len(ids) + 16 * len(ids)
    torch.testing.assert_close(got, reference(q, dk, dv, q_lens, kv_lens, 3, 0.125), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kv", ["fp32", "fp16", "int8"])
@pytest.mark.parametrize("g", [1, 3, 4])
def test_a_row_is_bit_identical_whatever_the_batch(kv, g):
    check_invariance(kv, g, window=0)


@pytest.mark.parametrize("kv", ["fp32", "int8"])
def test_a_row_is_bit_identical_whatever_the_batch_under_a_window(kv):
    """The same invariance with a sliding window of 50 (keys before it masked)."""
    check_invariance(kv, 3, window=50)


def check_invariance(kv: str, g: int, window: int) -> None:
    """The invariant backend's batch invariance, the property speculative decoding and preemption rely on for identical greedy
    text on the INT4 path: one request's query rows give the same bits computed as 1-row decodes, as a
    verify chunk of 6 rows, inside a prefill chunk, beside other decodes of very different lengths
    (padded groups), and with its blocks at other places in the pool."""
    from kvcli.kvcache.kv_dtype import quantize
    kvh, d, bs = 2, 64, 16
    gen = torch.Generator().manual_seed(g)
    L = 203  # the request's final length; its last 6 positions are the rows under test
    k = torch.randn(L, kvh, d, generator=gen)
    v = torch.randn(L, kvh, d, generator=gen)
    qrows = torch.randn(L, kvh * g, d, generator=gen)

    def run(layout: str, permute_seed: int) -> torch.Tensor:
        """Rows L-6..L-1 of the request under `layout`; other requests are noise of other lengths."""
        others = {"decode": [], "verify": [], "batch": [(1, 40), (1, 530), (1, 180), (1, 207)],
                  "prefill": [(1, 90)], "mixed": [(5, 300), (1, 12), (37, 37)]}[layout]
        order = torch.randperm(200, generator=torch.Generator().manual_seed(permute_seed)).tolist()
        order.remove(0)
        n_blocks_all = 201
        kc = torch.zeros(n_blocks_all, bs, kvh, d)
        vc = torch.zeros(n_blocks_all, bs, kvh, d)
        out_rows = []
        steps = [(p, 1) for p in range(L - 6, L)] if layout in ("decode", "batch") else \
            [(L - 6, 6)] if layout in ("verify", "mixed") else [(0, L)]
        for start, n in steps:
            reqs = [(start, n, k, v, qrows)] + [
                (ol - oq, oq, torch.randn(ol, kvh, d, generator=gen), torch.randn(ol, kvh, d, generator=gen),
                 torch.randn(ol, kvh * g, d, generator=gen)) for oq, ol in others]
            tables, slots, cu, pos_all, q_all, k_new, v_new = [], [], [0], [], [], [], []
            taken = 0
            for ri, (s0, qn, kk, vv, qq) in enumerate(reqs):
                nb = -(-(s0 + qn) // bs)
                blocks = order[taken:taken + nb] if ri else order[:nb]
                taken = max(taken, nb) if ri == 0 else taken + nb
                tables.append(blocks)
                for p in range(s0 + qn):
                    slot = blocks[p // bs] * bs + p % bs
                    if p < s0:
                        kc.view(-1, kvh, d)[slot] = kk[p]
                        vc.view(-1, kvh, d)[slot] = vv[p]
                    else:
                        slots.append(slot)
                k_new.append(kk[s0:s0 + qn]); v_new.append(vv[s0:s0 + qn]); q_all.append(qq[s0:s0 + qn])
                cu.append(cu[-1] + qn)
            width = max(len(t) for t in tables)
            bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
            qlens = tuple(r[1] for r in reqs)
            klens = tuple(r[0] + r[1] for r in reqs)
            meta = AttentionMetadata(torch.tensor(slots), torch.tensor(cu, dtype=torch.int32),
                                     torch.tensor(klens, dtype=torch.int32), bt, max(qlens), max(klens), klens, qlens,
                                     sliding_window=window)
            if kv == "int8":
                kq, kqs = quantize(kc, torch.int8)
                cache = LayerKV(kq, quantize(vc, torch.int8)[0], kqs, quantize(vc, torch.int8)[1])
            else:
                cache = LayerKV(kc.to(torch.float16), vc.to(torch.float16)) if kv == "fp16" else LayerKV(kc, vc)
            be = InvariantAttentionBackend()
            be.write_kv(torch.cat(k_new), torch.cat(v_new), cache, meta)
            got = be.forward(torch.cat(q_all), cache, meta, d ** -0.5)
            out_rows.append(got[:n])
        return torch.cat(out_rows)[-6:]

    want = run("decode", 0)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(want, reference(qrows[L - 6:], [k], [v], [6], [L], g, d ** -0.5, window),
                               atol=3e-2 if kv == "int8" else 2e-3, rtol=1e-2)
    for layout, seed in [("decode", 1), ("verify", 0), ("verify", 2), ("batch", 3), ("prefill", 4), ("mixed", 5)]:
        got = run(layout, seed)
        assert torch.equal(got, want), f"{layout}: max difference {(got - want).abs().max().item():.3g}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("g", [1, 3])
def test_16bit_cache_decode_matches_reference(dtype, g):
    """16-bit caches under fp32 queries: decode rows batched (gathered into reused buffers, converted
    head-major, matmul path) and per request (scratch conversion), beside prefill chunks; equal to the
    dense reference on the K/V rounded to the cache's dtype. Blocks nobody owns are NaN."""
    q_lens, kv_lens = [1, 1, 37, 1, 1, 50, 1, 1], [75, 70, 100, 66, 64, 50, 73, 900]
    kvh, d = 2, 64
    q, nk, nv, kc, vc, meta, dk, dv = make_batch(q_lens, kv_lens, kvh, g, d, 16, 128, True, dtype=dtype, seed=11 + g)
    be = TorchAttentionBackend(native=False)  # torch's batched decode (the C kernel's: test_cpu_attention.py)
    be.write_kv(nk, nv, LayerKV(kc, vc), meta)
    got = be.forward(q, LayerKV(kc, vc), meta, 0.125)
    assert sum(len(b[0]) for b in be._batches) == 5  # 5 rows batched, the 900-token one per request
    assert torch.isfinite(got).all()
    rk = [k.to(dtype).float() for k in dk]
    rv = [v.to(dtype).float() for v in dv]
    torch.testing.assert_close(got, reference(q, rk, rv, q_lens, kv_lens, g, 0.125), atol=2e-5, rtol=1e-4)


def test_consecutive_blocks_are_read_as_unit_stride_views_of_the_pool():
    """The decode fast path: a run of consecutive blocks of a KVCache layer is each head's tokens side
    by side, read as a view (no copy), one head's rows unit-stride; other tables are gathered."""
    from kvcli.config import preset_config
    from kvcli.kvcache.kv_cache import KVCache

    cfg = preset_config("smollm2-135m")  # 3 KV heads x 64
    layer = KVCache(cfg, 8, 4, "fp32", torch.device("cpu")).layers[0]
    assert LayerKV.heads(layer.k).is_contiguous()  # stored head-major
    layer.k.copy_(torch.randn(layer.k.shape))
    view = TorchAttentionBackend._take(layer.k, slice(2, 5), 1, 10)
    assert view.shape == (3, 9, 64) and view.stride() == (9 * 4 * 64, 64, 1)
    assert view.untyped_storage().data_ptr() == layer.k.untyped_storage().data_ptr()
    assert torch.equal(view, layer.k[2:5].flatten(0, 1)[1:10].transpose(0, 1))
    gathered = TorchAttentionBackend._take(layer.k, torch.tensor([5, 2, 7]), 0, 12)
    assert torch.equal(gathered, layer.k[[5, 2, 7]].flatten(0, 1).transpose(0, 1))
