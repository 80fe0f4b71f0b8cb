"""kvcli's rotary + KV-store kernel (kernels/cpu_rope_kv.c) against the ops it replaces, Rotary.apply and
TorchAttentionBackend.write_kv (themselves checked against the textbook rotate-half formula in
test_rotary.py): q and the cache must be equal bit for bit, for every build the machine runs.

Ragged on purpose: row counts 1 to past the threading threshold, GQA 9/3, 4/4, 8/1, head_dim 16 / 64 / 128
and 6 (an odd half: the scalar tails), fp32 / fp16 / bf16 caches and int8 / fp8 ones with their per-token
scales (kv_dtype.quantize's codes) in head-major and token-major storage, scattered and padding (negative)
slots, and inputs with fp16 overflow and subnormals."""

from __future__ import annotations

import pytest
import torch

from cpu_paths import built, runnable_isas
from kvcli.attention.base import AttentionMetadata
from kvcli.attention.torch_backend import TorchAttentionBackend
from kvcli.kvcache.kv_cache import LayerKV
from kvcli.native import registry
from kvcli.model.layers import Rotary

pytestmark = pytest.mark.skipif(not registry.enabled(), reason="KVCLI_NATIVE=0")


def _lib(isa: str):
    from kvcli_kernels.cpu_rope_kv import load

    return built(load, isa)


def _cache(blocks: int, bs: int, kvh: int, d: int, dtype: torch.dtype, head_major: bool) -> LayerKV:
    def one(*row: int, dt: torch.dtype = dtype) -> torch.Tensor:
        if head_major:  # kvcli's storage: [kvh, blocks, bs(, D)] seen as [blocks, bs, kvh(, D)]
            return torch.full((kvh, blocks, bs, *row), 7.0, dtype=dt).movedim(0, 2)
        return torch.full((blocks, bs, kvh, *row), 7.0, dtype=dt)
    if dtype in (torch.int8, torch.float8_e4m3fn):
        return LayerKV(one(d), one(d), one(dt=torch.float32), one(dt=torch.float32))
    return LayerKV(one(d), one(d))


def _meta(slots: torch.Tensor) -> AttentionMetadata:
    n = slots.shape[0]
    return AttentionMetadata(slot_mapping=slots, cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
                             seq_lens=torch.tensor([n], dtype=torch.int32),
                             block_tables=torch.zeros(1, 1, dtype=torch.int32), max_seqlen_q=n, max_seq_len=n)


def _reference(rot: Rotary, qkv: torch.Tensor, positions: torch.Tensor, h: int, kvh: int, d: int,
               cache: LayerKV, meta: AttentionMetadata) -> torch.Tensor:
    """What llama.py does without the kernel: rotate q and k heads together, write_kv, return q."""
    t = qkv.shape[0]
    qk = rot.apply(qkv[:, :(h + kvh) * d].view(t, h + kvh, d), rot.at(positions, torch.float32))
    TorchAttentionBackend(native=False).write_kv(qk[:, h:], qkv[:, (h + kvh) * d:].view(t, kvh, d), cache, meta)
    return qk[:, :h]


