"""Block ids whose element offset exceeds 2^31: the kernels' pointer math must be 64-bit.

The cache really has > 2^31 elements per tensor (fp16, ~4.3 GB each), but on CPU it lives in an
anonymous MAP_NORESERVE mapping, so only the few pages the test touches get physical memory. The
mapping also reserves 2^31 elements *before* the cache: a kernel whose offsets wrap around in
int32 then reads/writes zeros inside that margin and the test fails, instead of crashing the
interpreter with a segfault. On CUDA the caches are plain (uninitialised) device allocations.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator

import pytest

pytest.importorskip("triton", reason="triton is not importable; the Triton kernels cannot be tested")

import torch  # noqa: E402
from kernel_test_utils import ATTN_TOL, DEVICE, ON_GPU, assert_close, generator  # noqa: E402

from kvcli_kernels.cache_write import write_kv_cache  # noqa: E402
from kvcli_kernels.paged_attention import paged_attention  # noqa: E402
from kvcli_kernels.reference import paged_attention_ref  # noqa: E402

BLOCK_SIZE, KV_HEADS, HEAD_DIM, GROUP = 16, 2, 64, 3
ELEMS_PER_BLOCK = BLOCK_SIZE * KV_HEADS * HEAD_DIM  # 2048
LOW_BLOCKS = 2**31 // ELEMS_PER_BLOCK  # first block whose start offset is >= 2^31
NUM_BLOCKS = LOW_BLOCKS + 64
MARGIN = 2**31  # elements mapped in front of the cache (see module doc)


def _huge_cache(num_elems: int) -> tuple[torch.Tensor, object]:
    if ON_GPU:
        return torch.empty(num_elems, dtype=torch.float16, device=DEVICE), None
    nbytes = (MARGIN + num_elems) * 2
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20) | getattr(mmap, "MAP_NORESERVE", 0)
    try:
        mm = mmap.mmap(-1, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError) as exc:  # pragma: no cover - e.g. strict overcommit
        pytest.skip(f"cannot map {nbytes / 2**30:.1f} GiB of sparse virtual memory: {exc}")
    return torch.frombuffer(mm, dtype=torch.float16, offset=MARGIN * 2, count=num_elems), mm


@pytest.fixture(scope="module")
def huge_kv() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    if ON_GPU and torch.cuda.mem_get_info()[0] < 10 * 2**30:
        pytest.skip("needs ~9 GiB of free GPU memory")
    n = NUM_BLOCKS * ELEMS_PER_BLOCK
    assert n > 2**31
    k_flat, k_map = _huge_cache(n)
    v_flat, v_map = _huge_cache(n)
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    yield k_flat.view(shape), v_flat.view(shape)
    del k_flat, v_flat
    for mm in (k_map, v_map):
        if mm is not None:
            try:
                mm.close()  # type: ignore[attr-defined]
            except BufferError:  # a view is still alive somewhere; the GC unmaps it later
                pass


def test_write_and_attend_above_2g_elements(huge_kv: tuple[torch.Tensor, torch.Tensor]) -> None:
    k_cache, v_cache = huge_kv
    gen = generator("big-offsets")
    # Request 0: 70-token prefix + 5 new tokens; request 1: decode at position 40.
    seq_lens, q_lens = [75, 41], [5, 1]
    high = LOW_BLOCKS + torch.randperm(64, generator=gen)  # offsets >= 2^31 elements
    low = torch.randperm(1000, generator=gen)  # a few small ids mixed in
    tables = torch.zeros(2, 6, dtype=torch.int32)
    tables[0, :5] = torch.stack([high[0], low[0], high[1], high[2], high[3]]).to(torch.int32)
    tables[1, :3] = torch.stack([high[4], high[5], low[1]]).to(torch.int32)
    tables_dev = tables.to(DEVICE)

    # Every position of both requests goes through the write kernel (the whole KV, in one call).
    slots, rows = [], []
    for b, s in enumerate(seq_lens):
        for p in range(s):
            slots.append(int(tables[b, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE)
            rows.append((b, p))
    slots.append(-1)  # a padding token: must be skipped
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    key = torch.randn(len(slots), KV_HEADS, HEAD_DIM, generator=gen).to(DEVICE)  # fp32 -> fp16 cast in kernel
    value = torch.randn(len(slots), KV_HEADS, HEAD_DIM, generator=gen).to(DEVICE)
    assert int(slot_mapping.max()) * KV_HEADS * HEAD_DIM > 2**31
    write_kv_cache(key, value, k_cache, v_cache, slot_mapping)

    valid = slot_mapping >= 0
    blk, off = slot_mapping[valid] // BLOCK_SIZE, slot_mapping[valid] % BLOCK_SIZE
    assert torch.equal(k_cache[blk, off], key[valid].to(torch.float16))
    assert torch.equal(v_cache[blk, off], value[valid].to(torch.float16))

    cu = torch.tensor([0, 5, 6], dtype=torch.int32, device=DEVICE)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(6, KV_HEADS * GROUP, HEAD_DIM, generator=gen).to(torch.float16).to(DEVICE)
    ref = paged_attention_ref(q, k_cache, v_cache, cu, sl, tables_dev, HEAD_DIM**-0.5)
    for splits in (1, 2):
        out = torch.full_like(q, float("nan"))
        paged_attention(q, k_cache, v_cache, cu, sl, tables_dev, HEAD_DIM**-0.5, 5, 75, num_splits=splits, out=out)
        assert_close(out, ref, *ATTN_TOL[torch.float16], f"attention over >2^31-element pool, splits={splits}")
