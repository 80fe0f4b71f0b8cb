"""Attention backend on the Triton kernels of kvcli_kernels (paged cache write + paged attention).

On a machine without CUDA the kernels only run under the Triton interpreter, which must be
enabled (TRITON_INTERPRET=1) before kvcli_kernels is first imported; the kernels are therefore
imported lazily, on first use, not when this module is imported.

Quantized caches (int8, fp8): the scales of LayerKV go to both kernels; the cache-write kernel
quantizes on write and paged attention dequantizes in registers (docs/kernels.md).
"""

from __future__ import annotations

import torch

from kvcli.attention.base import AttentionMetadata, PlainFeatures
from kvcli.kvcache.kv_cache import LayerKV


class TritonAttentionBackend(PlainFeatures):
    """AttentionBackend (kvcli.attention.base) backed by one Triton launch per call.

    num_splits: None = split-K chosen per step from the batch shape and SM count,
    1 = never split, n > 1 = always n KV segments (mainly for benchmarking).
    """

    name = "triton"

    def __init__(self, num_splits: int | None = None) -> None:
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits must be >= 1 or None; got {num_splits}")
        try:
            import triton  # noqa: F401
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError("the 'triton' attention backend needs the triton package (pip install kvcli[gpu])") from exc
        self.num_splits = num_splits

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: LayerKV,
        meta: AttentionMetadata,
    ) -> None:
        """Store the step's K/V rows into their slots (slot_mapping < 0 skipped)."""
        from kvcli_kernels.cache_write import write_kv_cache

        write_kv_cache(key, value, cache.k, cache.v, meta.slot_mapping, cache.k_scale, cache.v_scale)

    def forward(
        self,
        q: torch.Tensor,
        cache: LayerKV,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of q over each request's cached KV; returns [num_tokens, q_heads, head_dim]."""
        from kvcli_kernels.paged_attention import paged_attention

        return paged_attention(
            q,
            cache.k,
            cache.v,
            meta.cu_seqlens_q,
            meta.seq_lens,
            meta.block_tables,
            scale,
            meta.max_seqlen_q,
            meta.max_seq_len,
            num_splits=self.num_splits if meta.num_splits is None else meta.num_splits,
            k_scale=cache.k_scale,
            v_scale=cache.v_scale,
            window=meta.sliding_window,
            softcap=meta.softcap,
        )

    def decode_graph_key(self, batch: int, max_seq_len: int, cache: LayerKV, heads: int, q_dtype: torch.dtype) -> int:
        """The split-K count such a decode step launches with: the one launch decision that follows the context
        length (tiles follow the batch), so CUDA graphs are captured per (batch, this). The automatic count
        rounded down to a power of two, so a long generation crosses a handful of graphs, not one per 256 keys."""
        if self.num_splits is not None:
            return self.num_splits
        from kvcli_kernels.paged_attention import decode_num_splits

        n = decode_num_splits(batch, heads, q_dtype, cache.k, max_seq_len)
        return 1 << (n.bit_length() - 1)
