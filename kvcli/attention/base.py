"""The attention backend interface: what the model runner hands to attention.

Layouts (shared by every backend and by the Triton kernels):
  cache            : a kvcli.kvcache.kv_cache.LayerKV per layer; cache.k, cache.v are indexed
                     [num_blocks + 1, block_size, num_kv_heads, head_dim] (block 0: the null block),
                     stored head-major (LayerKV.heads gives [num_kv_heads, num_blocks + 1, ...]);
                     kernels take strides, so they read either storage order
  q                : [num_tokens, num_q_heads, head_dim], the step's tokens of all requests packed
  key, value       : [num_tokens, num_kv_heads, head_dim]
A request's token at absolute position p lives in slot block_table[p // block_size] * block_size
+ p % block_size. The step's K/V are written to the cache first, then attention reads everything
(cached prefix + this step's tokens) through the block table, causally; with a sliding window w, the
query at position p sees keys [p - w + 1, p] only; with a soft-cap c (Gemma 2), the scores s = scale q.k are
c * tanh(s / c) before the mask and the softmax.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from kvcli.kvcache.kv_cache import LayerKV


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step attention inputs, built once by the runner and shared by all layers."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]; negative = do not write
    cu_seqlens_q: torch.Tensor  # int32 [batch + 1]; request b's query rows are [cu[b], cu[b+1])
    seq_lens: torch.Tensor  # int32 [batch]; KV length of request b after this step's tokens
    block_tables: torch.Tensor  # int32 [batch, max_blocks]; padded with the null block (0)
    max_seqlen_q: int
    max_seq_len: int
    # Host copies, so the torch path can loop without device syncs.
    seq_lens_list: tuple[int, ...] = ()
    query_lens_list: tuple[int, ...] = ()
    sliding_window: int = 0  # w > 0: position p sees keys [p - w + 1, p]; 0 = full causal (set by the model)
    softcap: float = 0.0  # c > 0: scores s = scale q.k become c * tanh(s / c) before the mask (Gemma 2; the model)
    num_splits: int | None = None  # split-K count fixed by the caller (a CUDA graph's); None: the backend's choice
    # KV groups past the first (kvcache/kv_groups.py: Gemma's windowed layers keep their own block tables): each
    # group's metadata, its slot_mapping and block_tables its own, the rest as here. Empty: one table for all.
    groups: tuple["AttentionMetadata", ...] = ()

    def for_group(self, group: int) -> "AttentionMetadata":
        """The metadata of a layer in KV group `group` (0: this one)."""
        if group == 0:
            return self
        if group > len(self.groups):  # never the first group's slots: they name another layer's KV in that page
            raise ValueError(f"a step without the block tables of KV group {group} (ScheduledChunk.group_tables)")
        return self.groups[group - 1]

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])


class AttentionBackend(Protocol):
    name: str

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: "LayerKV",
        meta: AttentionMetadata,
    ) -> None:
        """Store the step's K/V rows into their slots (slot_mapping < 0 skipped)."""

    def forward(
        self,
        q: torch.Tensor,
        cache: "LayerKV",
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of q over each request's cached KV; returns [num_tokens, q_heads, head_dim]."""

    # -- optional features: a backend that lacks one returns None, and the model takes its plain path --
    def rope_kv_writer(self, cos: torch.Tensor, sin_signed: torch.Tensor, positions: torch.Tensor,
                       meta: AttentionMetadata, first: "LayerKV", heads: int,
                       kv_heads: int) -> Callable[[torch.Tensor, "LayerKV"], torch.Tensor] | None:
        """Rotary + KV store in one kernel call per layer: a function (qkv [T, (H + 2 KVH) D], cache) -> the
        rotated q [T, H, D], having stored k and v; None where the backend has no such kernel for this step."""

    def native_decode_plan(self, meta: AttentionMetadata, caches: list["LayerKV"], heads: int,
                           scale: float) -> tuple[object, list] | None:
        """For a decode step (one query row per request): the attention kernel's per-step arguments and one
        view per layer's cache, for the one-call C decode (model/native_decode.py); None where it cannot
        take this step."""

    def decode_graph_key(self, batch: int, max_seq_len: int, cache: "LayerKV", heads: int,
                         q_dtype: torch.dtype) -> int | None:
        """For a decode step of `batch` rows over at most max_seq_len keys: what, beyond the batch, fixes the
        kernels this backend launches (steps that agree replay one CUDA graph: runner/cuda_graphs.py); None
        where its decode steps cannot be captured (host work per step)."""


class PlainFeatures:
    """The optional features absent: what a backend without native CPU kernels inherits."""

    def rope_kv_writer(self, *args: object) -> None:
        return None

    def native_decode_plan(self, *args: object) -> None:
        return None

    def decode_graph_key(self, *args: object) -> None:
        return None
