"""Iteration-level scheduling: each step decides how many tokens of each request to compute.

Running requests go first (a decode is one token, a prefill chunk as many as the token budget
allows), then waiting requests are admitted while blocks remain. When the pool runs dry the most
recently admitted running request is preempted by recompute: its blocks are freed and it waits again
with num_computed_tokens reset to 0.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvcli.config import SchedulerConfig
from kvcli.engine.request import Request, RequestStatus
from kvcli.kvcache.block_manager import KVCacheManager


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's share of a step, as plain data for the model runner."""

    req_id: str
    token_ids: list[int]  # the tokens to compute this step
    start_pos: int  # absolute position of token_ids[0] (= tokens already in the cache)
    block_table: list[int]
    sample: bool  # this chunk reaches the end of the known tokens: sample the next one


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


class KVBudgetTooSmall(RuntimeError):
    pass


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        need = self.kv.num_blocks_needed(req.req_id, req.num_prompt_tokens + 1)
        if need > self.kv.pool.num_blocks:
            raise KVBudgetTooSmall(
                f"request {req.req_id} needs {need} KV blocks for its prompt; the pool holds "
                f"{self.kv.pool.num_blocks} (raise --kv-budget or shorten the prompt)"
            )
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.req_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        scheduled: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate(req.req_id, req.num_computed_tokens + n):
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim)
                preempted.append(victim.req_id)
                if victim is req:
                    break
            else:
                scheduled.append(req)
                budget -= n
                i += 1
                chunks.append(self._chunk(req, n))

        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv.allocate(req.req_id, req.num_computed_tokens + n):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            budget -= n
            chunks.append(self._chunk(req, n))

        if not chunks and self.waiting and not self.running:
            req = self.waiting[0]
            raise KVBudgetTooSmall(f"request {req.req_id} cannot get KV blocks even with the pool empty")
        return SchedulerOutput(chunks, preempted)

    def _chunk(self, req: Request, n: int) -> ScheduledChunk:
        start = req.num_computed_tokens
        return ScheduledChunk(
            req_id=req.req_id,
            token_ids=req.all_token_ids[start:start + n],
            start_pos=start,
            block_table=list(self.kv.block_table(req.req_id)),
            sample=start + n == req.num_tokens,
        )

    def finish(self, req: Request, reason: str) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req.req_id)
