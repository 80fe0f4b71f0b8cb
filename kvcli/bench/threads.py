"""--threads auto against fixed thread counts, on an idle machine and with one core kept busy by another process
(kvcli/runner/threads.py).

The bundled model at batch 1: a --prompt-tokens prompt, then --new-tokens greedy tokens; decode tok/s =
(N - 1) / (t_N - t_1), so the prompt is left out. Each measurement builds a fresh engine over the same loaded
weights (as a new `kvcli continue` starts: auto's first pair of timed steps after 0.2 s of decode). "busy": a
second Python process spinning on `while True: pass`, started before the measurement and killed after it, free to
run on any core (the scheduler places it). Settings and conditions interleave within each round; medians of
--rounds rounds.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

from kvcli.bench.harness import busy_note, load1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcli.bench threads", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=192)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    from kvcli.config import SamplingParams
    from kvcli.engine.llm_engine import LLMEngine
    from kvcli.llm import LLM
    from kvcli.model.loader import load_weights
    from kvcli.options import EngineOptions

    full = torch.get_num_threads()
    if full < 2:
        print(f"torch uses {full} thread here: nothing to choose between")
        return 1
    loaded = load_weights(None)
    base = LLMEngine(loaded, EngineOptions(kv_budget="256MiB", threads=full))
    settings = {"auto": "auto", f"fixed {full}": full, "fixed 1": 1}
    load_before = load1()
    samples: dict[tuple[str, str], list[float]] = {}
    threads_at_end: dict[tuple[str, str], list[int]] = {}
    for rnd in range(a.rounds):
        ids = list(range(1000 + rnd, 1000 + rnd + a.prompt_tokens))
        for condition in ("idle", "busy"):
            for label, threads in settings.items():
                torch.set_num_threads(full)
                llm = LLM.from_engine(LLMEngine(loaded, EngineOptions(kv_budget="256MiB", threads=threads),
                                                model=base.model))
                hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if condition == "busy" else None
                try:
                    time.sleep(0.2 if hog else 0.0)
                    t = time.perf_counter()
                    llm.generate([ids], SamplingParams(max_tokens=1, ignore_eos=True))
                    t1 = time.perf_counter() - t
                    t = time.perf_counter()
                    llm.generate([ids], SamplingParams(max_tokens=a.new_tokens, ignore_eos=True))
                    tn = time.perf_counter() - t
                finally:
                    if hog:
                        hog.kill()
                        hog.wait()
                samples.setdefault((condition, label), []).append((a.new_tokens - 1) / (tn - t1))
                threads_at_end.setdefault((condition, label), []).append(llm.engine.threads.current)
    torch.set_num_threads(full)
    print(busy_note(load_before, load1()) + " (the busy runs add one spinning process on purpose)")
    print(f"bundled model, batch 1, {a.prompt_tokens}-token prompt, {a.new_tokens} new tokens, torch's {full} threads "
          f"at most; median of {a.rounds} rounds\n")
    print("| machine | --threads | decode tok/s | vs fixed " + str(full) + " | threads at the end, per round |")
    print("|---|---|---:|---:|---|")
    for condition in ("idle", "busy"):
        ref = statistics.median(samples[(condition, f"fixed {full}")])
        for label in settings:
            v = statistics.median(samples[(condition, label)])
            ends = ", ".join(map(str, threads_at_end[(condition, label)]))
            place = "idle" if condition == "idle" else "one core busy (another process)"
            print(f"| {place} | {label} | {v:.1f} | {v / ref:.2f}x | {ends} |")
    return 0
