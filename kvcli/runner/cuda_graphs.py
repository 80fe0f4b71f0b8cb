"""Decode steps replayed from CUDA graphs (the launches of a whole forward pass recorded once, replayed as one).

An eager decode step launches every kernel from Python: on a GPU a small batch is bound by those launches,
not by the weights it reads (an 8B INT4 model is ~14 launches per layer, 32 layers). A graph records the
forward once and replays it with one call. What a graph needs, and how this module provides it:

  * Fixed shapes and addresses. The step's inputs go into static device buffers (token ids, positions,
    slots, KV lengths, block tables) sized for the largest batch; a step of n requests runs the graph of
    the smallest bucket >= n (1, 2, 4, 8, then multiples of 8 up to --max-num-seqs). The rows past n are
    padding: KV length 0 (attention reads nothing and returns 0), slot -1 (nothing is stored); their
    logits are never read.
  * The same kernels. Everything the launchers decide on the host is fixed at capture: tile shapes follow
    the bucket; the attention's split-K count follows the longest context, so a graph is kept per
    (bucket, split count), each captured the first time a step needs it (the backend says which count a
    step launches with, `decode_graph_key`, and the step's metadata fixes it).
  * No host work inside. Only decode steps of the Triton backend are graphed (the torch backend loops over
    requests on the host); prefill chunks, speculative verification and teacher-forced scoring run eagerly.

Captures share one memory pool (their temporaries reuse it) and write their logits into one static buffer
(a replay's logits are read before the next step). A capture that fails turns graphs off for the engine
(`status` says why) and the step runs eagerly. On a machine without CUDA, `capture=False` runs the same
static-buffer path eagerly (tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from kvcli.attention.base import AttentionBackend, AttentionMetadata
from kvcli.kvcache.kv_cache import KVCache
from kvcli.model.llama import LlamaModel
from kvcli.step import ScheduledChunk


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """The padded batch sizes graphs are captured for: 1, 2, 4, 8, 16, 24, ... up to max_batch (included)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return tuple(sizes + [max_batch])


def graphable(chunks: Sequence[ScheduledChunk]) -> bool:
    """A plain decode step: every request one new token, sampled, no guesses to verify, no prompt to score."""
    return bool(chunks) and all(len(c.token_ids) == 1 and c.sample and not c.spec_token_ids and not c.prompt_targets
                                for c in chunks)


