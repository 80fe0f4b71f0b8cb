"""The KV pool tensors: one K and one V tensor per layer, [num_blocks, block_size, kv_heads, head_dim],
sized once from the byte budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcli.config import ModelConfig


@dataclass
class KVCache:
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    num_blocks: int
    block_size: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.layers)


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return config.kv_bytes_per_token(dtype) * block_size


def num_blocks_for_budget(config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    return budget_bytes // bytes_per_block(config, block_size, dtype)


def allocate_kv_cache(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> KVCache:
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    # Slots are always written before they are read (attention masks past seq_len), so no zero-fill:
    # on CPU that keeps start-up fast and lets the OS back pages only as blocks are first used.
    layers = [(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
              for _ in range(config.num_layers)]
    return KVCache(layers, num_blocks, block_size, dtype)
