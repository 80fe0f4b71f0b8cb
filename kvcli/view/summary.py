"""The end-of-run summary, rendered from a metrics snapshot."""

from __future__ import annotations

from rich.table import Table

from kvcli.metrics.snapshot import Snapshot
from kvcli.view.plain_log import human_bytes


def summary_table(s: Snapshot, title: str = "kvcli summary") -> Table:
    t = Table(title=title, show_header=False, title_justify="left", box=None, padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    hits = f" computed, {s.prefix_hit_tokens:,} found in the prefix cache" if s.prefix_hit_tokens else ""
    t.add_row("prompt tokens", f"{s.prompt_tokens:,}{hits}")
    t.add_row("generated tokens", f"{s.generated_tokens:,}")
    t.add_row("prefill", f"{s.prefill_tok_s:,.1f} tok/s ({s.prefill_seconds:.2f} s)")
    t.add_row("decode", f"{s.decode_tok_s:,.1f} tok/s ({s.decode_seconds:.2f} s)")
    if s.cpu_threads:
        how = "" if not s.threads_auto else " (--threads auto" + (
            f"; changed {s.thread_switches} time{'s' if s.thread_switches > 1 else ''} as decode steps timed faster"
            if s.thread_switches else "") + ")"
        t.add_row("CPU threads", f"{s.cpu_threads}{how}")
    t.add_row("KV blocks used (peak)", f"{s.peak_blocks_used:,} of {s.num_blocks:,} x {s.block_size} tokens")
    t.add_row("KV bytes used (peak)", f"{human_bytes(s.peak_kv_bytes)} of a {human_bytes(s.kv_pool_bytes)} pool "
              f"({s.kv_dtype}, {s.kv_bytes_per_token:,} B/token)")
    parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in s.weight_bytes.items())
    t.add_row("weight bytes", f"{human_bytes(s.total_weight_bytes)} ({parts})")
    if s.peak_shared_blocks:
        t.add_row("KV saved by sharing (peak)", f"{s.peak_shared_blocks:,} blocks, "
                  f"{human_bytes(s.peak_shared_blocks * s.bytes_per_block)}")
    if s.window is not None:
        w = s.window
        t.add_row("bounded KV", f"{w.sink_slots:,} sink + {w.window:,} window tokens (S {w.sink_tokens}, "
                  f"W {w.window:,}); {w.dropped_tokens:,} tokens dropped, {w.recycled_blocks:,} blocks recycled; "
                  f"peak {w.peak_tokens:,} of <= {w.max_slots:,} tokens/request")
    if s.num_preempted:
        t.add_row("preemptions", str(s.num_preempted))
    sp = s.spec
    if sp.method != "none":
        t.add_row("speculation", f"{sp.method} {sp.limit}: {sp.accepted:,} of {sp.proposed:,} guesses accepted "
                  f"({sp.acceptance_rate:.1%}) in {sp.verifications:,} verifications ({sp.mean_draft:.1f} each)")
        t.add_row("tokens per step per request", f"{sp.tokens_per_request_step:.2f}")
    return t


def snapshot_dict(s: Snapshot) -> dict:
    return {
        "prompt_tokens": s.prompt_tokens,
        "generated_tokens": s.generated_tokens,
        "prefill_seconds": round(s.prefill_seconds, 4),
        "decode_seconds": round(s.decode_seconds, 4),
        "prefill_tok_s": round(s.prefill_tok_s, 2),
        "decode_tok_s": round(s.decode_tok_s, 2),
        "cpu_threads": s.cpu_threads,
        "thread_switches": s.thread_switches,
        "kv": {
            "block_size": s.block_size,
            "num_blocks": s.num_blocks,
            "peak_blocks_used": s.peak_blocks_used,
            "bytes_per_block": s.bytes_per_block,
            "peak_bytes_used": s.peak_kv_bytes,
            "pool_bytes": s.kv_pool_bytes,
            "dtype": s.kv_dtype,
            "bytes_per_token": s.kv_bytes_per_token,
            "peak_shared_blocks": s.peak_shared_blocks,
        },
        "weight_bytes": dict(s.weight_bytes, total=s.total_weight_bytes),
        "preemptions": s.num_preempted,
        "window": None if s.window is None else {
            "sink_tokens": s.window.sink_tokens, "sink_slots": s.window.sink_slots, "kv_window": s.window.window,
            "max_slots": s.window.max_slots, "dropped_tokens": s.window.dropped_tokens,
            "recycled_blocks": s.window.recycled_blocks, "kv_tokens_peak": s.window.peak_tokens,
        },
        "speculation": {
            "method": s.spec.method, "k": s.spec.k, "adaptive": s.spec.adaptive, "proposed": s.spec.proposed,
            "accepted": s.spec.accepted, "mean_draft": round(s.spec.mean_draft, 4),
            "acceptance_rate": round(s.spec.acceptance_rate, 4), "verifications": s.spec.verifications,
            "tokens_per_request_step": round(s.spec.tokens_per_request_step, 4),
        },
    }
