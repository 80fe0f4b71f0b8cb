"""The KV cache object: the pool tensors of every layer, their dtype and layout, and the block-level
operations the runner performs on them (zero on first use, copy-on-write copies, swap to host and
back). The model and the attention backends receive a `LayerKV`, never bare (k, v) tuples, so a
cache that carries more per block (quantization scales) changes this file, not their signatures.

Layout per layer: k, v are indexed [num_blocks + 1, block_size, num_kv_heads, head_dim] (block 0 is
the null block, kvcache/interface.py, zeroed here once and never handed out), but stored head-major,
[num_kv_heads, num_blocks + 1, block_size, head_dim], and handed out as a permuted view of that storage.
Why: a decode step reads every cached token of every head; with one head's tokens side by side, a run
of consecutive blocks is one unit-stride [tokens, head_dim] matrix per head, read at memory bandwidth by
a plain GEMM (2.1x the speed of the token-major read on CPU at 4k context, docs/benchmarks.md), and a
gather of blocks is one index_select on the storage's block dim. Code that indexes blocks on dim 0
keeps working on the view; `LayerKV.heads(...)` gives the head-major storage directly. Quantized
formats (kv_dtype.py) add k_scale, v_scale, indexed [num_blocks + 1, block_size, num_kv_heads] and
stored [num_kv_heads, num_blocks + 1, block_size]: they are part of `tensors()`, so zeroing,
copy-on-write copies and swaps carry a block's scales with its codes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kvcli.kvcache.interface import NULL_BLOCK
from kvcli.kvcache.kv_dtype import KVDtype, dequantize, kv_dtype_of, quantize
from kvcli.kvcache.kv_groups import KVGroups, single_group


class KVShape(Protocol):
    """What the KV pool needs of a model's config (kvcli.config.ModelConfig has it): kvcache/ does not
    import config.py, which reads the KV formats from here."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass
class LayerKV:
    """One layer's cache: what attention writes into and reads from."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # quantized formats only: one scale per token and KV head
    v_scale: torch.Tensor | None = None

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    @staticmethod
    def heads(t: torch.Tensor) -> torch.Tensor:
        """The head-major form of a cache tensor indexed [blocks, block_size, kv_heads, ...]:
        [kv_heads, blocks, block_size, ...], a view (of the storage when the cache is head-major).
        float8 comes as its bytes: CPU index_select / index_copy_ / index_fill_ have no float8 kernel."""
        return (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t).movedim(2, 0)

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor that holds per-block state (what a block copy or swap must carry)."""
        if self.k_scale is None or self.v_scale is None:
            return (self.k, self.v)
        return (self.k, self.v, self.k_scale, self.v_scale)


@dataclass
class HostBlocks:
    """Blocks of every layer copied to host memory (a swapped-out request)."""

    layers: list[tuple[torch.Tensor, ...]]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer)


