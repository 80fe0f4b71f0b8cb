"""Records of a server watched through its /metrics (`kvcli watch`, `profile --endpoint`): one
normalised `ServerSample` per scrape, whatever served it, and a `Timeline` of them with what follows
from consecutive samples (throughput from the token counters, hit rates, latency quantiles over the
watched period). Views read these, as they read `Snapshot`; parsing lives in kvcli/remote/."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from kvcli.metrics.snapshot import KVBreakdown


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts by upper bound (the +Inf bucket included), as exposed."""

    buckets: tuple[tuple[float, float], ...]
    count: float
    sum: float

    def minus(self, earlier: "Histogram | None") -> "Histogram":
        """Observations since `earlier` (a server restart, where counts fall, gives self)."""
        if earlier is None or earlier.count > self.count or len(earlier.buckets) != len(self.buckets):
            return self
        return Histogram(tuple((le, c - c0) for (le, c), (_, c0) in zip(self.buckets, earlier.buckets)),
                         self.count - earlier.count, self.sum - earlier.sum)

    def quantile(self, q: float) -> float | None:
        """Prometheus' histogram_quantile: linear within the bucket holding the q-th observation."""
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        prev_le, prev_c = 0.0, 0.0
        for le, c in self.buckets:
            if c >= rank:
                if math.isinf(le):
                    return prev_le  # in the open bucket: its lower bound is all that is known
                if c == prev_c:
                    return le
                return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
            prev_le, prev_c = le, c
        return prev_le


@dataclass(frozen=True)
class KVDetail:
    """kvcli's own metrics: the live breakdown and the contiguous what-if (kvcli serve only)."""

    kv: KVBreakdown
    whatif: KVBreakdown | None
    whatif_fits: int | None
    pool_bytes: int
    bytes_per_token: int
    block_size: int
    max_model_len: int


@dataclass(frozen=True)
class ServerSample:
    t: float  # seconds since the watch began
    flavor: str  # vllm | kvcli | llama.cpp
    kv_usage: float | None  # fraction of the KV cache in use, 0..1
    blocks_total: int | None
    blocks_used: int | None
    running: float | None
    waiting: float | None
    preemptions: float | None  # counter
    prefix_queries: float | None  # counters, tokens
    prefix_hits: float | None
    prompt_tokens: float | None  # counters
    generation_tokens: float | None
    ttft: Histogram | None
    itl: Histogram | None
    detail: KVDetail | None = None
    cache_info: dict[str, str] = field(default_factory=dict)


KEEP = 4096  # samples kept in memory (about 17 minutes at 4 Hz); --record keeps the light series of all


@dataclass
class Timeline:
    url: str
    samples: list[ServerSample] = field(default_factory=list)
    first: ServerSample | None = None  # the baseline for "since the watch began"
    series: list[dict] = field(default_factory=list)  # one light row per sample, for --record/--plot
    errors: list[tuple[float, str]] = field(default_factory=list)

    def add(self, s: ServerSample) -> None:
        if self.first is None:
            self.first = s
        prev = self.samples[-1] if self.samples else None
        self.samples.append(s)
        if len(self.samples) > KEEP:
            del self.samples[: len(self.samples) - KEEP]
        self.series.append({"t": round(s.t, 3), "kv_usage": s.kv_usage, "blocks_used": s.blocks_used,
                            "blocks_total": s.blocks_total, "running": s.running, "waiting": s.waiting,
                            "preemptions": s.preemptions, "generation_tokens": s.generation_tokens,
                            "prompt_tokens": s.prompt_tokens, "tok_s": _rate(prev, s),
                            **({"kv_token_bytes": s.detail.kv.token_bytes,
                                "kv_internal_bytes": s.detail.kv.internal_bytes,
                                "kv_reserved_bytes": s.detail.kv.reserved_bytes,
                                "kv_external_bytes": s.detail.kv.external_bytes} if s.detail else {})})

    def error(self, t: float, message: str) -> None:
        self.errors.append((round(t, 3), message))

    @property
    def latest(self) -> ServerSample | None:
        return self.samples[-1] if self.samples else None

    def tok_s(self, points: int = 60) -> list[float]:
        """Generated tokens per second between consecutive samples, the last `points`."""
        rows = [r["tok_s"] for r in self.series[-points:] if r["tok_s"] is not None]
        return rows

    def usage(self, points: int = 60) -> list[float]:
        return [r["kv_usage"] for r in self.series[-points:] if r["kv_usage"] is not None]

    def since_start(self, attr: str) -> Histogram | None:
        """A latency histogram over the watched period (the whole server lifetime if nothing was observed
        since the watch began)."""
        last = self.latest
        if last is None or getattr(last, attr) is None:
            return None
        h: Histogram = getattr(last, attr)
        delta = h.minus(getattr(self.first, attr) if self.first else None)
        return delta if delta.count > 0 else h

    def prefix_hit_rate(self) -> tuple[float, float] | None:
        """(hits, queries) in tokens since the watch began, else over the server's lifetime."""
        last, first = self.latest, self.first
        if last is None or last.prefix_queries is None or last.prefix_hits is None:
            return None
        q, h = last.prefix_queries, last.prefix_hits
        if first is not None and first.prefix_queries is not None and q - first.prefix_queries > 0:
            return h - (first.prefix_hits or 0.0), q - first.prefix_queries
        return h, q

    def to_json(self) -> str:
        return json.dumps({"url": self.url, "flavor": self.latest.flavor if self.latest else None,
                           "samples": self.series, "errors": [{"t": t, "message": m} for t, m in self.errors]},
                          indent=1)


def _rate(prev: ServerSample | None, s: ServerSample) -> float | None:
    if prev is None or prev.generation_tokens is None or s.generation_tokens is None or s.t <= prev.t:
        return None
    d = s.generation_tokens - prev.generation_tokens
    return d / (s.t - prev.t) if d >= 0 else None  # a restart resets the counter
