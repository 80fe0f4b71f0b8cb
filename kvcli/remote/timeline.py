"""Drawing a watched server's timeline (--plot); the Timeline itself is a metrics record
(kvcli/metrics/server.py)."""

from __future__ import annotations

from kvcli.metrics.server import Timeline
from kvcli.view.figure_file import save_figure

__all__ = ["Timeline", "plot_timeline"]


def plot_timeline(tl: Timeline, path: str) -> None:
    """KV usage (and the kvcli breakdown when present), requests, and throughput over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = tl.series
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
    ax.set_title(f"{tl.url}")
    axes[1].plot(t, [r["running"] or 0 for r in rows], label="running")
    axes[1].plot(t, [r["waiting"] or 0 for r in rows], label="waiting")
    axes[1].set_ylabel("requests")
    axes[1].legend(loc="upper right", fontsize=8)
    axes[2].plot(t, [r["tok_s"] or 0 for r in rows], color="#1565c0")
    axes[2].set_ylabel("generated tok/s")
    axes[2].set_xlabel("seconds")
    fig.tight_layout()
    save_figure(fig, path)
