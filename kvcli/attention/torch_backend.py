"""Paged attention in plain torch: gather each request's blocks, then SDPA. The CPU path, and the
reference behaviour the Triton backend must reproduce."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvcli.attention.base import AttentionMetadata


class TorchAttentionBackend:
    name = "torch"

    def __init__(self) -> None:
        self._meta: AttentionMetadata | None = None
        self._masks: dict[int, torch.Tensor | None] = {}

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        slots = meta.slot_mapping
        kc = k_cache.view(-1, *k_cache.shape[2:])
        vc = v_cache.view(-1, *v_cache.shape[2:])
        if bool((slots < 0).any()):
            keep = slots >= 0
            slots, key, value = slots[keep], key[keep], value[keep]
        kc.index_copy_(0, slots, key.to(kc.dtype))
        vc.index_copy_(0, slots, value.to(vc.dtype))

    def _mask(self, b: int, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor | None:
        """Causal mask with the query block ending at the last KV position; shared by all layers."""
        if q_len == 1:
            return None
        if b not in self._masks:
            qpos = torch.arange(kv_len - q_len, kv_len, device=device).unsqueeze(1)
            self._masks[b] = torch.arange(kv_len, device=device).unsqueeze(0) <= qpos
        return self._masks[b]

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        if meta is not self._meta:
            self._meta, self._masks = meta, {}
        bs = k_cache.shape[1]
        out = torch.empty_like(q)
        cu = meta.query_lens_list
        start = 0
        for b, (q_len, kv_len) in enumerate(zip(cu, meta.seq_lens_list)):
            nblk = -(-kv_len // bs)
            blocks = meta.block_tables[b, :nblk]
            k = k_cache[blocks].flatten(0, 1)[:kv_len].transpose(0, 1).to(q.dtype)  # [kvh, L, D]
            v = v_cache[blocks].flatten(0, 1)[:kv_len].transpose(0, 1).to(q.dtype)
            qb = q[start:start + q_len].transpose(0, 1)  # [H, q_len, D]
            o = F.scaled_dot_product_attention(qb, k, v, attn_mask=self._mask(b, q_len, kv_len, q.device),
                                               scale=scale, enable_gqa=True)
            out[start:start + q_len] = o.transpose(0, 1)
            start += q_len
        return out
