"""paged_attention (Triton) against the per-request torch reference."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not importable; the Triton kernels cannot be tested")

import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from kernel_test_utils import (  # noqa: E402
    ATTN_TOL,
    DEVICE,
    ON_GPU,
    QUANT_STORAGE,
    PagedBatch,
    assert_close,
    dtype_id,
    generator,
    quantized_cache,
    requires_cuda,
)

from kvcli_kernels.paged_attention import (  # noqa: E402
    MAX_SPLITS,
    attention_launch_config,
    choose_num_splits,
    paged_attention,
)
from kvcli_kernels.reference import paged_attention_ref  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def run_and_check(batch: PagedBatch, num_splits: int | None, what: str) -> torch.Tensor:
    out = batch.nan_out()  # poisoned: any row the kernel forgets stays NaN
    ret = paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens_t, batch.block_tables,
        batch.scale, batch.max_seqlen_q, batch.max_seq_len, num_splits=num_splits, out=out,
    )
    assert ret is out
    ref = paged_attention_ref(
        batch.q, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens_t, batch.block_tables, batch.scale
    )
    atol, rtol = ATTN_TOL[batch.q.dtype]
    assert_close(out, ref, atol, rtol, what)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode(dtype: torch.dtype, group: int, num_splits: int) -> None:
    """Single-token decode rows with ragged contexts (not multiples of the page size)."""
    gen = generator("decode", dtype, group, num_splits)
    kv_heads = 2 if group < 8 else 1
    batch = PagedBatch([1, 1, 1], [37, 1, 150], group * kv_heads, kv_heads, 64, 16, dtype, gen)
    run_and_check(batch, num_splits, f"decode {dtype} group={group} splits={num_splits}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_prefill_chunk_on_cached_prefix(dtype: torch.dtype, group: int, num_splits: int) -> None:
    """A 23-token chunk at positions 50..72 over a 50-token cached prefix, plus a fresh prompt."""
    gen = generator("chunk", dtype, group, num_splits)
    batch = PagedBatch([23, 9], [73, 9], group, 1, 64, 16, dtype, gen)
    run_and_check(batch, num_splits, f"prefill chunk {dtype} group={group} splits={num_splits}")


@pytest.mark.parametrize(
    ("block_size", "head_dim", "group", "dtype"),
    [
        (16, 64, 8, torch.float16),
        (32, 128, 3, torch.float16),
        (64, 128, 1, torch.float32),
        (16, 80, 4, torch.float16),  # head_dim padded to 128 with a mask
        (32, 96, 2, torch.bfloat16),
        (24, 64, 2, torch.float16),  # a page size that is not a power of two (tiles straddle pages)
        (128, 64, 2, torch.float16),  # a page larger than the KV tile: one page spans two tiles
        (8, 256, 2, torch.float16),  # small pages, head_dim 256 (32-token tiles over 4 pages)
    ],
    ids=lambda v: dtype_id(v) if isinstance(v, torch.dtype) else str(v),
)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_mixed_batch(block_size: int, head_dim: int, group: int, dtype: torch.dtype, num_splits: int) -> None:
    """Decodes, a prefill chunk on a prefix, a full prompt and an empty request in one launch."""
    gen = generator("mixed", block_size, head_dim, group, dtype, num_splits)
    q_lens = [1, 19, 1, 0, 33, 1]
    seq_lens = [70, 19 + 45, 1, 12, 33, 129]
    batch = PagedBatch(q_lens, seq_lens, group * 2, 2, head_dim, block_size, dtype, gen)
    run_and_check(batch, num_splits, f"mixed bs={block_size} D={head_dim} group={group} {dtype} splits={num_splits}")


def test_more_splits_than_tiles() -> None:
    """Segments past a request's KV are empty; the merge must give them weight 0."""
    gen = generator("empty-splits")
    batch = PagedBatch([1, 4], [5, 20], 4, 2, 32, 16, torch.float16, gen)
    run_and_check(batch, 7, "7 splits over 1 tile")


