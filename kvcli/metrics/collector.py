"""Combines the statistics of the engine's parts into records the views read. The collector owns
nothing but its history: the scheduler, the KV layout and the engine each produce their own
statistics (metrics/stats.py); this file turns slots into bytes, adds the contiguous what-if, keeps
one small StepRecord per step (the profile timeline) and builds a full Snapshot when asked.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcli.kvcache.contiguous import reservation_split
from kvcli.kvcache.interface import blocks_for
from kvcli.metrics.snapshot import KVBreakdown, MemorySnapshot, RequestTiming, Snapshot, SpecSummary
from kvcli.metrics.stats import KVLayoutStats, RequestExtent

if TYPE_CHECKING:
    from kvcli.engine.llm_engine import LLMEngine
    from kvcli.step import SchedulerOutput


@dataclass(frozen=True)
class StepRecord:
    step: int
    time_s: float
    num_running: int
    num_waiting: int
    num_swapped: int
    num_preemptions: int  # so far
    num_tokens: int  # tokens computed this step
    generated_tokens: int  # so far
    kv: KVBreakdown
    spec_tokens: int = 0  # guessed tokens verified this step (their KV slots were held for the step)


def breakdown_bytes(s: KVLayoutStats, bytes_per_slot: int) -> KVBreakdown:
    return KVBreakdown(s.token_slots * bytes_per_slot, s.reserved_slots * bytes_per_slot,
                       s.internal_slots * bytes_per_slot, s.external_slots * bytes_per_slot,
                       s.free_slots * bytes_per_slot)


def contiguous_whatif(running: Sequence[RequestExtent], num_blocks: int, block_size: int, max_model_len: int,
                      bytes_per_slot: int) -> tuple[KVBreakdown, int]:
    """The given live requests under max-length contiguous preallocation in a pool of the same size,
    and how many max-length regions that pool holds at once."""
    region = blocks_for(max_model_len, block_size) * block_size
    tokens = reserved = internal = 0
    for r in running:
        res, inter = reservation_split(region, r.num_tokens, r.final_tokens)
        tokens += r.num_tokens
        reserved += res
        internal += inter
    pool = num_blocks * block_size
    used = tokens + reserved + internal
    return KVBreakdown(tokens * bytes_per_slot, reserved * bytes_per_slot, internal * bytes_per_slot, 0,
                       max(0, pool - used) * bytes_per_slot), pool // region


class MetricsCollector:
    def __init__(self, engine: "LLMEngine") -> None:
        self.engine = engine
        self.start = time.perf_counter()
        self.records: list[StepRecord] = []
        self.peak_running = 0
        self.peak_blocks_used = 0
        self.peak_shared_blocks = 0
        self.last_step_guesses = 0

    @property
    def bytes_per_slot(self) -> int:
        return self.engine.bytes_per_block // self.engine.options.block_size

    def record(self, out: "SchedulerOutput") -> None:
        """One StepRecord per engine step (cheap: no block walk unless blocks are shared)."""
        e = self.engine
        run = e.stats()
        s = e.scheduler.stats()
        kv = e.kv.stats(s.running, s.next_waiting)
        self.peak_running = max(self.peak_running, s.num_running)
        self.peak_blocks_used = max(self.peak_blocks_used, kv.used_blocks)
        self.peak_shared_blocks = max(self.peak_shared_blocks, kv.shared_saved_blocks)
        self.last_step_guesses = sum(len(c.spec_token_ids) for c in out.chunks)
        self.records.append(StepRecord(
            step=run.step, time_s=time.perf_counter() - self.start, num_running=s.num_running,
            num_waiting=s.num_waiting, num_swapped=s.num_swapped, num_preemptions=s.num_preemptions,
            num_tokens=out.num_tokens, generated_tokens=run.generated_tokens,
            kv=breakdown_bytes(kv, self.bytes_per_slot), spec_tokens=self.last_step_guesses))

    def tokens_per_s(self, window: int = 8, points: int = 40) -> tuple[float, ...]:
        """Output-token throughput over sliding windows of steps, oldest first."""
        recs = self.records
        out = []
        for i in range(max(window, len(recs) - points), len(recs) + 1):
            a, b = recs[i - window] if i - window >= 0 else None, recs[i - 1] if i >= 1 else None
            if a is None or b is None or b.time_s <= a.time_s:
                continue
            out.append((b.generated_tokens - a.generated_tokens) / (b.time_s - a.time_s))
        return tuple(out)

    def snapshot(self, memory: MemorySnapshot | None = None, *, block_map: bool = False) -> Snapshot:
        e = self.engine
        run = e.stats()
        s = e.scheduler.stats()
        kv = e.kv.stats(s.running, s.next_waiting)
        per_slot = self.bytes_per_slot
        whatif, fits = (None, None)
        if kv.layout == "paged":
            whatif, fits = contiguous_whatif(s.running, kv.num_blocks, kv.block_size, e.max_model_len, per_slot)
        timings = []
        for r in e.requests.values():
            if r.first_token_time is None:
                continue
            t = r.token_times
            timings.append(RequestTiming(r.req_id, r.num_prompt_tokens, len(r.output_token_ids),
                                         r.first_token_time - r.arrival_time,
                                         tuple(b - a for a, b in zip(t, t[1:]))))
        return Snapshot(
            step=run.step, time_s=time.perf_counter() - self.start, layout=kv.layout,
            num_running=s.num_running, num_waiting=s.num_waiting, num_preempted=s.num_preemptions,
            kv=breakdown_bytes(kv, per_slot), contiguous_whatif=whatif, whatif_fits=fits,
            blocks=e.kv.block_map(s.running) if block_map else None, memory=memory,
            tokens_per_s=self.tokens_per_s(), prompt_tokens=run.prompt_tokens,
            generated_tokens=run.generated_tokens, prefix_hit_tokens=kv.prefix_hit_tokens,
            prefix_query_tokens=kv.prefix_query_tokens, requests=tuple(timings), num_swapped=s.num_swapped,
            num_blocks=kv.num_blocks, block_size=kv.block_size, blocks_used=kv.used_blocks,
            peak_blocks_used=max(self.peak_blocks_used, kv.used_blocks),
            peak_shared_blocks=max(self.peak_shared_blocks, kv.shared_saved_blocks),
            bytes_per_block=e.bytes_per_block, kv_pool_bytes=e.kv_pool_bytes,
            kv_dtype=str(e.kv_dtype).removeprefix("torch."), max_model_len=e.max_model_len,
            weight_bytes=e.weight_bytes(), prefill_seconds=run.prefill_seconds,
            decode_seconds=run.decode_seconds, decode_tokens=run.decode_tokens, spec=self.spec_summary())

    def spec_summary(self) -> SpecSummary:
        e = self.engine
        sp = e.scheduler.spec_stats()
        if not sp.enabled:
            return SpecSummary(request_steps=sp.request_steps, request_step_tokens=sp.request_step_tokens)
        return SpecSummary(
            method=e.options.speculate, k=e.options.num_speculative_tokens, proposed=sp.proposed,
            accepted=sp.accepted, verifications=sp.verifications, request_steps=sp.request_steps,
            request_step_tokens=sp.request_step_tokens, paused=sp.paused, last_step_guesses=self.last_step_guesses)
