"""The KV cache object: the pool tensors of every layer, their dtype and layout, and the block-level
operations the runner performs on them (zero on first use, copy-on-write copies, swap to host and
back). The model and the attention backends receive a `LayerKV`, never bare (k, v) tuples, so a
cache that carries more per block (quantization scales) changes this file, not their signatures.

Layout per layer: k, v [num_blocks + 1, block_size, num_kv_heads, head_dim]; block 0 is the null
block (kvcache/interface.py), zeroed here once and never handed out. Quantized formats (kv_dtype.py)
add k_scale, v_scale [num_blocks + 1, block_size, num_kv_heads] beside them: they are part of
`tensors()`, so zeroing, copy-on-write copies and swaps carry a block's scales with its codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcli.config import ModelConfig
from kvcli.kvcache.interface import NULL_BLOCK
from kvcli.kvcache.kv_dtype import KVDtype, kv_dtype_of


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
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 kv_dtype: "KVDtype | torch.dtype | str", device: torch.device) -> None:
        self.num_blocks = num_blocks  # usable blocks; one more (the null block) is allocated
        self.kv_dtype = kv_dtype_of(kv_dtype)
        self.dtype = self.kv_dtype.storage
        self.device = device
        shape = (num_blocks + 1, block_size, config.num_kv_heads, config.head_dim)
        sdt = self.kv_dtype.scale_dtype

        # No zero-fill: blocks are zeroed on first use (zero_blocks), which on CPU keeps start-up fast
        # and lets the OS back pages only as blocks are first used.
        def layer() -> LayerKV:
            k, v = (torch.empty(shape, dtype=self.dtype, device=device) for _ in range(2))
            if sdt is None:
                return LayerKV(k, v)
            return LayerKV(k, v, torch.empty(shape[:-1], dtype=sdt, device=device),
                           torch.empty(shape[:-1], dtype=sdt, device=device))

        self.layers = [layer() for _ in range(config.num_layers)]
        self.zero_blocks([NULL_BLOCK])

    @property
    def block_size(self) -> int:
        """Read from the tensors: the layout and the cache were both built from EngineOptions.block_size."""
        return self.layers[0].block_size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.tensors())

    def _index(self, blocks: list[int]) -> torch.Tensor:
        return torch.tensor(blocks, dtype=torch.int64, device=self.device)

    def zero_blocks(self, blocks: list[int]) -> None:
        """Padded attention reads of a partly used block must see finite values (NaN * 0 is NaN)."""
        idx = self._index(blocks)
        for layer in self.layers:
            for t in layer.tensors():
                t[idx] = 0

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        src = self._index([s for s, _ in pairs])
        dst = self._index([d for _, d in pairs])
        for layer in self.layers:
            for t in layer.tensors():
                t[dst] = t[src]

    def swap_out(self, blocks: list[int]) -> HostBlocks:
        idx = self._index(blocks)
        return HostBlocks([tuple(t[idx].to("cpu") for t in layer.tensors()) for layer in self.layers])

    def swap_in(self, blocks: list[int], host: HostBlocks) -> None:
        idx = self._index(blocks)
        for layer, saved in zip(self.layers, host.layers):
            for t, h in zip(layer.tensors(), saved):
                t[idx] = h.to(self.device)


def bytes_per_block(config: ModelConfig, block_size: int, dtype: "KVDtype | torch.dtype | str") -> int:
    return config.kv_bytes_per_token(dtype) * block_size


def usable_blocks_for_budget(config: ModelConfig, block_size: int, dtype: "KVDtype | torch.dtype | str",
                             budget_bytes: int) -> int:
    """Blocks requests can get from a budget: the null block comes out of the same budget."""
    return budget_bytes // bytes_per_block(config, block_size, dtype) - 1
