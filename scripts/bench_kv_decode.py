"""Decode speed per KV format at a long context, interleaved so that a shared machine's changing
load hits every format alike: one engine per --kv-dtype over the same weights, each prefilled with
the same --context-token prompt; then rounds in which every engine in turn runs --steps decode steps
(batch 1). Prints the median and best per-round decode tok/s per format, and the CPU's ISA flags.
Timed by this thread's CPU time with --threads torch threads (default 1, so every op runs on this
thread): other jobs on a shared machine then slow the wall clock but not the figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--text", type=Path, default=REPO / "samples" / "heldout-gpl-3.0.txt")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--kv-dtypes", default="fp32,fp16,bf16,int8,fp8")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()

    import torch

    torch.set_num_threads(a.threads)

    from bench_kv_dtype import cpu_isa  # beside this file
    from kvcli.config import SamplingParams
    from kvcli.engine.llm_engine import LLMEngine
    from kvcli.model.loader import load_weights
    from kvcli.options import EngineOptions

    cpu, isa = cpu_isa()
    print(f"# decode per KV dtype at {a.context} context · {cpu} · {os.cpu_count()} cores · torch "
          f"{torch.__version__} · ISA: {' '.join(isa)} · {a.rounds} rounds x {a.steps} steps, interleaved, "
          f"thread CPU time, {a.threads} torch thread(s) · {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    from kvcli.bench.machine import machine_line

    print(f"# {machine_line()}")
    loaded = load_weights(None)
    ids = loaded.tokenizer.encode(a.text.read_text(encoding="utf-8"))[:a.context - a.steps * a.rounds - 8]
    engines, model = {}, None
    for name in a.kv_dtypes.split(","):
        e = LLMEngine(loaded, EngineOptions(kv_dtype=name, max_model_len=a.context, kv_budget="512MiB",
                                            prefix_caching=False), model=model)
        model = e.model
        e.add_request(ids, SamplingParams(max_tokens=a.steps * a.rounds + 4, ignore_eos=True))
        while e.stats().generated_tokens == 0:  # prefill (its last chunk samples the first token)
            e.step()
        e.step()  # one decode step of warm-up
        engines[name] = e
    rates: dict[str, list[float]] = {n: [] for n in engines}
    for _ in range(a.rounds):
        for name, e in engines.items():
            t = time.thread_time()
            for _ in range(a.steps):
                e.step()
            rates[name].append(a.steps / (time.thread_time() - t))
    # Per-round ratios cancel the load a round shared by every format; their median is the figure.
    base = "fp16" if "fp16" in rates else next(iter(rates))
    print(f"| KV dtype | decode tok/s (CPU time), median of rounds | best round | median per-round ratio vs {base} | per round |")
    print("|---|---:|---:|---:|---|")
    for name, r in rates.items():
        ratio = statistics.median(x / y for x, y in zip(r, rates[base]))
        print(f"| {name} | {statistics.median(r):.2f} | {max(r):.2f} | {ratio:.2f}x | {' '.join(f'{x:.1f}' for x in r)} |")


if __name__ == "__main__":
    main()
