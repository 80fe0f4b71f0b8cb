"""The KV cache object: the pool tensors of every layer, their dtype and layout, and the block-level
operations the runner performs on them (zero on first use, copy-on-write copies, swap to host and
back). The model and the attention backends receive a `LayerKV`, never bare (k, v) tuples, so a
cache that carries more per block (quantization scales) changes this file, not their signatures.

Layout per layer: k, v [num_blocks + 1, block_size, num_kv_heads, head_dim]; block 0 is the null
block (kvcache/interface.py), zeroed here once and never handed out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcli.config import ModelConfig
from kvcli.kvcache.interface import NULL_BLOCK


@dataclass
class LayerKV:
    """One layer's cache: what attention writes into and reads from."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor that holds per-block state (what a block copy or swap must carry)."""
        return (self.k, self.v)


@dataclass
class HostBlocks:
    """Blocks of every layer copied to host memory (a swapped-out request)."""

    layers: list[tuple[torch.Tensor, ...]]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer)


class KVCache:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_blocks = num_blocks  # usable blocks; one more (the null block) is allocated
        self.dtype = dtype
        self.device = device
        shape = (num_blocks + 1, block_size, config.num_kv_heads, config.head_dim)
        # No zero-fill: blocks are zeroed on first use (zero_blocks), which on CPU keeps start-up fast
        # and lets the OS back pages only as blocks are first used.
        self.layers = [LayerKV(torch.empty(shape, dtype=dtype, device=device),
                               torch.empty(shape, dtype=dtype, device=device)) for _ in range(config.num_layers)]
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


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return config.kv_bytes_per_token(dtype) * block_size


def usable_blocks_for_budget(config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    """Blocks requests can get from a budget: the null block comes out of the same budget."""
    return budget_bytes // bytes_per_block(config, block_size, dtype) - 1
