"""write_kv_cache (Triton) against the torch reference on a NaN-poisoned cache."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not importable; the Triton kernels cannot be tested")

import torch  # noqa: E402
from kernel_test_utils import DEVICE, ON_GPU, generator, randn, requires_cuda  # noqa: E402

from kvcli_kernels.cache_write import write_kv_cache  # noqa: E402
from kvcli_kernels.reference import write_kv_cache_ref  # noqa: E402


def _random_slots(num_tokens: int, num_blocks: int, block_size: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct random slots anywhere in the pool, with a few -1 (skip) entries."""
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    skip = torch.rand(num_tokens, generator=gen) < 0.2
    return torch.where(skip, torch.full_like(slots, -1), slots)


def _check(key, value, k_cache, v_cache, slot_mapping) -> None:
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_cache_ref(key, value, k_ref, v_ref, slot_mapping)
    write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    # equal_nan: untouched slots must still be NaN, written ones bit-exact after the cast.
    assert torch.equal(k_cache.isnan(), k_ref.isnan()) and torch.equal(v_cache.isnan(), v_ref.isnan())
    assert torch.equal(torch.nan_to_num(k_cache), torch.nan_to_num(k_ref))
    assert torch.equal(torch.nan_to_num(v_cache), torch.nan_to_num(v_ref))


@pytest.mark.parametrize(
    ("src_dtype", "cache_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float16),  # cast on store
        (torch.bfloat16, torch.float32),
    ],
    ids=str,
)
@pytest.mark.parametrize(("block_size", "kv_heads", "head_dim"), [(16, 2, 64), (32, 3, 80), (64, 1, 128)])
def test_write_matches_reference(
    src_dtype: torch.dtype, cache_dtype: torch.dtype, block_size: int, kv_heads: int, head_dim: int
) -> None:
    gen = generator("write", src_dtype, cache_dtype, block_size, kv_heads, head_dim)
    num_blocks, num_tokens = 7, 23
    key = randn((num_tokens, kv_heads, head_dim), src_dtype, gen)
    value = randn((num_tokens, kv_heads, head_dim), src_dtype, gen)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=cache_dtype, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=cache_dtype, device=DEVICE)
    slots = _random_slots(num_tokens, num_blocks, block_size, gen).to(DEVICE)
    _check(key, value, k_cache, v_cache, slots)


def test_strided_inputs_and_int32_slots() -> None:
    """K/V as views into a fused QKV tensor, cache as a view of a larger per-layer buffer."""
    gen = generator("write-strided")
    num_tokens, kv_heads, head_dim, block_size, num_blocks = 9, 2, 32, 16, 5
    qkv = randn((num_tokens, 8, head_dim), torch.float16, gen)
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    pool = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=torch.float16, device=DEVICE)
    k_cache, v_cache = pool[0], pool[1]
    slots = _random_slots(num_tokens, num_blocks, block_size, gen).to(torch.int32).to(DEVICE)
    _check(key, value, k_cache, v_cache, slots)


def test_all_skipped_and_empty() -> None:
    k_cache = torch.full((2, 16, 1, 16), float("nan"), device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    key = torch.ones(3, 1, 16, device=DEVICE)
    write_kv_cache(key, key, k_cache, v_cache, torch.full((3,), -1, dtype=torch.int64, device=DEVICE))
    assert k_cache.isnan().all() and v_cache.isnan().all()
    empty = torch.empty(0, 1, 16, device=DEVICE)
    write_kv_cache(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=DEVICE))


def test_validation_errors() -> None:
    cache = torch.zeros(2, 16, 2, 32, device=DEVICE)
    key = torch.zeros(3, 2, 32, device=DEVICE)
    slots = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="kv_heads, head_dim must match"):
        write_kv_cache(key[:, :1], key[:, :1], cache, cache, slots)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        write_kv_cache(key, key, cache, cache, slots[:2])
    with pytest.raises(ValueError, match="int32 or int64"):
        write_kv_cache(key, key, cache, cache, slots.float())
    with pytest.raises(ValueError, match="key/value"):
        write_kv_cache(key, key[:2], cache, cache, slots)
    if ON_GPU:
        with pytest.raises(ValueError, match="one device"):
            write_kv_cache(key, key, cache, cache, slots.cpu())


@requires_cuda
@pytest.mark.gpu
def test_gpu_prefill_sized_write() -> None:
    gen = generator("write-gpu")
    num_blocks, block_size, kv_heads, head_dim, num_tokens = 4096, 16, 8, 128, 8192
    key = randn((num_tokens, kv_heads, head_dim), torch.bfloat16, gen)
    value = randn((num_tokens, kv_heads, head_dim), torch.bfloat16, gen)
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    slots = _random_slots(num_tokens, num_blocks, block_size, gen).to(DEVICE)
    write_kv_cache(key, value, k_cache, v_cache, slots)
    valid = slots >= 0
    blk, off = slots[valid] // block_size, slots[valid] % block_size
    assert torch.equal(k_cache[blk, off], key[valid]) and torch.equal(v_cache[blk, off], value[valid])
    assert int(k_cache.isnan().any(-1).any(-1).sum()) == num_blocks * block_size - int(valid.sum())


