"""Combines the statistics of the engine's parts into records the views read. The collector owns
nothing but its history: the scheduler, the KV layout and the engine each produce their own
statistics (metrics/stats.py) and hand them in per call, with the engine's fixed facts (EngineFacts)
given once; this file turns slots into bytes, keeps one small StepRecord per step (the profile
timeline) and builds a full Snapshot when asked. It holds no live object.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvcli.metrics.snapshot import BlockMap, KVBreakdown, MemorySnapshot, RequestTiming, Snapshot, SpecSummary
from kvcli.metrics.stats import EngineFacts, KVLayoutStats, RunStats, SchedulerStats, SpecStats


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


class MetricsCollector:
    def __init__(self, facts: EngineFacts) -> None:
        self.facts = facts
        self.bytes_per_slot = facts.bytes_per_block // facts.block_size
        self.start = time.perf_counter()
        self.records: list[StepRecord] = []
        self.peak_running = 0
        self.peak_blocks_used = 0
        self.peak_shared_blocks = 0
        self.last_step_guesses = 0

    def record(self, run: RunStats, s: SchedulerStats, kv: KVLayoutStats, num_tokens: int, spec_tokens: int) -> None:
        """One StepRecord per engine step: num_tokens computed in it, spec_tokens of them guesses."""
        self.peak_running = max(self.peak_running, s.num_running)
        self.peak_blocks_used = max(self.peak_blocks_used, kv.used_blocks)
        self.peak_shared_blocks = max(self.peak_shared_blocks, kv.shared_saved_blocks)
        self.last_step_guesses = spec_tokens
        self.records.append(StepRecord(
            step=run.step, time_s=time.perf_counter() - self.start, num_running=s.num_running,
            num_waiting=s.num_waiting, num_swapped=s.num_swapped, num_preemptions=s.num_preemptions,
            num_tokens=num_tokens, generated_tokens=run.generated_tokens,
            kv=breakdown_bytes(kv, self.bytes_per_slot), spec_tokens=spec_tokens))

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

    def snapshot(self, run: RunStats, s: SchedulerStats, kv: KVLayoutStats, spec: SpecStats,
                 requests: tuple[RequestTiming, ...], *, whatif: tuple[KVBreakdown, int] | None = None,
                 blocks: BlockMap | None = None, memory: MemorySnapshot | None = None) -> Snapshot:
        """whatif: the live requests under max-length contiguous preallocation (paged layout only), and
        how many max-length regions the pool holds."""
        f = self.facts
        per_slot = self.bytes_per_slot
        contiguous, fits = whatif if whatif is not None else (None, None)
        return Snapshot(
            step=run.step, time_s=time.perf_counter() - self.start, layout=kv.layout,
            num_running=s.num_running, num_waiting=s.num_waiting, num_preempted=s.num_preemptions,
            kv=breakdown_bytes(kv, per_slot), contiguous_whatif=contiguous, whatif_fits=fits,
            blocks=blocks, memory=memory,
            tokens_per_s=self.tokens_per_s(), prompt_tokens=run.prompt_tokens,
            generated_tokens=run.generated_tokens, prefix_hit_tokens=kv.prefix_hit_tokens,
            prefix_query_tokens=kv.prefix_query_tokens, requests=requests, num_swapped=s.num_swapped,
            num_blocks=kv.num_blocks, block_size=kv.block_size, blocks_used=kv.used_blocks,
            peak_blocks_used=max(self.peak_blocks_used, kv.used_blocks),
            peak_shared_blocks=max(self.peak_shared_blocks, kv.shared_saved_blocks),
            bytes_per_block=f.bytes_per_block, kv_pool_bytes=f.kv_pool_bytes,
            kv_dtype=f.kv_dtype, max_model_len=f.max_model_len,
            weight_bytes=dict(f.weight_bytes), prefill_seconds=run.prefill_seconds,
            decode_seconds=run.decode_seconds, decode_tokens=run.decode_tokens, spec=self.spec_summary(spec),
            token_kv_bytes=f.token_bytes, cpu_threads=run.cpu_threads, threads_auto=run.threads_auto,
            thread_switches=run.thread_switches)

    def spec_summary(self, sp: SpecStats) -> SpecSummary:
        if not sp.enabled:
            return SpecSummary(request_steps=sp.request_steps, request_step_tokens=sp.request_step_tokens)
        f = self.facts
        return SpecSummary(
            method=f.speculate, k=f.num_speculative_tokens, adaptive=f.draft_length == "adaptive", proposed=sp.proposed,
            accepted=sp.accepted, verifications=sp.verifications, request_steps=sp.request_steps,
            request_step_tokens=sp.request_step_tokens, paused=sp.paused, last_step_guesses=self.last_step_guesses)
