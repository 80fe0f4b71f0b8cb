"""Samples of a server's /metrics over time, and what follows from consecutive ones: throughput from
the token counters, hit rates, latency quantiles over the watched period. JSON for --record, a figure
for --plot."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path

from kvcli.remote.scrape import Histogram, ServerSample

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

    def plot(self, path: str) -> None:
        """KV usage (and the kvcli breakdown when present), requests, and throughput over time."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = self.series
        t = [r["t"] for r in rows]
        fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
        ax = axes[0]
        if rows and "kv_token_bytes" in rows[-1]:
            cats = [("kv_token_bytes", "token states", "#2e7d32"), ("kv_reserved_bytes", "reserved", "#f9a825"),
                    ("kv_internal_bytes", "internal frag.", "#c62828"), ("kv_external_bytes", "external frag.", "#6a1b9a")]
            ax.stackplot(t, *[[r.get(k, 0) / 2**20 for r in rows] for k, _, _ in cats],
                         labels=[lab for _, lab, _ in cats], colors=[c for _, _, c in cats])
            ax.set_ylabel("KV MiB")
        else:
            ax.plot(t, [100 * (r["kv_usage"] or 0) for r in rows], color="#2e7d32", label="KV cache usage")
            ax.set_ylabel("KV usage %")
        ax.legend(loc="upper right", fontsize=8)
        ax.set_title(f"{self.url}")
        axes[1].plot(t, [r["running"] or 0 for r in rows], label="running")
        axes[1].plot(t, [r["waiting"] or 0 for r in rows], label="waiting")
        axes[1].set_ylabel("requests")
        axes[1].legend(loc="upper right", fontsize=8)
        axes[2].plot(t, [r["tok_s"] or 0 for r in rows], color="#1565c0")
        axes[2].set_ylabel("generated tok/s")
        axes[2].set_xlabel("seconds")
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format=Path(path).suffix.lstrip(".").lower() or "png", dpi=110)
        plt.close(fig)
        Path(path).write_bytes(buf.getvalue())


def _rate(prev: ServerSample | None, s: ServerSample) -> float | None:
    if prev is None or prev.generation_tokens is None or s.generation_tokens is None or s.t <= prev.t:
        return None
    d = s.generation_tokens - prev.generation_tokens
    return d / (s.t - prev.t) if d >= 0 else None  # a restart resets the counter
