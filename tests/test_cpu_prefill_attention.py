"""kvcli's prefill-chunk attention kernel (kernels/cpu_prefill_attention.c) against a plain float64
reference: softmax(q k^T * scale, causal) v, with the chunk's queries the last T of L positions.

Ragged shapes on purpose: T not a multiple of the 6-row tile or the 64-position work item, L not a multiple
of the 64-key block, GQA groups of 1, 3 and 4, head_dim 16 / 64 / 128, K/V as strided views. Every build
the machine runs (the plain C build has no such kernel and says so)."""

from __future__ import annotations

import pytest
import torch

from cpu_paths import built, runnable_isas
from kvcli.native import registry

ISAS = [i for i in runnable_isas() if i != "generic"]
pytestmark = pytest.mark.skipif(not registry.enabled(), reason="KVCLI_NATIVE=0")


def _lib(isa: str):
    from kvcli_kernels.cpu_prefill_attention import load

    return built(load, isa)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, H, D], k / v [KVH, L, D] -> [T, H, D] in float64."""
    t, h, _ = q.shape
    kvh, length, _ = k.shape
    g = h // kvh
    qd = q.double().transpose(0, 1)
    kd, vd = k.double().repeat_interleave(g, 0), v.double().repeat_interleave(g, 0)
    s = qd @ kd.transpose(1, 2) * scale
    pos = torch.arange(length - t, length).unsqueeze(1)
    s = s.masked_fill(torch.arange(length).unsqueeze(0) > pos, float("-inf"))
    return (s.softmax(-1) @ vd).transpose(0, 1)


def _problem(t: int, length: int, h: int, kvh: int, d: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    qk = torch.randn(t, h + kvh, d, generator=gen) * 2  # q as the model has it: a view beside k's heads
    pool_k = torch.randn(kvh, length + 5, d, generator=gen)  # K/V as views of a longer head-major pool
    pool_v = torch.randn(kvh, length + 5, d, generator=gen)
    return qk[:, :h], pool_k[:, :length], pool_v[:, :length]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("t", "length", "h", "kvh", "d"), [
    (2, 2, 1, 1, 16),  # two tokens, no GQA, the narrowest head
    (13, 13, 9, 3, 64),  # a chunk against itself: T not a multiple of the 6-row tile
    (70, 70, 4, 1, 64),  # GQA group 4, T past one 64-position work item
    (7, 200, 8, 2, 128),  # a short chunk after a long prefix: L not a multiple of the 64-key block
    (130, 300, 9, 3, 64),  # chunk and prefix both ragged
    (9, 75, 4, 2, 48),  # head_dim 48: one 32-column slice and a 16-column one on AVX-512
])
def test_matches_float64_reference(isa, t, length, h, kvh, d):
    from kvcli_kernels.cpu_prefill_attention import prefill_attention, supported

    lib = _lib(isa)
    q, k, v = _problem(t, length, h, kvh, d, seed=t * 7 + length)
    assert supported(q, k, v)
    out = torch.full((t, h, d), float("nan"))
    assert prefill_attention(lib, q, k, v, d ** -0.5, out)
    err = (out.double() - _reference(q, k, v, d ** -0.5)).abs().max().item()
    assert err < 1e-5, f"{isa} T={t} L={length} H={h}/{kvh} D={d}: max error {err:.2e}"


@pytest.mark.parametrize("isa", ISAS)
def test_a_row_does_not_depend_on_its_chunk_or_threads(isa):
    """Each query row sums its keys in one fixed order: the last 5 rows of a 13-row chunk equal the same rows
    as a chunk of 5 (same keys), and one thread gives the same bits as two."""
    from kvcli_kernels.cpu_prefill_attention import prefill_attention

    lib = _lib(isa)
    q, k, v = _problem(13, 90, 9, 3, 64, seed=1)
    full, tail = torch.empty(13, 9, 64), torch.empty(5, 9, 64)
    prefill_attention(lib, q, k, v, 0.125, full)
    prefill_attention(lib, q[8:], k, v, 0.125, tail)
    assert torch.equal(full[8:], tail)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.empty(13, 9, 64)
        prefill_attention(lib, q, k, v, 0.125, one)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, full)


@pytest.mark.skipif(not {"avx2", "avx512vnni"} <= set(ISAS), reason="needs both the AVX2 and the AVX-512 build")
@pytest.mark.parametrize(("t", "length", "d"), [(13, 13, 16), (70, 150, 64), (9, 75, 48), (7, 200, 128)])
def test_avx512_build_gives_the_avx2_builds_bits(t, length, d):
    """The AVX-512 build's 32-key score tiles and 32-column P @ V slices sum each lane in the AVX2 build's
    order: the same outputs bit for bit."""
    from kvcli_kernels.cpu_prefill_attention import prefill_attention

    q, k, v = _problem(t, length, 8, 2, d, seed=t + d)
    outs = []
    for isa in ("avx2", "avx512vnni"):
        out = torch.empty(t, 8, d)
        assert prefill_attention(_lib(isa), q, k, v, d ** -0.5, out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def test_plain_c_build_has_none():
    from kvcli_kernels.cpu_prefill_attention import prefill_attention

    lib = _lib("generic")
    q, k, v = _problem(4, 4, 2, 1, 16, seed=2)
    assert prefill_attention(lib, q, k, v, 0.25, torch.empty(4, 2, 16)) is False


def test_backend_takes_it_for_prefill_chunks_and_not_for_windows():
    """The torch backend runs prefill chunks through the kernel (same numbers as torch's flash attention
    within fp32 rounding) and keeps torch's path where a sliding window cuts keys off."""
    from kvcli.attention.base import AttentionMetadata
    from kvcli.attention.torch_backend import TorchAttentionBackend, native_prefill_attention
    from kvcli.kvcache.kv_cache import LayerKV

    if native_prefill_attention() is None:
        pytest.skip("the prefill kernel does not run here")
    bs, nblocks, kvh, d, h = 16, 8, 3, 64, 9
    gen = torch.Generator().manual_seed(3)
    # the pool's head-major storage: [blocks, bs, kv heads, D] indexed, each head's rows side by side
    k_cache, v_cache = (torch.randn(nblocks, bs, kvh, d, generator=gen).movedim(2, 0).contiguous().movedim(0, 2)
                        for _ in range(2))
    cache = LayerKV(k_cache, v_cache)
    q_len, kv_len = 20, 50  # a chunk of 20 after 30 cached tokens: blocks 2, 5, 1, 6 (not in order)
    q = torch.randn(q_len, h, d, generator=gen)
    tables = torch.tensor([[2, 5, 1, 6]], dtype=torch.int32)

    def meta(window: int) -> AttentionMetadata:
        return AttentionMetadata(torch.full((q_len,), -1), torch.tensor([0, q_len], dtype=torch.int32),
                                 torch.tensor([kv_len], dtype=torch.int32), tables, q_len, kv_len, (kv_len,), (q_len,),
                                 sliding_window=window)

    calls = []
    native = TorchAttentionBackend()
    orig = native._prefill_native
    native._prefill_native = lambda *a: calls.append(1) or orig(*a)
    ours = native.forward(q, cache, meta(0), 0.125)
    torch_only = TorchAttentionBackend(native=False).forward(q, cache, meta(0), 0.125)
    assert calls and (ours - torch_only).abs().max().item() < 1e-5
    calls.clear()
    windowed = native.forward(q, cache, meta(24), 0.125)
    torch_windowed = TorchAttentionBackend(native=False).forward(q, cache, meta(24), 0.125)
    assert not calls and torch.equal(windowed, torch_windowed)


def test_shared_header_is_part_of_every_builds_cache_key(tmp_path):
    """cpu_simd.h (exp8, hmax8, hsum8) is included by both attention kernels: editing it must rebuild
    them, so the cache key of a build hashes the headers beside the sources, and they are packaged."""
    import tomllib
    from pathlib import Path

    from kvcli_kernels.cpu_build import _lib_path

    src = tmp_path / "cpu_x.c"
    src.write_text('#include "cpu_y.h"\nint f(void) { return Y; }\n')
    header = tmp_path / "cpu_y.h"
    header.write_text("#define Y 1\n")
    before = _lib_path(src, "generic", str(tmp_path / "cache"))
    header.write_text("#define Y 2\n")
    assert _lib_path(src, "generic", str(tmp_path / "cache")) != before
    pyproject = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    assert "*.h" in pyproject["tool"]["setuptools"]["package-data"]["kvcli_kernels"]
