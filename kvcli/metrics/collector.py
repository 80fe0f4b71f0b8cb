"""Per-step metrics: the KV byte breakdown of the live layout, what max-length contiguous
preallocation would hold for the same live requests, and queue counts. One small StepRecord per
step (the profile timeline); a full Snapshot, block map included, when a view asks for one."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcli.kvcache.block_manager import blocks_for
from kvcli.metrics.snapshot import BlockMap, KVBreakdown, RequestTiming, Snapshot

if TYPE_CHECKING:
    from kvcli.engine.llm_engine import LLMEngine
    from kvcli.engine.request import Request
    from kvcli.engine.scheduler import SchedulerOutput


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


def final_length(req: "Request", max_model_len: int) -> int:
    """The most tokens the request can ever hold (exact when ignore_eos, as in traces)."""
    return min(req.num_prompt_tokens + req.params.max_tokens, max_model_len)


def reservation_split(region_slots: int, tokens: int, final: int) -> tuple[int, int]:
    """(reserved, internal) of a region: slots up to the final length will still be used, the rest
    never will."""
    usable = min(region_slots, final)
    return max(0, usable - tokens), region_slots - max(tokens, usable)


class MetricsCollector:
    def __init__(self, engine: "LLMEngine") -> None:
        self.engine = engine
        self.start = time.perf_counter()
        self.records: list[StepRecord] = []
        self.peak_running = 0

    # --- the breakdown ------------------------------------------------------------------------------
    def kv_breakdown(self) -> KVBreakdown:
        e = self.engine
        kv = e.kv
        bs = kv.block_size
        per_slot = e.bytes_per_block // bs
        running = e.scheduler.running
        if kv.layout == "paged":
            alloc_slots = (kv.num_blocks - kv.num_free_blocks) * bs
            tokens = self._paged_token_slots(running)
            return KVBreakdown(tokens * per_slot, 0, (alloc_slots - tokens) * per_slot, 0,
                               kv.num_free_blocks * bs * per_slot)
        tokens = reserved = internal = 0
        for r in running:
            region = kv.reserved_slots(r.req_id)
            res, inter = reservation_split(region, r.num_computed_tokens, final_length(r, e.max_model_len))
            tokens += r.num_computed_tokens
            reserved += res
            internal += inter
        external = 0
        if e.scheduler.waiting:
            need = min(blocks_for(e.scheduler.reserve_tokens(r), bs) for r in e.scheduler.waiting)
            external = sum(n for _, n in kv.holes if n < need) * bs
        free = kv.num_free_blocks * bs - external
        return KVBreakdown(tokens * per_slot, reserved * per_slot, internal * per_slot, external * per_slot,
                           free * per_slot)

    def _paged_token_slots(self, running: list["Request"]) -> int:
        kv = self.engine.kv
        bs = kv.block_size
        if kv.pool.extra_refs == 0:  # nothing shared: every request's tokens are its own
            return sum(r.num_computed_tokens for r in running)
        fill: dict[int, int] = {}  # shared blocks hold their tokens once
        for r in running:
            n = r.num_computed_tokens
            for i, b in enumerate(kv.block_table(r.req_id)):
                f = min(bs, max(0, n - i * bs))
                if f > fill.get(b, 0):
                    fill[b] = f
        return sum(fill.values())

    def contiguous_whatif(self) -> tuple[KVBreakdown, int]:
        """The live requests under max-length contiguous preallocation in the same pool."""
        e = self.engine
        bs = e.kv.block_size
        per_slot = e.bytes_per_block // bs
        region = blocks_for(e.max_model_len, bs) * bs
        tokens = reserved = internal = 0
        for r in e.scheduler.running:
            res, inter = reservation_split(region, r.num_computed_tokens, final_length(r, e.max_model_len))
            tokens += r.num_computed_tokens
            reserved += res
            internal += inter
        pool = e.num_blocks * bs
        used = tokens + reserved + internal
        fits = pool // region
        return KVBreakdown(tokens * per_slot, reserved * per_slot, internal * per_slot, 0,
                           max(0, pool - used) * per_slot), fits

    # --- per step --------------------------------------------------------------------------------------
    def record(self, out: "SchedulerOutput") -> None:
        e = self.engine
        s = e.scheduler
        self.peak_running = max(self.peak_running, len(s.running))
        self.records.append(StepRecord(
            step=e._step, time_s=time.perf_counter() - self.start, num_running=len(s.running),
            num_waiting=len(s.waiting), num_swapped=len(s.swapped), num_preemptions=s.num_preemptions,
            num_tokens=out.num_tokens, generated_tokens=e._generated, kv=self.kv_breakdown()))

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

    def block_map(self) -> BlockMap:
        e = self.engine
        kv = e.kv
        bs = kv.block_size
        owner = [-1] * kv.num_blocks
        fill = [0] * kv.num_blocks
        ref = [0] * kv.num_blocks
        owners: list[str] = []
        pool = getattr(kv, "pool", None)
        if pool is not None:
            for bid in pool.cached.values():
                if pool.blocks[bid].ref_cnt == 0:
                    owner[bid] = -2
                    fill[bid] = bs
        for r in e.scheduler.running:
            idx = len(owners)
            owners.append(r.req_id)
            for i, b in enumerate(kv.block_table(r.req_id)):
                if owner[b] == -1:
                    owner[b] = idx
                fill[b] = max(fill[b], min(bs, max(0, r.num_computed_tokens - i * bs)))
                ref[b] += 1
        return BlockMap(bs, tuple(owner), tuple(fill), tuple(ref), tuple(owners))

    def snapshot(self, memory) -> Snapshot:
        e = self.engine
        whatif, fits = self.contiguous_whatif() if e.kv.layout == "paged" else (None, None)
        timings = []
        for r in e.requests.values():
            if r.first_token_time is None:
                continue
            t = r.token_times
            timings.append(RequestTiming(r.req_id, r.num_prompt_tokens, len(r.output_token_ids),
                                         r.first_token_time - r.arrival_time,
                                         tuple(b - a for a, b in zip(t, t[1:]))))
        return Snapshot(
            step=e._step, time_s=time.perf_counter() - self.start, layout=e.kv.layout,
            num_running=len(e.scheduler.running), num_waiting=len(e.scheduler.waiting),
            num_preempted=e.scheduler.num_preemptions, kv=self.kv_breakdown(), contiguous_whatif=whatif,
            whatif_fits=fits, blocks=self.block_map(), memory=memory, tokens_per_s=self.tokens_per_s(),
            prompt_tokens=e._prompt_tokens, generated_tokens=e._generated,
            prefix_hit_tokens=getattr(e.kv, "prefix_hit_tokens", 0),
            prefix_query_tokens=getattr(e.kv, "prefix_query_tokens", 0), requests=tuple(timings))
