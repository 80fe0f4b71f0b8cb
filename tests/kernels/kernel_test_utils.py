"""Shared helpers for the kernel tests (imported after conftest.py has set TRITON_INTERPRET)."""

from __future__ import annotations

import zlib

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
requires_cuda = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")



def dtype_id(dtype: torch.dtype) -> str:
    """Test id of a dtype that says what is verified: the interpreter (no GPU) has no bf16 dots, so the
    kernels upcast bf16 tiles and compute in fp32 there; only bf16 storage is checked on CPU."""
    name = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    return name if ON_GPU or dtype != torch.bfloat16 else "bf16-storage-fp32-compute"


# (atol, rtol) per output dtype. fp16/bf16 include the P -> 16-bit cast inside the PV product.
ATTN_TOL = {torch.float32: (2e-4, 2e-4), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}


def generator(*key: object) -> torch.Generator:
    """A fresh, reproducible CPU generator per test case (seeded from the case's parameters)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def randn(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype).to(DEVICE)


class PagedBatch:
    """A random packed batch: q, a NaN-poisoned paged cache holding each request's KV, block tables.

    Only slots at positions < seq_len of some request hold finite values; every other slot (unused
    blocks, the tail of each last block) is NaN, so a kernel that reads past a request's KV fails.
    """

    def __init__(
        self,
        q_lens: list[int],
        seq_lens: list[int],
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        gen: torch.Generator,
        q_dtype: torch.dtype | None = None,
        spare_blocks: int = 3,
    ) -> None:
        assert len(q_lens) == len(seq_lens) and all(0 <= ql <= sl for ql, sl in zip(q_lens, seq_lens))
        self.q_lens, self.seq_lens = list(q_lens), list(seq_lens)
        self.block_size = block_size
        need = [-(-s // block_size) for s in seq_lens]
        num_blocks = sum(need) + spare_blocks
        perm = torch.randperm(num_blocks, generator=gen)  # scattered, non-contiguous block ids
        max_blocks = max(max(need), 1) + 1  # +1 column of padding (0) past the used blocks
        table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
        k = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
        v = torch.full_like(k, float("nan"))
        used = 0
        for b, (n, s) in enumerate(zip(need, seq_lens)):
            ids = perm[used : used + n]
            used += n
            table[b, :n] = ids.to(torch.int32)
            pos = torch.arange(s)
            blk, off = ids[pos // block_size], pos % block_size
            k[blk, off] = torch.randn(s, num_kv_heads, head_dim, generator=gen)
            v[blk, off] = torch.randn(s, num_kv_heads, head_dim, generator=gen)
        self.k_cache = k.to(dtype).to(DEVICE)
        self.v_cache = v.to(dtype).to(DEVICE)
        self.block_tables = table.to(DEVICE)
        cu = [0]
        for ql in q_lens:
            cu.append(cu[-1] + ql)
        self.cu_seqlens_q = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
        self.seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
        self.q = randn((cu[-1], num_q_heads, head_dim), q_dtype or dtype, gen)
        self.scale = head_dim**-0.5
        self.max_seqlen_q = max(q_lens)
        self.max_seq_len = max(seq_lens)

    def nan_out(self) -> torch.Tensor:
        return torch.full_like(self.q, float("nan"))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, what: str = "") -> None:
    assert not torch.isnan(actual).any(), f"{what}: {int(torch.isnan(actual).sum())} NaN (unwritten?) elements"
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


QUANT_STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def quantized_cache(cache: torch.Tensor, storage: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A PagedBatch cache (NaN in unused slots) -> (codes, fp32 scales) as kvcli.kvcache.kv_dtype.quantize
    stores them, with unused slots poisoned: NaN scales, and codes that are garbage (int8: random
    bytes) or NaN (e4m3 0x7F), so a kernel that reads them, or ignores a mask on them, fails."""
    from kvcli.kvcache.kv_dtype import quantize

    unused = cache.isnan().any(-1).cpu()  # [blocks, block_size, kv_heads]
    codes, scales = quantize(torch.nan_to_num(cache.float().cpu()), storage)
    raw = codes.view(torch.uint8)
    garbage = torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8)
    if storage != torch.int8:
        garbage.fill_(0x7F)
    raw[unused] = garbage[unused]
    scales[unused] = float("nan")
    return codes.to(DEVICE), scales.to(DEVICE)
