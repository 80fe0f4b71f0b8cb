"""KV cache formats side by side, in one run: perplexity on held-out text, its delta against the fp32
cache, bytes per token, tokens per GiB, decode speed at a long context, and greedy agreement with the
fp32 cache, for each --kv-dtype. Prints the CPU's ISA flags (the float formats' speed depends on them).

Method: one model load (the default weights for the device: INT4 on CPU), one engine per KV format
over the same weights. Perplexity: teacher-forced over the first --context tokens of the text (one
window, all but the first token scored) through the paged engine. Decode: a --context - --new-tokens
prompt, then --new-tokens greedy tokens; decode tok/s is the engine's own count of decode-only steps
(tokens / seconds; prefill excluded). Greedy agreement: tokens equal to the fp32 cache's before the
first difference, over --new-tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from kvcli.bench.harness import REPO

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")


def cpu_isa() -> tuple[str, list[str]]:
    """The CPU's name and which of ISA_FLAGS it has (kvcli.native.capabilities reads them), for the JSON."""
    from kvcli.native.capabilities import cpu_flags, cpu_name

    return cpu_name(), [f for f in ISA_FLAGS if f in cpu_flags()]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", type=Path, default=REPO / "samples" / "heldout-gpl-3.0.txt")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--kv-dtypes", default="fp32,fp16,bf16,int8,fp8")
    ap.add_argument("--dequantize", action="store_true", help="dense fp32 weights instead of the default")
    a = ap.parse_args(argv)

    from kvcli.config import SamplingParams
    from kvcli.engine.llm_engine import LLMEngine
    from kvcli.bench.internals import perplexity
    from kvcli.model.loader import load_weights
    from kvcli.options import EngineOptions

    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(f"# kvcli KV formats · commit {commit}")
    loaded = load_weights(None)
    ids = loaded.tokenizer.encode(a.text.read_text(encoding="utf-8"))
    if len(ids) < a.context:
        sys.exit(f"{a.text}: {len(ids)} tokens, fewer than --context {a.context}")
    print(f"# text {a.text.name}: {len(ids)} tokens; context {a.context}; {a.new_tokens} decode tokens")
    model = None
    rows = []
    ref_out: list[int] | None = None
    ref_ppl: float | None = None
    for name in a.kv_dtypes.split(","):
        opts = EngineOptions(kv_dtype=name, max_model_len=a.context, kv_budget="768MiB",
                             dequantize=a.dequantize, prefix_caching=False)
        engine = LLMEngine(loaded, opts, model=model)
        model = engine.model
        t0 = time.perf_counter()
        ppl = perplexity(engine, ids[:a.context], a.context, a.context)
        ppl_s = time.perf_counter() - t0
        before = engine.stats()
        req = engine.add_request(ids[:a.context - a.new_tokens],
                                 SamplingParams(max_tokens=a.new_tokens, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        st = engine.stats()
        decode = (st.decode_tokens - before.decode_tokens) / (st.decode_seconds - before.decode_seconds)
        out = list(req.output_token_ids)
        if ref_out is None:
            ref_out, ref_ppl = out, ppl.perplexity
        same = next((i for i, (x, y) in enumerate(zip(out, ref_out)) if x != y), len(out))
        per_tok = engine.config.kv_bytes_per_token(engine.kv_dtype)
        rows.append(dict(kv_dtype=name, perplexity=ppl.perplexity, mean_nll=ppl.mean_nll,
                         delta_vs_first=ppl.perplexity / ref_ppl - 1, tokens_scored=ppl.tokens_scored,
                         bytes_per_token=per_tok, tokens_per_gib=(1 << 30) // per_tok,
                         decode_tok_s=decode, greedy_agreement=same / len(out), perplexity_seconds=ppl_s,
                         weights=engine.linear_mode))
        print(f"# {name}: done ({ppl_s:.0f} s perplexity)", flush=True)
        del engine
    first = rows[0]["kv_dtype"]
    fp16 = next((r["bytes_per_token"] for r in rows if r["kv_dtype"] == "fp16"), None)
    print()
    print(f"| KV dtype | perplexity | delta vs {first} | bytes/token | vs fp16 | tokens/GiB | decode tok/s at "
          f"{a.context} | greedy agreement with {first} ({a.new_tokens} tokens) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        rel = f"{r['bytes_per_token'] / fp16:.3f}x" if fp16 else "-"
        print(f"| {r['kv_dtype']} | {r['perplexity']:.4f} | {r['delta_vs_first']:+.3%} | {r['bytes_per_token']:,} | "
              f"{rel} | {r['tokens_per_gib']:,} | {r['decode_tok_s']:.2f} | {r['greedy_agreement']:.2f} |")
    print()
    cpu, isa = cpu_isa()
    print(json.dumps({"context": a.context, "new_tokens": a.new_tokens, "text": a.text.name,
                      "tokens_scored": rows[0]["tokens_scored"], "cpu": cpu, "isa": isa, "rows": rows},
                     indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x))


def decode(argv: list[str] | None = None) -> None:
    """The kv-decode figure (the former scripts/bench_kv_decode.py): decode speed per KV format at a long
    context, interleaved so that a shared machine's changing load hits every format alike. One engine per
    --kv-dtypes entry over the same weights, each prefilled with the same --context-token prompt; then rounds
    in which every engine in turn runs --steps decode steps (batch 1). Prints the median and best per-round
    decode tok/s per format. Timed by this thread's CPU time with --threads torch threads (default 1, so every
    op runs on this thread): other jobs on a shared machine then slow the wall clock but not the figure."""
    from kvcli.bench.harness import cpu as cpu_time, interleaved, median

    ap = argparse.ArgumentParser(prog="python -m kvcli.bench kv-decode", description=decode.__doc__)
    ap.add_argument("--text", type=Path, default=REPO / "samples" / "heldout-gpl-3.0.txt")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--kv-dtypes", default="fp32,fp16,bf16,int8,fp8")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    from kvcli.config import SamplingParams
    from kvcli.engine.llm_engine import LLMEngine
    from kvcli.model.loader import load_weights
    from kvcli.options import EngineOptions

    print(f"# decode per KV dtype at {a.context} context · {a.rounds} rounds x {a.steps} steps, interleaved, "
          f"thread CPU time, {a.threads} torch thread(s)")
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

    def steps(name: str, _round: int) -> float:
        e = engines[name]
        return a.steps / cpu_time(lambda: [e.step() for _ in range(a.steps)])

    rounds = interleaved(list(engines), a.rounds, steps, progress=False)
    rates = rounds.samples
    # Per-round ratios cancel the load a round shared by every format; their median is the figure.
    base = "fp16" if "fp16" in rates else next(iter(rates))
    print(f"| KV dtype | decode tok/s (CPU time), median of rounds | best round | median per-round ratio vs {base} | per round |")
    print("|---|---:|---:|---:|---|")
    for name, r in rates.items():
        ratio = median(rounds.ratios(name, base))
        print(f"| {name} | {median(r):.2f} | {max(r):.2f} | {ratio:.2f}x | {' '.join(f'{x:.1f}' for x in r)} |")
