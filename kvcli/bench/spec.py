"""Speculative decoding by prompt lookup, measured in one run: kvcli with and without `--speculate
ngram` (with speculation: each --draft-lengths mode, adaptive then fixed, by default), and transformers
`generate` with and without `prompt_lookup_num_tokens`, on the same prompts: a repetitive text (source
code) and prose, at batch 1 and as a 16-request batch.

Method (as the decode figure): wall time of a greedy generation of 1 token and of N tokens from
the same prompts; decode tok/s = batch * (N - 1) / (t_N - t_1), so prefill is excluded. Best of
--repeats after one warm-up. kvcli runs its CPU default (INT4 weights resident); transformers runs the
same GGUF dequantized to fp32 (its GGUF loader). Greedy identity is checked on the N-token outputs.
transformers' prompt lookup (assisted generation) takes batch 1 only; the batch row says so if it
refuses.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from datetime import datetime, timezone

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from kvcli.bench.harness import REPO, best_warm



def cpu_isa() -> str:
    from kvcli.native.capabilities import cpu_flags

    flags = cpu_flags()
    if not flags:
        return "unknown"
    return " ".join(f"{f}={'yes' if f in flags else 'no'}" for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile"))


def best(fn, repeats: int) -> tuple[float, object]:
    """A warm-up, then the best of `repeats` wall times, and the last run's output."""
    return best_warm(fn, repeats)


