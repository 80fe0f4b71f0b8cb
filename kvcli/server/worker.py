"""The one thread that owns the engine.

The engine is synchronous and step-based, and nothing in it is thread-safe, so exactly one thread
touches it: this worker. HTTP handlers (asyncio) hand it commands through a thread-safe queue (add a
request, abort one) and get tokens back through a per-request asyncio queue, filled with
`loop.call_soon_threadsafe`. The worker also publishes an immutable `Snapshot` for /metrics a few
times a second, and drops finished requests from the engine so a long-running server does not grow.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from kvcli.config import SamplingParams
from kvcli.engine.llm_engine import LLMEngine
from kvcli.engine.outputs import RequestOutput
from kvcli.engine.scheduler import KVBudgetTooSmall
from kvcli.metrics.snapshot import Snapshot
from kvcli.metrics.window import with_window
from kvcli.options import ConfigError
from kvcli.server.metrics import ServerMetrics

log = logging.getLogger("kvcli.serve")

SNAPSHOT_EVERY_S = 0.1  # /metrics is at most this stale while the engine runs (exact when idle)
KEEP_STEP_RECORDS = 256  # the collector's per-step history, trimmed: a server runs for days


@dataclass(frozen=True)
class Accepted:
    """The engine took the request (it passed the scheduler's KV checks)."""


@dataclass(frozen=True)
class Rejected:
    message: str
    status: int = 400


@dataclass
class RequestStream:
    """The asyncio side of one request: events arrive on `queue` in order."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied (set before its first output is sent)

    def push(self, item: Accepted | Rejected | RequestOutput) -> None:
        deliver([(self, item)])


def _put_all(batch: list[tuple[RequestStream, object]]) -> None:
    for stream, item in batch:
        stream.queue.put_nowait(item)


def deliver(batch: list[tuple[RequestStream, object]]) -> None:
    """Hand events to their event loops with one wake-up per loop, not one per token: each wake-up
    costs the engine thread a syscall and the event loop a turn holding the GIL."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, object]]] = {}
    for stream, item in batch:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the event loop is closed (shutdown): nobody is listening
            pass


@dataclass(frozen=True)
class _Add:
    req_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    stream: RequestStream


@dataclass(frozen=True)
class _Abort:
    req_id: str


@dataclass
class _Live:
    stream: RequestStream
    arrival: float
    tokens_seen: int = 0


class EngineWorker:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self._cmds: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._stop = threading.Event()
        self._latest: Snapshot | None = None
        self._last_snap = 0.0
        self.error: str | None = None  # set if the engine loop died (a bug): /health turns 503
        self._thread = threading.Thread(target=self._run, name="kvcli-engine", daemon=True)

    # --- called from any thread --------------------------------------------------------------------
    def start(self) -> None:
        self._publish()
        self._thread.start()

    def request_stop(self) -> None:
        """Ask the engine thread to stop after its current step; open requests get a 503 event."""
        self._stop.set()
        self._cmds.put(None)

    def stop(self, timeout: float = 30.0) -> None:
        self.request_stop()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def latest(self) -> Snapshot | None:
        return self._latest  # one attribute read: the snapshot itself is immutable

    def submit(self, req_id: str, prompt_ids: list[int], params: SamplingParams, stream: RequestStream,
               arrival: float | None = None) -> None:
        if not self.alive:
            stream.push(Rejected(f"engine is not running ({self.error or 'shut down'})", 503))
            return
        self._cmds.put(_Add(req_id, prompt_ids, params, time.perf_counter() if arrival is None else arrival,
                            stream))

    def abort(self, req_id: str) -> None:
        self._cmds.put(_Abort(req_id))

    # --- the engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        e = self.engine
        try:
            while not self._stop.is_set():
                self._drain(block=not e.has_unfinished())
                if self._stop.is_set():
                    break
                if e.has_unfinished():
                    outputs = e.step()
                    if len(e.metrics.records) > 2 * KEEP_STEP_RECORDS:
                        del e.metrics.records[:-KEEP_STEP_RECORDS]
                    if not e.has_unfinished():
                        # Idle now: publish before the last tokens go out, so a client that has its
                        # final token and then reads /metrics sees every block free (not a snapshot
                        # from a step or two earlier). Blocks were freed in the step; nothing in
                        # _dispatch changes what the snapshot holds.
                        self._publish()
                    self._dispatch(outputs)
                    if time.perf_counter() - self._last_snap >= SNAPSHOT_EVERY_S:
                        self._publish()
        except Exception as exc:  # a bug: keep the server answering, say what happened
            log.exception("engine loop failed")
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            reason = self.error or "server shutting down"
            for live in self._live.values():
                live.stream.push(Rejected(f"request ended: {reason}", 503))
            self._live.clear()

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._cmds.get(timeout=0.5) if block else self._cmds.get_nowait()
        except queue.Empty:
            return
        changed = False
        while cmd is not None:
            changed |= self._apply(cmd)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
        if changed and not self.engine.has_unfinished():
            self._publish()  # e.g. an abort that emptied the engine: /metrics shows the blocks freed now

    def _apply(self, cmd: _Add | _Abort) -> bool:
        e = self.engine
        if isinstance(cmd, _Abort):
            # The request and its samples (n > 1: `{id}.1`, ...); the engine's abort of the first also
            # ends the samples not forked from it yet.
            prefix = cmd.req_id + "."
            for rid in [cmd.req_id, *(k for k in self._live if k.startswith(prefix))]:
                live = self._live.pop(rid, None)
                req = e.requests.get(rid)
                if req is not None and not req.finished:
                    e.abort(rid)
                    if self.metrics is not None and live is not None:
                        self.metrics.finished("abort", time.perf_counter() - live.arrival, req.num_prompt_tokens,
                                              len(req.output_token_ids))
                e.release(rid)
            return True
        try:
            e.add_request(cmd.prompt_ids, cmd.params, req_id=cmd.req_id, arrival_time=cmd.arrival)
        except (ConfigError, KVBudgetTooSmall, ValueError) as exc:
            cmd.stream.push(Rejected(str(exc)))
            return False
        for i in range(cmd.params.n):  # the engine names further samples `{id}.{i}`
            self._live[cmd.req_id if i == 0 else f"{cmd.req_id}.{i}"] = _Live(cmd.stream, cmd.arrival)
        cmd.stream.push(Accepted())
        return True

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        e = self.engine
        m = self.metrics
        batch: list[tuple[RequestStream, object]] = []
        for out in outputs:
            live = self._live.get(out.req_id)
            req = e.requests.get(out.req_id)
            if live is None or req is None:
                continue
            if m is not None:
                # token_times[i] is when token i came out; the first one measures TTFT from arrival.
                times = req.token_times
                for i in range(live.tokens_seen, len(times)):
                    if i == 0:
                        m.ttft.observe(times[0] - live.arrival)
                    else:
                        m.itl.observe(times[i] - times[i - 1])
                live.tokens_seen = len(times)
            if getattr(req, "parent_id", None) is None:  # (a sample forked from it holds the whole prompt)
                live.stream.cached_tokens = getattr(req, "num_cached_tokens", None) or 0
            batch.append((live.stream, out))
            if out.finished:
                if m is not None:
                    m.finished(out.finish_reason, time.perf_counter() - live.arrival, req.num_prompt_tokens,
                               len(req.output_token_ids))
                del self._live[out.req_id]
                e.release(out.req_id)
        # The scheduler ends a request that the pool cannot hold even alone ("kv_budget") without a
        # token to report: close its stream here.
        for rid in [rid for rid, live in self._live.items() if e.requests[rid].finished]:
            live = self._live.pop(rid)
            req = e.requests[rid]
            batch.append((live.stream, RequestOutput(rid, (), "", True, req.finish_reason)))
            if m is not None:
                m.finished(req.finish_reason, time.perf_counter() - live.arrival, req.num_prompt_tokens,
                           len(req.output_token_ids))
            e.release(rid)
        deliver(batch)

    def _publish(self) -> None:
        self._latest = with_window(self.engine.snapshot(), self.engine)  # + a bounded cache's drops (--kv-window)
        self._last_snap = time.perf_counter()