class KVCache:
    def __init__(self, config: KVShape, num_blocks: int, block_size: int,
                 kv_dtype: "KVDtype | torch.dtype | str", device: torch.device, groups: KVGroups | None = None) -> None:
        self.num_blocks = num_blocks  # usable blocks; one more (the null block) is allocated
        self.kv_dtype = kv_dtype_of(kv_dtype)
        self.dtype = self.kv_dtype.storage
        self.device = device
        stored = (config.num_kv_heads, num_blocks + 1, block_size, config.head_dim)
        sdt = self.kv_dtype.scale_dtype

        def alloc(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            """Head-major storage, handed out indexed [blocks, block_size, kv_heads, ...]."""
            return torch.empty(shape, dtype=dtype, device=device).movedim(0, 2)

        # No zero-fill: blocks are zeroed on first use (zero_blocks), which on CPU keeps start-up fast
        # and lets the OS back pages only as blocks are first used.
        def layer() -> LayerKV:
            k, v = alloc(stored, self.dtype), alloc(stored, self.dtype)
            if sdt is None:
                return LayerKV(k, v)
            return LayerKV(k, v, alloc(stored[:-1], sdt), alloc(stored[:-1], sdt))

        # KV groups (kv_groups.py): one tensor pair per slot, layer i reading slot_of[i] through its group's
        # block table; without groups every layer is its own slot.
        self.groups = groups if groups is not None else single_group(config.num_layers)
        self.slots = [layer() for _ in range(self.groups.slots)]
        self.layers = [self.slots[j] for j in self.groups.slot_of]
        self.zero_blocks([NULL_BLOCK])

    @property
    def block_size(self) -> int:
        """Read from the tensors: the layout and the cache were both built from EngineOptions.block_size."""
        return self.layers[0].block_size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.slots for t in layer.tensors())

    def _index(self, blocks: list[int]) -> torch.Tensor:
        return torch.tensor(blocks, dtype=torch.int64, device=self.device)

    def zero_blocks(self, blocks: list[int]) -> None:
        """Padded attention reads of a partly used block must see finite values (NaN * 0 is NaN)."""
        idx = self._index(blocks)
        for layer in self.slots:
            for t in layer.tensors():
                LayerKV.heads(t).index_fill_(1, idx, 0)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        src = self._index([s for s, _ in pairs])
        dst = self._index([d for _, d in pairs])
        for layer in self.slots:
            for t in layer.tensors():
                h = LayerKV.heads(t)  # block ids index dim 1 of the head-major storage
                h.index_copy_(1, dst, h.index_select(1, src))

    def rotate_keys(self, blocks: list[int], rotate) -> None:
        """Apply `rotate(keys, layer_index)` (fp32 keys [N, kv_heads, D] -> rotated, same shape; each layer by its
        own rotary: Gemma 3's local and global layers turn at different rates) to the keys of `blocks` in every
        layer, in place: a retention rule's position shift (kvcache/retention.py). Quantized formats are
        dequantized, rotated and quantized again (kv_dtype.quantize: one more rounding); 16-bit formats round
        once to their storage. Values never move."""
        if self.groups.hybrid:
            raise ValueError("key shifts need one block table for every layer (a bounded cache keeps no KV groups)")
        idx = self._index(blocks)
        n, bs = len(blocks), self.block_size
        for i, layer in enumerate(self.layers):
            h = LayerKV.heads(layer.k)  # [kvh, blocks + 1, bs, D] (fp8 as bytes)
            sel = h.index_select(1, idx)
            if layer.k.dtype == torch.float8_e4m3fn:
                sel = sel.view(torch.float8_e4m3fn)
            kvh, d = sel.shape[0], sel.shape[-1]
            if layer.k_scale is not None:
                hs = LayerKV.heads(layer.k_scale)
                x = dequantize(sel, hs.index_select(1, idx), torch.float32)
            else:
                x = sel.float()
            x = rotate(x.permute(1, 2, 0, 3).reshape(n * bs, kvh, d), i).reshape(n, bs, kvh, d).permute(2, 0, 1, 3)
            if layer.k_scale is not None:
                codes, scale = quantize(x, layer.k.dtype)
                h.index_copy_(1, idx, codes.view(h.dtype) if codes.dtype != h.dtype else codes)
                LayerKV.heads(layer.k_scale).index_copy_(1, idx, scale)
            else:
                h.index_copy_(1, idx, x.to(layer.k.dtype).view(h.dtype))

    def swap_out(self, blocks: list[int]) -> HostBlocks:
        idx = self._index(blocks)
        # Host copies are indexed like the cache ([n, block_size, kv_heads, ...]), whatever its storage.
        return HostBlocks([tuple(LayerKV.heads(t).index_select(1, idx).movedim(0, 2).view(t.dtype).to("cpu")
                                 for t in layer.tensors()) for layer in self.slots])

    def swap_in(self, blocks: list[int], host: HostBlocks) -> None:
        idx = self._index(blocks)
        for layer, saved in zip(self.slots, host.layers):
            for t, h in zip(layer.tensors(), saved):
                LayerKV.heads(t).index_copy_(1, idx, LayerKV.heads(h.to(self.device)))  # fp8 as bytes


def bytes_per_block(config: KVShape, block_size: int, dtype: "KVDtype | torch.dtype | str",
                    groups: KVGroups | None = None) -> int:
    """One block of every layer, or with KV groups one page: `groups.slots` layers."""
    layers = config.num_layers if groups is None else groups.slots
    return kv_dtype_of(dtype).bytes_per_token(layers, config.num_kv_heads, config.head_dim) * block_size


def usable_blocks_for_budget(config: KVShape, block_size: int, dtype: "KVDtype | torch.dtype | str",
                             budget_bytes: int, groups: KVGroups | None = None) -> int:
    """Blocks requests can get from a budget: the null block comes out of the same budget."""
    return budget_bytes // bytes_per_block(config, block_size, dtype, groups) - 1