def test_q_dtype_differs_from_cache() -> None:
    """fp32 queries over an fp16 cache: q is cast to the cache dtype, output keeps q's dtype."""
    gen = generator("mixed-dtype")
    batch = PagedBatch([1, 3], [40, 10], 4, 2, 64, 16, torch.float16, gen, q_dtype=torch.float32)
    out = batch.nan_out()
    paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens_t,
                    batch.block_tables, batch.scale, batch.max_seqlen_q, batch.max_seq_len, out=out)
    ref = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens_t,
                              batch.block_tables, batch.scale)
    assert out.dtype == torch.float32
    assert_close(out, ref, 4e-3, 4e-3, "fp32 q / fp16 cache")


def test_strided_q_and_out() -> None:
    """q as a view of a fused QKV projection (non-contiguous) and no out= (allocated)."""
    gen = generator("strided")
    batch = PagedBatch([2, 1], [30, 17], 4, 2, 64, 16, torch.float16, gen)
    fused = torch.randn(batch.q.shape[0], 8, 64, generator=gen).to(torch.float16).to(DEVICE)
    q = fused[:, 2:6]  # token stride 8*64, not contiguous
    out = paged_attention(q, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens_t,
                          batch.block_tables, batch.scale, 2, 30)
    ref = paged_attention_ref(q, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens_t,
                              batch.block_tables, batch.scale)
    assert out.is_contiguous() and out.shape == q.shape
    assert_close(out, ref, *ATTN_TOL[torch.float16], "strided q")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_batches(data: st.DataObject) -> None:
    """Property test: random mixes of decode/prefill rows, GQA ratios, page sizes and splits."""
    batch_size = data.draw(st.integers(1, 4), "batch")
    q_lens, seq_lens = [], []
    for _ in range(batch_size):
        q_len = data.draw(st.sampled_from([1, 1, 2, 7, 17]), "q_len")
        prefix = data.draw(st.integers(0, 90), "prefix")
        q_lens.append(q_len)
        seq_lens.append(prefix + q_len)
    group = data.draw(st.sampled_from([1, 2, 3, 4, 8]), "group")
    kv_heads = data.draw(st.integers(1, 2), "kv_heads")
    head_dim = data.draw(st.sampled_from([16, 32, 48, 64]), "head_dim")
    block_size = data.draw(st.sampled_from([16, 32, 64]), "block_size")
    dtype = data.draw(st.sampled_from([torch.float32, torch.float16]), "dtype")
    num_splits = data.draw(st.sampled_from([1, 2, 3, 5]), "num_splits")
    seed = data.draw(st.integers(0, 2**31 - 1), "seed")
    gen = torch.Generator().manual_seed(seed)
    batch = PagedBatch(q_lens, seq_lens, group * kv_heads, kv_heads, head_dim, block_size, dtype, gen)
    run_and_check(batch, num_splits, "random batch")


def test_split_heuristic() -> None:
    # Plenty of programs: never split.
    assert choose_num_splits(num_programs=512, max_seq_len=32768, num_sms=132, block_n=64) == 1
    # Batch 1 x 8 KV heads at 32k: split to roughly fill 2 programs / SM, capped.
    n = choose_num_splits(num_programs=8, max_seq_len=32768, num_sms=132, block_n=64)
    assert 1 < n <= MAX_SPLITS and 8 * n >= 132
    # Short context: splits never go below MIN_TOKENS_PER_SPLIT keys each.
    assert choose_num_splits(num_programs=8, max_seq_len=300, num_sms=132, block_n=64) == 1
    assert choose_num_splits(num_programs=8, max_seq_len=1024, num_sms=132, block_n=64) == 4


