"""Turns a SchedulerOutput into tensors (ids, positions, slot mapping, block tables), runs the model
and returns the next-token logits of the requests that sample this step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcli.attention.base import AttentionBackend, AttentionMetadata
from kvcli.engine.scheduler import SchedulerOutput
from kvcli.kvcache.kv_cache import KVCache
from kvcli.model.llama import LlamaModel


@dataclass(frozen=True)
class RunnerOutput:
    req_ids: list[str]  # requests that sample, in row order of logits
    logits: torch.Tensor | None  # [len(req_ids), vocab] float32; None when simulating


def build_metadata(out: SchedulerOutput, block_size: int, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    cu = [0]
    seq_lens: list[int] = []
    q_lens: list[int] = []
    logit_rows: list[int] = []
    for c in out.chunks:
        n = len(c.token_ids)
        ids.extend(c.token_ids)
        pos = range(c.start_pos, c.start_pos + n)
        positions.extend(pos)
        table = c.block_table
        slots.extend(table[p // block_size] * block_size + p % block_size for p in pos)
        cu.append(cu[-1] + n)
        seq_lens.append(c.start_pos + n)
        q_lens.append(n)
        if c.sample:
            logit_rows.append(cu[-1] - 1)
    max_blocks = max(len(c.block_table) for c in out.chunks)
    tables = torch.zeros((len(out.chunks), max_blocks), dtype=torch.int32)
    for b, c in enumerate(out.chunks):
        tables[b, :len(c.block_table)] = torch.tensor(c.block_table, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        max_seqlen_q=max(q_lens),
        max_seq_len=max(seq_lens),
        seq_lens_list=tuple(seq_lens),
        query_lens_list=tuple(q_lens),
    )
    return (torch.tensor(ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device), meta, logit_rows)


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, backend: AttentionBackend) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = model.device
        self.swapped: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # req -> per-layer host K/V
        for k, v in kv_cache.layers:  # block 0 pads every block table: keep it finite from the start
            k[0] = 0
            v[0] = 0

    @property
    def swapped_bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for layers in self.swapped.values() for k, _ in layers)

    def move_blocks(self, out: SchedulerOutput) -> None:
        """Block traffic the scheduler decided on, before any of this step's KV writes: blocks used
        for the first time are zeroed (the pool is allocated uninitialised; padded attention reads
        must see finite values), then swap-outs (their blocks may be reused this step), swap-ins,
        and copy-on-write copies."""
        if out.new_blocks:
            idx = torch.tensor(out.new_blocks, dtype=torch.int64, device=self.device)
            for k, v in self.kv_cache.layers:
                k[idx] = 0
                v[idx] = 0
        for req_id, blocks in out.swap_out:
            idx = torch.tensor(blocks, dtype=torch.int64, device=self.device)
            self.swapped[req_id] = [(k[idx].to("cpu"), v[idx].to("cpu")) for k, v in self.kv_cache.layers]
        for req_id, blocks in out.swap_in:
            idx = torch.tensor(blocks, dtype=torch.int64, device=self.device)
            for (k, v), (hk, hv) in zip(self.kv_cache.layers, self.swapped.pop(req_id)):
                k[idx] = hk.to(self.device)
                v[idx] = hv.to(self.device)
        if out.block_copies:
            src = torch.tensor([s for s, _ in out.block_copies], dtype=torch.int64, device=self.device)
            dst = torch.tensor([d for _, d in out.block_copies], dtype=torch.int64, device=self.device)
            for k, v in self.kv_cache.layers:
                k[dst] = k[src]
                v[dst] = v[src]

    def drop_swapped(self, req_id: str) -> None:
        self.swapped.pop(req_id, None)

    def execute(self, out: SchedulerOutput, all_logits: bool = False) -> RunnerOutput:
        """Run one step. With all_logits, return logits for every scheduled token (teacher forcing)."""
        self.move_blocks(out)
        if not out.chunks:
            return RunnerOutput([], torch.empty(0, self.model.config.vocab_size))
        ids, positions, meta, rows = build_metadata(out, self.kv_cache.block_size, self.device)
        if all_logits:
            logits = self.model.forward(ids, positions, self.kv_cache.layers, meta, self.backend)
            return RunnerOutput([c.req_id for c in out.chunks], logits)
        sampled = [c.req_id for c in out.chunks if c.sample]
        if not sampled:  # a step of prefill chunks only: no lm_head at all
            rows_t = torch.empty(0, dtype=torch.int64, device=self.device)
        else:
            rows_t = torch.tensor(rows, dtype=torch.int64, device=self.device)
        logits = self.model.forward(ids, positions, self.kv_cache.layers, meta, self.backend, rows_t)
        return RunnerOutput(sampled, logits)
