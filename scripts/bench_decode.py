"""Decode speed at batch 1: kvcli (INT4 resident, and dense fp32) against transformers `generate`
on the same GGUF weights, in one run. Prints a markdown table with ratios.

Method, identical for every side: wall time of a greedy generation of 1 token and of N tokens from the
same prompt; decode tok/s = (N - 1) / (t_N - t_1), so prefill is excluded. Best of --repeats.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import datetime, timezone

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()

    from transformers import AutoModelForCausalLM, GenerationConfig

    from kvcli.config import SamplingParams
    from kvcli.llm import LLM
    from kvcli.bench.machine import machine_line
    from kvcli.model.loader import bundled_gguf_path

    sample = open(os.path.join(os.path.dirname(__file__), "..", "samples", "keepers-log.txt"), encoding="utf-8").read()
    rows = []

    def kvcli_side(label: str, **opts) -> None:
        # No prefix caching: the warm-up would leave the prompt cached, and every later run would
        # prefill 16 tokens where transformers prefills all of them.
        llm = LLM(prefix_caching=False, **opts)
        ids = llm.tokenizer.encode(sample)[: a.prompt_tokens]

        def run(n: int):
            return lambda: llm.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True))

        run(a.new_tokens)()  # warm-up
        t1, tn = best(run(1), a.repeats), best(run(a.new_tokens), a.repeats)
        wb = sum(llm.engine.weight_bytes().values())
        rows.append((label, (a.new_tokens - 1) / (tn - t1), t1, wb))
        del llm

    kvcli_side("kvcli, INT4 resident (default)")
    kvcli_side("kvcli, --dequantize (fp32)", dequantize=True)

    path = bundled_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    hf.generation_config = GenerationConfig(eos_token_id=None, pad_token_id=0)
    from kvcli.model.tokenizer import load_gguf_tokenizer

    ids = load_gguf_tokenizer(path, ()).encode(sample)[: a.prompt_tokens]
    x = torch.tensor([ids])
    mask = torch.ones_like(x)

    def hf_run(n: int):
        def f():
            with torch.inference_mode():
                hf.generate(x, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return f

    hf_run(a.new_tokens)()
    t1, tn = best(hf_run(1), a.repeats), best(hf_run(a.new_tokens), a.repeats)
    hf_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    rows.append(("transformers generate (fp32, dequantized by its GGUF loader)", (a.new_tokens - 1) / (tn - t1), t1, hf_bytes))

    hf_rate = rows[-1][1]
    print(f"# decode benchmark — {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(machine_line())
    print(f"command: python scripts/bench_decode.py --prompt-tokens {a.prompt_tokens} --new-tokens "
          f"{a.new_tokens} --repeats {a.repeats}")
    print(f"workload: SmolLM2-135M-Instruct Q4_1 GGUF, batch 1, {len(ids)}-token prompt, {a.new_tokens} new "
          "tokens, greedy\n")
    print("| engine | decode tok/s | vs transformers | time to 1st token (s) | weight bytes |")
    print("|---|---:|---:|---:|---:|")
    for label, rate, t1, wb in rows:
        print(f"| {label} | {rate:.1f} | {rate / hf_rate:.2f}x | {t1:.3f} | {wb / 2**20:.1f} MiB |")


if __name__ == "__main__":
    main()