def test_launch_config_tile_independent_of_page_size() -> None:
    """BLOCK_N follows head_dim and dtype only: a page of 128 must not widen the tile (shared memory
    and registers grow with it: page 128 x head_dim 256 would not fit sm_90's shared memory)."""
    for head_dim, dtype, block_n in ((64, torch.bfloat16, 64), (128, torch.float16, 64), (256, torch.bfloat16, 32),
                                     (128, torch.float32, 32)):
        for block_size in (8, 16, 32, 64, 128):
            for group in (1, 3, 8, 16):
                for max_q in (1, 300):
                    cfg = attention_launch_config(group, head_dim, block_size, max_q, dtype)
                    assert cfg["BLOCK_N"] == block_n, (head_dim, dtype, block_size, cfg)
                    assert cfg["BLOCK_M"] >= 16 and cfg["BLOCK_M"] >= group
                    assert cfg["BLOCK_Q"] * group <= cfg["BLOCK_M"]


def test_quantized_decode_takes_half_tiles() -> None:
    """A decode step over an int8 / fp8 cache walks 32 keys per tile (its V tile goes through fp32: at 64 keys the
    split kernel needed 255 registers and spilled under Triton 3.6); prefill and 16-bit caches keep 64."""
    for head_dim in (64, 128):
        assert attention_launch_config(4, head_dim, 16, 1, torch.bfloat16, quant=True)["BLOCK_N"] == 32
        assert attention_launch_config(4, head_dim, 16, 1, torch.bfloat16)["BLOCK_N"] == 64
        assert attention_launch_config(4, head_dim, 16, 300, torch.bfloat16, quant=True)["BLOCK_N"] == 64


def test_validation_errors() -> None:
    gen = generator("validation")
    b = PagedBatch([1], [5], 4, 2, 32, 16, torch.float16, gen)
    args = [b.q, b.k_cache, b.v_cache, b.cu_seqlens_q, b.seq_lens_t, b.block_tables, b.scale, 1, 5]

    def call(i: int, value: object, match: str) -> None:
        bad = list(args)
        bad[i] = value
        with pytest.raises(ValueError, match=match):
            paged_attention(*bad)

    call(0, b.q[:, :3], "multiple of kv_heads")
    call(0, b.q[0], r"\[num_tokens, q_heads, head_dim\]")
    call(1, b.k_cache[..., :16], "k_cache/v_cache")
    call(2, b.v_cache.float(), "dtypes differ")
    call(3, b.cu_seqlens_q.long(), "cu_seqlens_q must be int32")
    call(4, b.seq_lens_t[:0], r"\[batch \+ 1\]")
    call(5, b.block_tables[0], "block_tables")
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention(*args, num_splits=0)
    with pytest.raises(ValueError, match="out must be"):
        paged_attention(*args, out=torch.empty(3, device=DEVICE))
    if ON_GPU:
        call(3, b.cu_seqlens_q.cpu(), "one device")


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
def test_gpu_realistic_sizes(dtype: torch.dtype) -> None:
    gen = generator("gpu", dtype)
    q_lens = [1] * 6 + [300, 1000]
    seq_lens = [4097, 1, 33, 9000, 16, 2500, 300 + 2000, 1000]
    batch = PagedBatch(q_lens, seq_lens, 32, 8, 128, 16, dtype, gen)
    for splits in (None, 1, 8):
        run_and_check(batch, splits, f"gpu {dtype} splits={splits}")


@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_speculative_verification_rows(num_splits: int | None) -> None:
    """Decoding requests verifying guesses: ragged query lengths (1 + k, k = 5, 0, 2, 1) at the end of
    long cached contexts, beside a prefill chunk, in one launch (split-K included)."""
    gen = generator("spec-verify", num_splits)
    q_lens = [6, 1, 3, 2, 7]
    seq_lens = [70, 37, 129, 17, 7 + 40]
    batch = PagedBatch(q_lens, seq_lens, 6, 2, 64, 16, torch.float32, gen)
    run_and_check(batch, num_splits, f"speculative verify splits={num_splits}")


# --- quantized caches: int8 / e4m3 codes + one fp32 scale per token and KV head ------------------


