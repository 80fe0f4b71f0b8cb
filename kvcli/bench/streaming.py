"""The bounded KV cache (issue #27, --kv-window / --sink-tokens): what it costs in quality and in speed.

`streaming` (quality, StreamingLLM's comparison on the bundled model): one text of at least --min-tokens
tokens (the two samples, repeated until long enough: a repeat lies ~12k tokens back, far beyond every
method's context of ~1k tokens, so none sees it), scored by `kvcli perplexity --json` four ways:
  recompute   --window 1024 --stride 512: windowed recomputation, every token with 512-1023 tokens of true context
  sinks+win   --kv-window 1020 --sink-tokens 4 --block-size 8: one stream, 4 sinks (one 8-token block) + a 1,020-token window
  sinks16     --kv-window 1020 --sink-tokens 4 (block 16: the sinks round up to one whole 16-token block)
  no sinks    --kv-window 1020 --sink-tokens 0: one stream, the window alone
Each row: perplexity, its distance from recompute, and the most KV tokens a step held (the layout's measured
peak) against the bound: the sinks' whole blocks + W + one block being filled.

`window-cost` (speed, the same engine in one process, rounds alternating between cases): with the context
--max-model-len C and the window W = C - 16 - 64 (what --kv-window auto picks for -n 64),
  decode 1x    a text of C tokens, then --new-tokens greedy tokens: decode tok/s
  decode 4x    a text of 4C tokens, same window: decode tok/s (flat in text length?) and prefill tok/s of the
               whole text through the window
  dense        a text of W tokens without a window: prefill tok/s of a dense prefill of the window's size
The ratios are medians of per-round ratios (each pair measured in the same round).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from kvcli.bench.harness import REPO, busy_note, load1, median

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CACHE = REPO / ".cache" / "streaming"
KVCLI = [sys.executable, "-c", "from kvcli.cli import main; main()"]


def long_text(min_tokens: int) -> tuple[Path, int]:
    """The samples, repeated until the bundled tokenizer counts at least min_tokens; (file, tokens)."""
    from kvcli.model.loader import load_tokenizer

    tok = load_tokenizer(None)
    parts = [(REPO / "samples" / n).read_text(encoding="utf-8") for n in ("keepers-log.txt", "heldout-gpl-3.0.txt")]
    text = ""
    while len(tok.encode(text)) < min_tokens:
        text += "\n\n".join(parts) + "\n\n"
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / f"text-{min_tokens}.txt"
    path.write_text(text, encoding="utf-8")
    return path, len(tok.encode(text))


QUALITY = [
    ("recompute", "--window 1024 --stride 512", ["--window", "1024", "--stride", "512"]),
    ("sinks+win", "--kv-window 1020 --sink-tokens 4 --block-size 8",
     ["--kv-window", "1020", "--sink-tokens", "4", "--block-size", "8"]),
    ("sinks16", "--kv-window 1020 --sink-tokens 4 (block 16)", ["--kv-window", "1020", "--sink-tokens", "4"]),
    ("no sinks", "--kv-window 1020 --sink-tokens 0", ["--kv-window", "1020", "--sink-tokens", "0"]),
]


def quality(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--min-tokens", type=int, default=20_000)
    ap.add_argument("--kv-dtype", default="fp16")
    a = ap.parse_args(argv)
    path, n = long_text(a.min_tokens)
    before = load1()
    rows = {}
    for name, _, flags in QUALITY:
        t = time.perf_counter()
        p = subprocess.run([*KVCLI, "perplexity", str(path), "--json", "--kv-dtype", a.kv_dtype, *flags],
                           capture_output=True, text=True)
        if p.returncode:
            print(f"{name}: kvcli perplexity failed: {p.stderr.strip().splitlines()[-1:]}")
            return 1
        rows[name] = json.loads(p.stdout) | {"seconds": time.perf_counter() - t}
        print(f"{name} done in {rows[name]['seconds']:.0f} s", file=sys.stderr, flush=True)
    ref = rows["recompute"]["perplexity"]
    print(f"text: {path.relative_to(REPO)} ({n:,} tokens: the two samples repeated), bundled model, KV {a.kv_dtype}")
    print(f"{'method':10} {'flags':48} {'perplexity':>10} {'vs recompute':>12} {'scored':>7} "
          f"{'KV peak':>8} {'bound':>9} {'time':>6}")
    for name, shown, _ in QUALITY:
        r = rows[name]
        if r.get("kv_window") is None:
            peak, bound = "-", "-"
        else:
            bs = 8 if "--block-size 8" in shown else 16
            sinks = -(-r['sink_tokens'] // bs) * bs  # the sinks are kept as whole blocks
            peak, bound = f"{r['kv_tokens_peak']:,}", f"{sinks + r['kv_window'] + bs:,}"
        print(f"{name:10} {shown:48} {r['perplexity']:10.4f} {100 * (r['perplexity'] / ref - 1):+11.2f}% "
              f"{r['tokens_scored']:7,} {peak:>8} {bound:>9} {r['seconds']:5.0f}s")
    print(busy_note(before, load1()))
    return 0


def cost(argv: list[str] | None = None) -> int:
    import torch

    from kvcli.config import SamplingParams
    from kvcli.engine.llm_engine import LLMEngine
    from kvcli.model.loader import load_weights
    from kvcli.options import EngineOptions

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)
    C = a.max_model_len
    W = C - 16 - a.new_tokens
    path, _ = long_text(4 * C + 200)
    loaded = load_weights(None)
    ids = loaded.tokenizer.encode(path.read_text(encoding="utf-8"))
    texts = {"decode 1x": ids[:C], "decode 4x": ids[:4 * C], "dense": ids[:W]}
    model = None

    def run(case: str) -> tuple[float, float, int]:
        nonlocal model
        opts = dict(max_model_len=C, kv_budget="256MiB", max_num_batched_tokens=256)
        if case != "dense":
            opts |= dict(kv_window=W, sink_tokens=4)
        e = LLMEngine(loaded, EngineOptions(**opts), model=model)
        model = e.model
        req = e.add_request(texts[case], SamplingParams(max_tokens=a.new_tokens, ignore_eos=True))
        while e.has_unfinished():
            e.step()
        prefill = len(texts[case]) / e.prefill_seconds
        decode = e.decode_tokens / e.decode_seconds if e.decode_seconds else 0.0
        return prefill, decode, e.scheduler.dropped_tokens(req)

    before = load1()
    run("decode 1x")  # warm-up
    samples: dict[str, list[tuple[float, float, int]]] = {c: [] for c in texts}
    for r in range(a.rounds):
        order = list(texts) if r % 2 == 0 else list(texts)[::-1]
        for case in order:
            samples[case].append(run(case))
        print(f"round {r + 1} of {a.rounds} done", file=sys.stderr, flush=True)
    print(f"bundled model, context {C:,}, window W = {W:,} + 4 sink tokens (one 16-token block), "
          f"{a.new_tokens} greedy tokens, {a.rounds} rounds alternating, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'case':10} {'prompt tokens':>13} {'dropped':>8} {'prefill tok/s':>14} {'decode tok/s':>13}  rounds")
    for case in texts:
        s = samples[case]
        print(f"{case:10} {len(texts[case]):13,} {s[-1][2]:8,} {median(x[0] for x in s):14.1f} "
              f"{median(x[1] for x in s):13.1f}  decode {', '.join(f'{x[1]:.1f}' for x in s)}")
    flat = median(x[1] / y[1] for x, y in zip(samples["decode 4x"], samples["decode 1x"]))
    pre = median(x[0] / y[0] for x, y in zip(samples["decode 4x"], samples["dense"]))
    print(f"decode at 4x the context / at 1x (same window): {flat:.3f}x (median of per-round ratios; goal within 10 %)")
    print(f"prefill of the 4x text through the window / dense prefill of {W:,} tokens: {pre:.3f}x (goal >= 0.9x)")
    print(busy_note(before, load1()))
    return 0


if __name__ == "__main__":
    raise SystemExit(quality())
