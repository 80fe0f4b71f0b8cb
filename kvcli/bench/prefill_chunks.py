"""Prefill speed by chunk size (--max-batch-tokens), the measurement behind its default of 512 (issue #30, item 3).

A prompt is prefilled in chunks of at most --max-batch-tokens tokens a step, and the same budget caps every step of
a running batch: a decode step that shares the batch with a prefill chunk waits for the whole chunk. Bigger chunks
amortize more per step (the weight read-back or panel packing of the many-row matmuls, one pass over the weights
per chunk), smaller ones keep the running requests' steps short. For each size: the prefill rate of one prompt from
an empty cache (the random-weight 1B shape, Q4_0, and the bundled model), and the time one chunk step takes at that
rate, which is what a concurrent request's next token waits for. One engine per size, rounds interleaved, best of
--rounds.
"""

from __future__ import annotations

import argparse

from kvcli.bench.harness import busy_note, interleaved, load1, sample_text

SIZES = (256, 512, 1024, 2048)
DEFAULT = 512


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcli.bench prefill-chunks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens-1b", type=int, default=2048, help="prompt length on the 1B shape")
    ap.add_argument("--tokens-bundled", type=int, default=4096, help="prompt length on the bundled model")
    a = ap.parse_args(argv)

    from kvcli.bench.engines import KvcliEngine
    from kvcli.bench.shapes import shape_file

    load_before = load1()
    text = sample_text("heldout-gpl-3.0.txt")
    models = (("1B shape Q4_0", str(shape_file("1b", "Q4_0")), a.tokens_1b),
              ("bundled SmolLM2-135M Q4_1", None, a.tokens_bundled))
    rows = []
    for label, path, n in models:
        engines = {c: KvcliEngine(model=path, max_model_len=n + 64, max_num_batched_tokens=c, kv_budget="1GiB")
                   for c in SIZES}
        ids = engines[DEFAULT].encode(text * (1 + n * 5 // len(text)))[:n]
        if len(ids) < n:
            raise SystemExit(f"the sample text gives {len(ids)} tokens, fewer than {n}")
        for eng in engines.values():  # warm-up: kernels built, buffers sized
            eng.timed(ids[:256], 2)
        samples = interleaved(list(SIZES), a.rounds, lambda c, _r: engines[c].timed(ids, 2)[0]).samples
        best = {c: min(samples[c]) for c in SIZES}
        linear = engines[DEFAULT].linear_mode
        for c in SIZES:
            rows.append((label, linear, n, c, n / best[c], best[DEFAULT] / best[c], c * best[c] / n))
        del engines
    print(busy_note(load_before, load1()))
    print(f"prefill of one prompt from an empty cache, best of {a.rounds} interleaved rounds; one chunk step = "
          "chunk / prefill rate\n")
    print(f"| model | linears | prompt tokens | chunk (--max-batch-tokens) | prefill tok/s | vs {DEFAULT} | "
          "one chunk step s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for label, linear, n, c, rate, ratio, step in rows:
        mark = " (default)" if c == DEFAULT else ""
        print(f"| {label} | {linear} | {n:,} | {c:,}{mark} | {rate:.1f} | {ratio:.3f}x | {step:.2f} |")
    print()
    for label in dict.fromkeys(r[0] for r in rows):
        mine = [r for r in rows if r[0] == label]
        top = max(mine, key=lambda r: r[4])
        base = next(r for r in mine if r[3] == DEFAULT)
        print(f"{label}: the fastest chunk, {top[3]:,}, prefills {top[5]:.3f}x the default's rate and makes a chunk "
              f"step {top[6] / base[6]:.1f}x as long ({top[6]:.2f} s against {base[6]:.2f} s)")
    return 0