# --- quantized caches (int8 / fp8 codes + one fp32 scale per token and KV head) -------------------


def _check_quantized(key, value, storage, block_size, num_blocks, slots) -> None:
    """Kernel and reference (kvcli.kvcache.kv_dtype.quantize) must agree bit for bit on codes and scales;
    slots not written keep their poison (0x7F codes: NaN in e4m3, 127 in int8; NaN scales)."""
    kv_heads, head_dim = key.shape[1:]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    caches = []
    for _ in range(2):
        k_cache = torch.full(shape, 0x7F, dtype=torch.uint8, device=DEVICE).view(storage)
        v_cache = torch.full(shape, 0x7F, dtype=torch.uint8, device=DEVICE).view(storage)
        k_scale = torch.full(shape[:3], float("nan"), device=DEVICE)
        caches.append((k_cache, v_cache, k_scale, k_scale.clone()))
    kc, vc, ks, vs = caches[0]
    write_kv_cache(key, value, kc, vc, slots, ks, vs)
    write_kv_cache_ref(key, value, *caches[1][:2], slots, *caches[1][2:])
    for got, want, what in zip(caches[0], caches[1], ("k codes", "v codes", "k scales", "v scales")):
        if got.dtype == torch.float32:
            assert torch.equal(got.isnan(), want.isnan()), what
            assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want)), what
        else:
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), what
    assert int((~ks.isnan()).any(-1).sum()) == int((slots >= 0).sum())


@pytest.mark.parametrize("storage", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize(
    ("src_dtype", "block_size", "kv_heads", "head_dim"),
    [(torch.float32, 16, 3, 80), (torch.float16, 32, 2, 64), (torch.bfloat16, 8, 1, 128)],
    ids=str,
)
def test_quantized_write_is_bit_identical_to_torch(
    storage: torch.dtype, src_dtype: torch.dtype, block_size: int, kv_heads: int, head_dim: int
) -> None:
    """Rows over 6 orders of magnitude, an all-zero row (scale 0), padded head_dim (80), skipped slots."""
    gen = generator("write-quant", storage, src_dtype, block_size, kv_heads, head_dim)
    num_blocks, num_tokens = 5, 21
    mag = torch.logspace(-3, 3, num_tokens)[:, None, None]
    key = (torch.randn((num_tokens, kv_heads, head_dim), generator=gen) * mag).to(src_dtype).to(DEVICE)
    value = randn((num_tokens, kv_heads, head_dim), src_dtype, gen)
    key[3, 0] = 0
    slots = _random_slots(num_tokens, num_blocks, block_size, gen).to(DEVICE)
    _check_quantized(key, value, storage, block_size, num_blocks, slots)


@pytest.mark.parametrize("storage", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_quantized_write_rounds_every_grid_point_and_tie_like_torch(storage: torch.dtype) -> None:
    """Each row holds +qmax (so its scale is exactly 1 and y = x) and then grid points, exact ties
    between neighbours, and values one ulp either side of the ties: rounding half to even, the
    e4m3 subnormal range and the clamp all have to match torch's conversion exactly."""
    if storage == torch.int8:
        grid = torch.arange(-127.0, 128.0)
        qmax = 127.0
    else:
        grid = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(storage).float()
        grid = grid[grid.isfinite()].unique()
        qmax = 448.0
    ties = (grid[1:] + grid[:-1]) / 2
    vals = torch.cat([grid, ties, ties.nextafter(torch.tensor(-1e9)), ties.nextafter(torch.tensor(1e9))])
    head_dim = 64
    per_row = head_dim - 1
    pad = -len(vals) % per_row
    vals = torch.cat([vals, torch.zeros(pad)]).reshape(-1, per_row)
    rows = torch.cat([torch.full((vals.shape[0], 1), qmax), vals], 1)  # [T, 64]
    key = rows[:, None, :].to(DEVICE)  # one KV head
    value = -key
    num_tokens = key.shape[0]
    block_size = 16
    num_blocks = -(-num_tokens // block_size) + 1
    slots = torch.randperm(num_blocks * block_size, generator=generator("ties", storage))[:num_tokens].to(DEVICE)
    _check_quantized(key, value, storage, block_size, num_blocks, slots)


def test_quantized_validation_errors() -> None:
    key = torch.zeros(3, 2, 32, device=DEVICE)
    slots = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    codes = torch.zeros(2, 16, 2, 32, dtype=torch.int8, device=DEVICE)
    scale = torch.zeros(2, 16, 2, device=DEVICE)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        write_kv_cache(key, key, codes, codes, slots)
    with pytest.raises(ValueError, match=r"k_scale must be float32 \[2, 16, 2\]"):
        write_kv_cache(key, key, codes, codes, slots, scale.half(), scale)
    with pytest.raises(ValueError, match=r"v_scale must be float32"):
        write_kv_cache(key, key, codes, codes, slots, scale, scale[:, :8])
    with pytest.raises(ValueError, match="is not quantized"):
        write_kv_cache(key, key, codes.float(), codes.float(), slots, scale, scale)
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn"):
        write_kv_cache(key, key, codes.to(torch.int16), codes.to(torch.int16), slots, scale, scale)
