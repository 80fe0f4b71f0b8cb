"""Iteration-level scheduling: each step decides how many tokens of each request to compute.

Order per step: requests swapped out earlier come back first (when nothing was preempted), then
running requests get their tokens (one for a decode, a chunk for an unfinished prompt, all under
the step's token budget), then waiting requests are admitted while the pool keeps a watermark of
free blocks. When a running request cannot get a block, the most recently admitted running request
is preempted: by recompute (blocks freed, num_computed_tokens reset, back to the front of the
queue) or by swap (its blocks copied to host memory and freed; copied back later, nothing
recomputed). Finished requests free their blocks in the step they finish; new requests join the
next step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvcli.config import SchedulerConfig
from kvcli.engine.request import Request, RequestStatus


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
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    swap_out: list[tuple[str, list[int]]] = field(default_factory=list)  # (req, blocks) -> host
    swap_in: list[tuple[str, list[int]]] = field(default_factory=list)  # host -> (req, new blocks)
    finished: list[str] = field(default_factory=list)  # ended by the scheduler (pool cannot hold them)
    new_blocks: list[int] = field(default_factory=list)  # first use: zero before anything is written

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


class KVBudgetTooSmall(RuntimeError):
    pass


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv, *, preempt: str = "recompute", reserve: str = "max-len",
                 swap_blocks: int = 0, watermark: float = 0.01) -> None:
        if preempt not in ("recompute", "swap"):
            raise ValueError(f"unknown preemption mode {preempt!r} (recompute or swap)")
        if reserve not in ("max-len", "request"):
            raise ValueError(f"unknown reservation {reserve!r} (max-len or request)")
        self.config = config
        self.kv = kv  # KVCacheManager (paged) or ContiguousAllocator
        self.preempt_mode = preempt
        self.reserve = reserve
        self.swap_blocks_free = swap_blocks  # host swap space, in blocks
        self.watermark_blocks = int(watermark * kv.num_blocks) if kv.layout == "paged" else 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.num_preemptions = 0

    # --- queue -----------------------------------------------------------------------------------
    def reserve_tokens(self, req: Request) -> int:
        """Slots a contiguous layout sets aside at admission (the paged layout ignores it)."""
        if self.reserve == "request":
            return min(req.num_prompt_tokens + req.params.max_tokens, self.config.max_model_len)
        return self.config.max_model_len

    def add(self, req: Request) -> None:
        need = self.kv.num_blocks_needed(req.req_id, max(req.num_prompt_tokens + 1, self._initial_reserve(req)))
        if need > self.kv.num_blocks:
            raise KVBudgetTooSmall(
                f"request {req.req_id} needs {need} KV blocks; the pool holds {self.kv.num_blocks} "
                f"(raise --kv-budget, shorten the prompt or lower --max-model-len)"
            )
        self.waiting.append(req)

    def _initial_reserve(self, req: Request) -> int:
        return self.reserve_tokens(req) if self.kv.layout == "contiguous" else 0

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # --- preemption ----------------------------------------------------------------------------------
    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        table = list(self.kv.block_table(req.req_id))
        req.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(req.req_id)
        swapped_in = next((i for i, (rid, _) in enumerate(out.swap_in) if rid == req.req_id), None)
        if swapped_in is not None:
            # Swapped in and out within one step: its host copy is still current, so undo the swap-in.
            del out.swap_in[swapped_in]
            self.kv.free(req.req_id)
            self.swap_blocks_free -= req.swapped_blocks
            req.status = RequestStatus.SWAPPED
            self.swapped.appendleft(req)
            return
        if self.preempt_mode == "swap" and len(table) <= self.swap_blocks_free:
            self.swap_blocks_free -= len(table)
            out.swap_out.append((req.req_id, table))
            self.kv.free(req.req_id)
            req.status = RequestStatus.SWAPPED
            req.swapped_blocks = len(table)
            self.swapped.append(req)
            return
        self.kv.free(req.req_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    # --- one step ------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        out = SchedulerOutput([])

        # Swapped requests return first, each with blocks for the tokens it already computed.
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            req = self.swapped[0]
            if self.kv.num_blocks_needed(req.req_id, req.num_computed_tokens + 1) + self.watermark_blocks \
                    > self.kv.num_free_blocks:
                break
            self.kv.allocate(req.req_id, req.num_computed_tokens, req.num_computed_tokens)
            self.swapped.popleft()
            self.swap_blocks_free += req.swapped_blocks
            out.swap_in.append((req.req_id, list(self.kv.block_table(req.req_id))))
            req.status = RequestStatus.RUNNING
            self.running.append(req)

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate(req.req_id, req.num_computed_tokens + n, req.num_computed_tokens):
                if len(self.running) == 1 and not self.swapped:
                    # Alone and still out of blocks: the pool cannot hold this request's context, and
                    # preempting it would only loop. It ends here, its tokens so far kept.
                    self.finish(req, "kv_budget")
                    out.finished.append(req.req_id)
                    break
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                budget -= n
                i += 1
                out.chunks.append(self._chunk(req, n))

        while (self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs
               and not out.preempted and not self.swapped):
            req = self.waiting[0]
            if req.num_computed_tokens == 0:  # reuse cached blocks of a shared prefix (paged only)
                req.num_computed_tokens = self.kv.match_prefix(req.req_id, req.all_token_ids)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            need = self.kv.num_blocks_needed(req.req_id, max(req.num_computed_tokens + n, self._initial_reserve(req)))
            if need + self.watermark_blocks > self.kv.num_free_blocks or not self.kv.allocate(
                    req.req_id, req.num_computed_tokens + n, req.num_computed_tokens, self._initial_reserve(req)):
                # Not now (contiguous: no single hole large enough, i.e. external fragmentation).
                # Prefix blocks taken above go back to the cache; the match is redone next time.
                self.kv.free(req.req_id)
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            budget -= n
            out.chunks.append(self._chunk(req, n))

        out.block_copies.extend(self.kv.take_copies())
        out.new_blocks.extend(self.kv.take_new_blocks())
        if not out.chunks and not self.running and (self.waiting or self.swapped):
            req = (self.waiting or self.swapped)[0]
            raise KVBudgetTooSmall(f"request {req.req_id} cannot get KV blocks even with the pool empty")
        return out

    def _chunk(self, req: Request, n: int) -> ScheduledChunk:
        start = req.num_computed_tokens
        return ScheduledChunk(
            req_id=req.req_id,
            token_ids=req.token_slice(start, start + n),
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
        elif req in self.swapped:
            self.swapped.remove(req)
            self.swap_blocks_free += req.swapped_blocks
        self.kv.free(req.req_id)