@pytest.mark.parametrize("isa", runnable_isas())
@pytest.mark.parametrize(("t", "h", "kvh", "d"), [
    (1, 9, 3, 64),  # a SmolLM2 decode row
    (5, 4, 4, 16),  # no GQA, narrow heads
    (37, 8, 1, 128),  # one KV head, wide heads
    (3, 2, 2, 6),  # half a head of 3: no 8-wide vectors at all
    (300, 9, 3, 64),  # a prefill chunk: rows split across threads
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("head_major", [True, False])
def test_matches_rotary_apply_and_write_kv_bitwise(isa, t, h, kvh, d, dtype, head_major):
    from kvcli_kernels.cpu_rope_kv import rope_kv

    lib = _lib(isa)
    gen = torch.Generator().manual_seed(t * 131 + d)
    rot = Rotary(d, 4096, 10000.0, None, torch.device("cpu"))
    bs, blocks = 16, -(-t // 16) * 3 + 1
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=gen) * 4
    qkv[0, :3] = torch.tensor([1e5, -7e4, 3e-7])  # fp16 overflow to inf, a subnormal
    positions = torch.randint(0, 4096, (t,), generator=gen)
    slots = torch.randperm(blocks * bs, generator=gen)[:t]  # scattered over the pool
    slots[t // 2] = -1  # a padding row: rotated, not stored
    meta = _meta(slots)

    want_cache = _cache(blocks, bs, kvh, d, dtype, head_major)
    want_q = _reference(rot, qkv, positions, h, kvh, d, want_cache, meta)
    got_cache = _cache(blocks, bs, kvh, d, dtype, head_major)
    got_q = rope_kv(lib, qkv, h, kvh, rot.cos, rot.sin_signed, positions, slots, got_cache.k, got_cache.v,
                    got_cache.k_scale, got_cache.v_scale)

    assert got_q.shape == (t, h, d) and got_q.is_contiguous()
    assert torch.equal(got_q, want_q)
    bits = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
            torch.int8: torch.int8, torch.float8_e4m3fn: torch.uint8}[dtype]
    for got, want in zip(got_cache.tensors(), want_cache.tensors()):  # bits: inf, fp8 NaN and -0 included
        assert torch.equal(got.view(bits if got.dtype == dtype else torch.int32),
                           want.view(bits if want.dtype == dtype else torch.int32))


@pytest.mark.parametrize("isa", runnable_isas())
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_quantized_codes_at_every_rounding_edge(isa, dtype):
    """Rows built to land on the codes' rounding edges after the scale's division (halves between int8 codes,
    fp8's subnormals and ties at every exponent, an all-zero row: scale 0, codes 0): the stored codes and
    scales are kv_dtype.quantize's, bit for bit."""
    from kvcli_kernels.cpu_rope_kv import rope_kv

    lib = _lib(isa)
    d, kvh, h = 16, 1, 1
    qmax = 127.0 if dtype == torch.int8 else 448.0
    gen = torch.Generator().manual_seed(3)
    levels = torch.arange(-2 * qmax, 2 * qmax + 1) / 2  # every half step to +-qmax
    rows = [levels[i:i + d - 1] for i in range(0, levels.numel() - d, d - 1)]
    rows += [torch.rand(d - 1, generator=gen) * 2.0 ** e for e in range(-12, 2)]  # subnormal and tie regions
    v = torch.stack([torch.cat([r, torch.tensor([qmax])]) for r in rows] + [torch.zeros(d)])  # amax: qmax
    t = v.shape[0]
    rot = Rotary(d, 8, 10000.0, None, torch.device("cpu"))
    qkv = torch.cat([torch.randn(t, (h + kvh) * d, generator=gen), v * 1.5], 1)  # scale 1.5: divided back
    positions, slots = torch.zeros(t, dtype=torch.int64), torch.arange(t)
    meta = _meta(slots)
    want, got = _cache(-(-t // 16), 16, kvh, d, dtype, True), _cache(-(-t // 16), 16, kvh, d, dtype, True)
    _reference(rot, qkv, positions, h, kvh, d, want, meta)
    rope_kv(lib, qkv, h, kvh, rot.cos, rot.sin_signed, positions, slots, got.k, got.v, got.k_scale, got.v_scale)
    raw = torch.int8 if dtype == torch.int8 else torch.uint8
    assert torch.equal(got.v.view(raw), want.v.view(raw)) and torch.equal(got.v_scale, want.v_scale)
    assert torch.equal(got.k.view(raw), want.k.view(raw)) and torch.equal(got.k_scale, want.k_scale)


@pytest.mark.parametrize("isa", runnable_isas())
def test_out_of_range_positions_and_slots_raise_and_write_nothing(isa):
    from kvcli_kernels.cpu_rope_kv import rope_kv

    lib = _lib(isa)
    rot = Rotary(64, 128, 10000.0, None, torch.device("cpu"))
    cache = _cache(2, 16, 3, 64, torch.float16, True)
    before = cache.k.clone()
    qkv = torch.randn(2, 15 * 64)
    with pytest.raises(ValueError, match="position"):
        rope_kv(lib, qkv, 9, 3, rot.cos, rot.sin_signed, torch.tensor([3, 128]), torch.tensor([0, 1]), cache.k, cache.v)
    with pytest.raises(ValueError, match="slot"):
        rope_kv(lib, qkv, 9, 3, rot.cos, rot.sin_signed, torch.tensor([3, 4]), torch.tensor([0, 32]), cache.k, cache.v)
    assert torch.equal(cache.k, before)


def test_backend_offers_it_only_where_it_applies(monkeypatch):
    from kvcli_kernels.cpu_rope_kv import load

    if registry.library("rope_kv") is None:
        pytest.skip("no C compiler")
    rot = Rotary(64, 128, 10000.0, None, torch.device("cpu"))
    meta = _meta(torch.tensor([3]))
    pos = torch.tensor([3])
    plain = _cache(2, 16, 3, 64, torch.float16, True)
    backend = TorchAttentionBackend()
    assert backend.rope_kv_writer(rot.cos, rot.sin_signed, pos, meta, plain, 9, 3) is not None
    scaled = LayerKV(torch.zeros(2, 16, 3, 64, dtype=torch.int8), torch.zeros(2, 16, 3, 64, dtype=torch.int8),
                     torch.ones(2, 16, 3), torch.ones(2, 16, 3))
    assert backend.rope_kv_writer(rot.cos, rot.sin_signed, pos, meta, scaled, 9, 3) is not None  # int8 + scales
    unscaled = LayerKV(torch.zeros(2, 16, 3, 64, dtype=torch.int8), torch.zeros(2, 16, 3, 64, dtype=torch.int8))
    assert backend.rope_kv_writer(rot.cos, rot.sin_signed, pos, meta, unscaled, 9, 3) is None  # codes need scales
    assert backend.rope_kv_writer(rot.cos.bfloat16(), rot.sin_signed, pos, meta, plain, 9, 3) is None
    assert TorchAttentionBackend(native=False).rope_kv_writer(rot.cos, rot.sin_signed, pos, meta, plain, 9, 3) is None
