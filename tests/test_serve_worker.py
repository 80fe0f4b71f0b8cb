"""EngineWorker's ordering with a stand-in engine (no model): what a client may read from /metrics
once it holds its last token."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from kvcli.config import SamplingParams
from kvcli.engine.outputs import RequestOutput
from kvcli.server.worker import Accepted, EngineWorker, RequestStream


@dataclass
class _Req:
    num_prompt_tokens: int
    max_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None


class _Metrics:
    records: list = []


class StandInEngine:
    """Steps one token per request per step, each step longer than the worker's snapshot period (so
    snapshots are published while the request runs); `snapshot()` says how many requests still hold
    blocks and is slow, as a real one can be on a loaded machine (what makes a stale read likely)."""

    def __init__(self, step_s: float = 0.15, snapshot_s: float = 0.2) -> None:
        self.step_s = step_s
        self.requests: dict[str, _Req] = {}
        self.metrics = _Metrics()
        self.snapshot_s = snapshot_s

    def has_unfinished(self) -> bool:
        return any(not r.finished for r in self.requests.values())

    def add_request(self, prompt_ids, params: SamplingParams, req_id: str, arrival_time: float) -> None:
        self.requests[req_id] = _Req(len(prompt_ids), params.max_tokens)

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_s)
        out = []
        for rid, r in self.requests.items():
            if r.finished:
                continue
            r.output_token_ids.append(7)
            r.token_times.append(time.perf_counter())
            if len(r.output_token_ids) == r.max_tokens:
                r.finished, r.finish_reason = True, "length"  # its blocks are free from here on
            out.append(RequestOutput(rid, (7,), "x", r.finished, r.finish_reason))
        return out

    def snapshot(self):
        held = sum(not r.finished for r in self.requests.values())
        time.sleep(self.snapshot_s)
        return held

    def release(self, req_id: str) -> None:
        if self.requests[req_id].finished:
            del self.requests[req_id]

    def abort(self, req_id: str) -> None:  # pragma: no cover - not used here
        self.requests[req_id].finished = True


def test_last_token_arrives_after_the_idle_snapshot():
    from kvcli.server.worker import SNAPSHOT_EVERY_S

    engine = StandInEngine()
    assert engine.step_s > SNAPSHOT_EVERY_S
    worker = EngineWorker(engine)  # type: ignore[arg-type]
    worker.start()

    async def client() -> tuple[int, object]:
        stream = RequestStream(asyncio.get_running_loop())
        worker.submit("r1", [1, 2, 3], SamplingParams(max_tokens=3), stream)
        assert isinstance(await stream.queue.get(), Accepted)
        n = 0
        while True:
            out = await stream.queue.get()
            n += 1
            if out.finished:
                return n, worker.latest()  # what /metrics would answer right now

    try:
        n, seen = asyncio.run(asyncio.wait_for(client(), 30))
    finally:
        worker.stop()
    assert n == 3
    assert seen == 0, f"/metrics read after the last token showed {seen} request(s) still holding blocks"