class DecodeGraphs:
    """Owns the static input buffers and the captured graphs of one engine's decode steps."""

    def __init__(self, model: LlamaModel, kv_cache: KVCache, backend: AttentionBackend, max_batch: int,
                 max_blocks: int, *, capture: bool = True) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.buckets = batch_buckets(max_batch)
        self.max_blocks = max_blocks
        self.capture = capture
        self.device = device = model.device
        b = self.buckets[-1]
        self.ids = torch.zeros(b, dtype=torch.int64, device=device)
        self.positions = torch.zeros(b, dtype=torch.int64, device=device)
        self.slots = torch.full((b,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(b, dtype=torch.int32, device=device)
        self.cu = torch.arange(b + 1, dtype=torch.int32, device=device)  # one query row per request, always
        self.tables = torch.zeros(b, max_blocks, dtype=torch.int32, device=device)  # null block everywhere
        # KV groups past the first (kvcache/kv_groups.py: Gemma's windowed layers): their own slots and tables.
        extra = len(kv_cache.groups.groups) - 1
        self.group_slots = [torch.full((b,), -1, dtype=torch.int64, device=device) for _ in range(extra)]
        self.group_tables = [torch.zeros(b, max_blocks, dtype=torch.int32, device=device) for _ in range(extra)]
        self.logits = torch.empty(b, model.config.vocab_size, dtype=torch.float32, device=device) if capture else None
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.failed: str | None = None
        self.replays = 0
        self.sliding_window = model.config.sliding_window or 0

    @property
    def status(self) -> str:
        """One line for the summary: on, with the graphs captured so far, or off and why."""
        if self.failed:
            return f"off ({self.failed})"
        if not self.capture:
            return "static buffers, eager (no CUDA)"
        return f"on ({len(self.graphs)} captured, {self.replays:,} decode steps replayed)"

    def bucket(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def run(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor | None:
        """Logits [n, vocab] of a decode step's n requests, in chunk order; None when this step is not for a
        graph (the caller runs it eagerly)."""
        if self.failed or not graphable(chunks):
            return None
        n = len(chunks)
        b = self.bucket(n)
        width = max(len(c.block_table) for c in chunks)
        if b is None or width > self.max_blocks:
            return None
        bs = self.kv_cache.block_size
        ids = [c.token_ids[0] for c in chunks]
        pos = [c.start_pos for c in chunks]
        lens = [p + 1 for p in pos]
        max_len = max(lens)
        split = self.backend.decode_graph_key(b, max_len, self.kv_cache.layers[0], self.model.config.num_heads,
                                              self.model.dtype)
        if split is None:
            return None
        pad = b - n
        self.ids[:b].copy_(torch.tensor(ids + [0] * pad, dtype=torch.int64), non_blocking=True)
        self.positions[:b].copy_(torch.tensor(pos + [0] * pad, dtype=torch.int64), non_blocking=True)
        self.seq_lens[:b].copy_(torch.tensor(lens + [0] * pad, dtype=torch.int32), non_blocking=True)

        def fill(slots_buf: torch.Tensor, tables_buf: torch.Tensor, tables: list[list[int]]) -> None:
            slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, pos)]
            slots_buf[:b].copy_(torch.tensor(slots + [-1] * pad, dtype=torch.int64), non_blocking=True)
            # Entries past a request's own blocks may be stale: attention reads only the blocks its length covers.
            tables_buf[:n, :width].copy_(torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
                                         non_blocking=True)

        fill(self.slots, self.tables, [c.block_table for c in chunks])
        for g, (gs, gt) in enumerate(zip(self.group_slots, self.group_tables)):
            fill(gs, gt, [c.group_tables[g] for c in chunks])
        key = (b, split)
        meta = AttentionMetadata(slot_mapping=self.slots[:b], cu_seqlens_q=self.cu[:b + 1],
                                 seq_lens=self.seq_lens[:b], block_tables=self.tables[:b], max_seqlen_q=1,
                                 max_seq_len=max_len, query_lens_list=(1,) * b, sliding_window=self.sliding_window,
                                 num_splits=split)
        if self.group_slots:
            meta = replace(meta, groups=tuple(replace(meta, slot_mapping=gs[:b], block_tables=gt[:b])
                                              for gs, gt in zip(self.group_slots, self.group_tables)))
        if not self.capture:
            return self._forward(b, meta)[:n]
        graph = self.graphs.get(key)
        if graph is None:
            try:
                graph = self.graphs[key] = self._capture(b, meta)
            except Exception as e:  # noqa: BLE001 - a failed capture is reported and the engine decodes eagerly
                self.failed = f"capture failed: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"
                torch.cuda.synchronize(self.device)
                return None
        graph.replay()
        self.replays += 1
        return self.logits[:n]

    def _forward(self, b: int, meta: AttentionMetadata) -> torch.Tensor:
        return self.model.forward(self.ids[:b], self.positions[:b], self.kv_cache, meta, self.backend)

    def _capture(self, b: int, meta: AttentionMetadata) -> torch.cuda.CUDAGraph:
        """Warm up on a side stream (compiles kernels, fills lazy caches: nothing may do either during a
        capture), then record one forward whose logits land in the shared static buffer. The warm-up
        computes this very step: storing its K/V twice is idempotent, and the replay that follows gives
        the logits."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(b, meta)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.logits[:b].copy_(self._forward(b, meta))
        return graph