def run_quantized(batch: PagedBatch, storage: torch.dtype, num_splits: int | None, what: str) -> torch.Tensor:
    """The batch's KV quantized as the cache stores it (unused slots: garbage codes, NaN scales),
    attention into a NaN-poisoned output, against the reference on the dequantized KV."""
    gen = generator("quant-poison", what)
    kc, ks = quantized_cache(batch.k_cache, storage, gen)
    vc, vs = quantized_cache(batch.v_cache, storage, gen)
    out = batch.nan_out()
    paged_attention(batch.q, kc, vc, batch.cu_seqlens_q, batch.seq_lens_t, batch.block_tables, batch.scale,
                    batch.max_seqlen_q, batch.max_seq_len, num_splits=num_splits, out=out, k_scale=ks, v_scale=vs)
    ref = paged_attention_ref(batch.q, kc, vc, batch.cu_seqlens_q, batch.seq_lens_t, batch.block_tables,
                              batch.scale, ks, vs)
    assert_close(out, ref, *ATTN_TOL[batch.q.dtype], what)
    return out


@pytest.mark.parametrize(
    ("storage", "q_dtype", "block_size", "head_dim", "group", "num_splits"),
    [
        ("int8", torch.float16, 16, 64, 3, 1),
        ("int8", torch.float32, 32, 80, 1, 3),  # padded head_dim, split-K
        ("int8", torch.bfloat16, 8, 64, 8, 2),  # many pages per tile, GQA 8
        ("fp8", torch.float16, 16, 64, 4, 1),
        ("fp8", torch.float32, 64, 32, 2, 4),  # a 64-token page, split-K
        ("fp8", torch.bfloat16, 24, 64, 2, 1),  # page size not a power of two
    ],
    ids=lambda v: dtype_id(v) if isinstance(v, torch.dtype) else str(v),
)
def test_quantized_mixed_batch(storage: str, q_dtype: torch.dtype, block_size: int, head_dim: int, group: int,
                               num_splits: int) -> None:
    """Decodes, a prefill chunk on a cached prefix, a fresh prompt and an empty request in one launch
    over an int8 / fp8 cache: codes dequantized in registers (K scales folded into the scores, V tiles
    scaled) must equal attention over the dequantized KV."""
    gen = generator("quant-mixed", storage, q_dtype, block_size, head_dim, group, num_splits)
    q_lens, seq_lens = [1, 19, 0, 23, 1], [70, 19 + 45, 12, 23, 129]
    batch = PagedBatch(q_lens, seq_lens, group * 2, 2, head_dim, block_size, torch.float32, gen, q_dtype=q_dtype)
    run_quantized(batch, QUANT_STORAGE[storage], num_splits,
                  f"{storage} q={q_dtype} bs={block_size} D={head_dim} group={group} splits={num_splits}")