def texts(prompt_tokens: int, batch: int, tokenizer) -> dict[str, list[list[int]]]:
    """Per text, `batch` prompts: windows of the text at different offsets."""
    code = "".join((REPO / "kvcli" / p).read_text() for p in ("engine/scheduler.py", "kvcache/block_manager.py"))
    prose = (REPO / "samples" / "keepers-log.txt").read_text()
    out = {}
    for name, text in (("code", code), ("prose", prose)):
        ids = tokenizer.encode(text)
        step = max(1, (len(ids) - prompt_tokens) // max(1, batch))
        out[name] = [ids[i * step:i * step + prompt_tokens] for i in range(batch)]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch-prompt-tokens", type=int, default=256)
    ap.add_argument("--batch-new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=5)
    ap.add_argument("--draft-lengths", default="adaptive,fixed", help="kvcli's --draft-length runs, in this order "
                    "(adaptive: the row 'kvcli+ngram'; fixed: 'kvcli+ngram fixed k')")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-batch", action="store_true", help="batch 1 only")
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: kvcli samples (top-p 0.95, seed 0) so "
                    "the output does not loop; identity is then not checked")
    ap.add_argument("--dequantize", action="store_true", help="kvcli on dense fp32 weights (exact) instead of INT4")
    ap.add_argument("--attention-backend", default="torch", choices=["torch", "invariant"],
                    help="kvcli's attention: torch (default, fastest) or invariant (batch-invariant rows: greedy "
                         "output with speculation bit-identical to plain decoding on INT4 weights)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for every engine (on a shared "
                    "machine one thread avoids OpenMP spinning against other processes)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    from kvcli.config import SamplingParams
    from kvcli.engine.llm_engine import EngineOptions, LLMEngine
    from kvcli.llm import LLM
    from kvcli.model.loader import bundled_gguf_path, load_weights

    print(f"# bench_spec {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC · {platform.machine()} · "
          f"{os.cpu_count()} cores · {cpu_isa()}")
    print(f"# python {platform.python_version()} · torch {torch.__version__} · threads {torch.get_num_threads()}")
    print(f"# k={a.num_speculative_tokens} (draft lengths: {a.draft_lengths}) · batch 1: {a.prompt_tokens} prompt / "
          f"{a.new_tokens} new tokens · "
          f"batch {a.batch}: {a.batch_prompt_tokens} / {a.batch_new_tokens} · best of {a.repeats} · "
          f"kvcli weights {'fp32 (--dequantize)' if a.dequantize else 'INT4 resident'} · "
          f"attention backend {a.attention_backend}")
    sys.stdout.flush()
    loaded = load_weights(None)
    context = max(2048, a.prompt_tokens + a.new_tokens + a.num_speculative_tokens + 16)
    plain = LLMEngine(loaded, EngineOptions(kv_budget="512MiB", max_model_len=context, dequantize=a.dequantize,
                                            attention_backend=a.attention_backend))
    specs = {("kvcli+ngram" if mode == "adaptive" else f"kvcli+ngram {mode} k"): LLMEngine(loaded, EngineOptions(
        kv_budget="512MiB", max_model_len=context, speculate="ngram", dequantize=a.dequantize,
        attention_backend=a.attention_backend, num_speculative_tokens=a.num_speculative_tokens, draft_length=mode),
        model=plain.model) for mode in a.draft_lengths.split(",")}
    tok = loaded.tokenizer
    hf = None
    if not a.skip_hf:
        from transformers import GenerationConfig

        from kvcli.bench.hf_baselines import load_hf_reference
        hf = load_hf_reference(bundled_gguf_path())

    rows = []
    shapes = [(1, a.prompt_tokens, a.new_tokens)] + ([] if a.skip_batch else [(a.batch, a.batch_prompt_tokens, a.batch_new_tokens)])
    for batch, p_len, n_new in shapes:
        for name, prompts in texts(p_len, batch, tok).items():
            res = {}
            for label, engine in (("kvcli", plain), *specs.items()):
                llm = LLM.from_engine(engine)

                def run(n: int):
                    sp = SamplingParams(max_tokens=n, ignore_eos=True, temperature=a.temperature,
                                        top_p=0.95 if a.temperature else 1.0, seed=0 if a.temperature else None)
                    return lambda: [o.token_ids for o in llm.generate(prompts, sp)]

                t1, _ = best(run(1), a.repeats)
                p0, a0 = engine.scheduler.spec_proposed, engine.scheduler.spec_accepted
                s0, k0 = engine.scheduler.sample_steps, engine.scheduler.sample_tokens
                tn, out = best(run(n_new), a.repeats)
                acc = ((engine.scheduler.spec_accepted - a0) / (engine.scheduler.spec_proposed - p0)
                       if engine.scheduler.spec_proposed > p0 else None)
                tps = (engine.scheduler.sample_tokens - k0) / max(1, engine.scheduler.sample_steps - s0)
                res[label] = (batch * (n_new - 1) / (tn - t1), out, acc, tps)
            if hf is not None:
                for label, extra in (("transformers", {}), ("transformers+lookup", {"prompt_lookup_num_tokens": a.num_speculative_tokens})):
                    cfg = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, **extra)
                    x = torch.tensor(prompts)
                    mask = torch.ones_like(x)

                    def run_hf(n: int, cfg=cfg, x=x, mask=mask):
                        def f():
                            with torch.inference_mode():
                                cfg.max_new_tokens = cfg.min_new_tokens = n
                                y = hf.generate(x, attention_mask=mask, generation_config=cfg)
                            return y[:, x.shape[1]:].tolist()
                        return f
                    try:
                        t1, _ = best(run_hf(1), a.repeats)
                        tn, out = best(run_hf(n_new), a.repeats)
                        res[label] = (batch * (n_new - 1) / (tn - t1), out, None, None)
                    except (ValueError, NotImplementedError) as e:
                        res[label] = (None, None, None, str(e).split("\n")[0][:90])
            base = res["kvcli"][0]
            for label, (rate, out, acc, extra) in res.items():
                same = "" if out is None else "sampled" if a.temperature and label.startswith("kvcli") else ("yes" if out == res["kvcli" if label.startswith("kvcli") else "transformers"][1] else "NO")
                first_diff = ""
                if same == "NO":
                    ref = res["kvcli" if label.startswith("kvcli") else "transformers"][1]
                    diffs = [next((j for j, (u, v) in enumerate(zip(o, r)) if u != v), None) for o, r in zip(out, ref)]
                    first_diff = f" (first difference at token {min(d for d in diffs if d is not None)}, " \
                                 f"{sum(d is not None for d in diffs)}/{len(diffs)} prompts)"
                rows.append((batch, name, label, rate, rate / base if rate else None, acc,
                             extra if isinstance(extra, float) else None, same + first_diff,
                             extra if isinstance(extra, str) else ""))
            for r in rows[-len(res):]:
                print_row(r)
            sys.stdout.flush()

    print()
    print("| batch | text | engine | decode tok/s | vs kvcli plain | acceptance | tokens/step/request | greedy identical to its plain run | note |")
    print("|---:|---|---|---:|---:|---:|---:|---|---|")
    for r in rows:
        print_row(r, table=True)


def print_row(r, table: bool = False) -> None:
    batch, name, label, rate, ratio, acc, tps, same, note = r
    cells = [str(batch), name, label, "n/a" if rate is None else f"{rate:,.1f}",
             "n/a" if ratio is None else f"{ratio:.2f}x", "" if acc is None else f"{acc:.1%}",
             "" if tps is None else f"{tps:.2f}", same, note]
    print(("| " + " | ".join(cells) + " |") if table else "  ".join(cells))