@pytest.mark.parametrize("storage", ["int8", "fp8"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_quantized_decode(storage: str, num_splits: int) -> None:
    """A decode-only batch (16-row tiles) with ragged contexts; the result stays near full-precision
    attention (quantization error only: a wrong or missing scale is far off)."""
    gen = generator("quant-decode", storage, num_splits)
    batch = PagedBatch([1, 1, 1], [37, 1, 150], 6, 2, 64, 16, torch.float32, gen, q_dtype=torch.float16)
    out = run_quantized(batch, QUANT_STORAGE[storage], num_splits, f"{storage} decode splits={num_splits}")
    exact = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens_t,
                                batch.block_tables, batch.scale)
    assert (out.float() - exact.float()).abs().max() < (0.02 if storage == "int8" else 0.1)


def test_quantized_validation_errors() -> None:
    gen = generator("quant-validation")
    b = PagedBatch([1], [5], 4, 2, 32, 16, torch.float32, gen, q_dtype=torch.float16)
    kc, ks = quantized_cache(b.k_cache, torch.int8, gen)
    args = [b.q, kc, kc, b.cu_seqlens_q, b.seq_lens_t, b.block_tables, b.scale, 1, 5]
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        paged_attention(*args)
    with pytest.raises(ValueError, match="v_scale must be float32"):
        paged_attention(*args, k_scale=ks, v_scale=ks[:, :4])
    with pytest.raises(ValueError, match="is not quantized"):
        paged_attention(b.q, b.k_cache, b.v_cache, *args[3:], k_scale=ks, v_scale=ks)
    with pytest.raises(ValueError, match="q must be"):
        paged_attention(b.q.to(torch.int8), *args[1:], k_scale=ks, v_scale=ks)


@pytest.mark.parametrize(("dtype", "num_splits"), [(torch.float32, 1), (torch.float16, 3)], ids=["fp32-1", "fp16-3"])
def test_sliding_window(dtype: torch.dtype, num_splits: int) -> None:
    """window=20: decode rows (one past many tiles, one inside its window) and a prefill chunk on a
    cached prefix, against the windowed reference. Keys in tiles wholly before a program's window are
    poisoned with NaN in the kernel's copy of the cache: they must be skipped, not read and masked."""
    window, group = 20, 2
    gen = generator("window", dtype, num_splits)
    batch = PagedBatch([1, 31, 1], [150, 131, 12], group * 2, 2, 64, 16, dtype, gen)
    ref = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens_t,
                              batch.block_tables, batch.scale, window=window)
    block_n = attention_launch_config(group, 64, 16, batch.max_seqlen_q, dtype)["BLOCK_N"]
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    for b, (q_len, seq_len) in enumerate(zip(batch.q_lens, batch.seq_lens)):
        skipped = max(0, seq_len - q_len - window + 1) // block_n * block_n  # first row's first key, tile-aligned
        for p in range(skipped):
            blk = int(batch.block_tables[b, p // 16])
            k_cache[blk, p % 16] = float("nan")
            v_cache[blk, p % 16] = float("nan")
    assert k_cache.isnan().sum() > batch.k_cache.isnan().sum()  # something really is poisoned
    out = paged_attention(batch.q, k_cache, v_cache, batch.cu_seqlens_q, batch.seq_lens_t, batch.block_tables,
                          batch.scale, batch.max_seqlen_q, batch.max_seq_len, num_splits=num_splits,
                          out=batch.nan_out(), window=window)
    atol, rtol = ATTN_TOL[dtype]
    assert_close(out, ref, atol, rtol, f"window {dtype} splits={num_splits}")
    full = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens_t,
                               batch.block_tables, batch.scale)
    assert (ref - full).abs().max().item() > 0.1  # the window changes the answer


@pytest.mark.parametrize(("dtype", "num_splits", "window"), [(torch.float32, 1, 0), (torch.float16, 3, 20)],
                         ids=["fp32-1", "fp16-3-window"])
def test_softcap(dtype: torch.dtype, num_splits: int, window: int) -> None:
    """Gemma 2's attention logit soft-capping, s = c * tanh(s / c) before the mask: decode rows and a prefill
    chunk on a cached prefix (ragged, with and without a window and split-K) against the reference; the
    cap is small enough that it changes the answer."""
    gen = generator("softcap", dtype, num_splits)
    batch = PagedBatch([1, 31, 1], [150, 131, 12], 4, 2, 64, 16, dtype, gen)
    batch.q.mul_(4.0)  # scores of several units, so a cap of 2 bends them
    args = (batch.q, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens_t, batch.block_tables,
            batch.scale)
    ref = paged_attention_ref(*args, window=window, softcap=2.0)
    out = paged_attention(*args, batch.max_seqlen_q, batch.max_seq_len, num_splits=num_splits,
                          out=batch.nan_out(), window=window, softcap=2.0)
    atol, rtol = ATTN_TOL[dtype]
    assert_close(out, ref, atol, rtol, f"softcap {dtype} splits={num_splits} window={window}")
    assert (ref - paged_attention_ref(*args, window=window)).abs().max().item() > 0.05
    with pytest.raises(ValueError, match="softcap must be >= 0"):
        paged_attention(*args, batch.max_seqlen_q, batch.max_seq_len, softcap=-1.0)
