"""Batch-1 prefill and decode at 512 and 4k tokens of context: kvcli (INT4 resident), transformers (fp32,
dequantized by its GGUF loader) and llama.cpp (llama-cpp-python, the same Q4_1 file) in one run, on the
same token ids. Prints the machine's vector ISA and a markdown table of ratios against each goal.

  python scripts/bench_cpu.py                 # the CPU's own ISA
  python scripts/bench_cpu.py --isa avx2      # torch held to AVX2 and llama.cpp built for AVX2

Method, the same for every engine: prefill tok/s = N / time to the first token from an empty cache
(kvcli: prefix caching off); decode tok/s = (M - 1) / time from the first token to the last, both
timed inside the same generation (kvcli: around engine steps; transformers: a streamer's put() per
token; llama.cpp: around its decode calls). Best of --repeats rounds after a warm-up; each round runs every engine once per context (since
2026-12-01 16:30 UTC; before, each engine ran all its repeats in turn, so a slow phase of a shared VM
could fall on one engine only). (Before 2026-12-01
06:20 UTC decode was (M - 1) / (t_M - t_1) over two whole generations: at 4k context that difference
of two ~10 s prefills swung the decode figure by tens of percent.)
llama.cpp is skipped with a message where it is not built (scripts/build_llama_cpp.sh).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from datetime import datetime, timezone

ISA_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isa", choices=("native", "avx2"), default="native")
    ap.add_argument("--contexts", default="512,4096", help="prompt lengths in tokens (default 512,4096)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--engines", default="kvcli,transformers,llama.cpp")
    a = ap.parse_args()
    if a.isa == "avx2" and any(os.environ.get(k) != v for k, v in ISA_ENV.items()):
        # torch reads ATEN_CPU_CAPABILITY once, at import: start again with it set.
        os.execve(sys.executable, [sys.executable] + sys.argv, dict(os.environ, **ISA_ENV))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import llama_bench

    from kvcli.bench.machine import machine_line
    from kvcli.config import SamplingParams
    from kvcli.llm import LLM
    from kvcli.model.loader import bundled_gguf_path

    contexts = [int(x) for x in a.contexts.split(",")]
    engines = [e.strip() for e in a.engines.split(",")]
    text = open(os.path.join(os.path.dirname(__file__), "..", "samples", "heldout-gpl-3.0.txt"), encoding="utf-8").read()
    load_before = os.getloadavg()[0]
    results: dict[str, dict[int, tuple[float, float]]] = {}
    notes: list[str] = []

    max_len = max(contexts) + a.new_tokens + 16
    llm = LLM(prefix_caching=False, max_model_len=max_len, max_num_batched_tokens=512, kv_budget="512MiB")
    ids_all = llm.tokenizer.encode(text * (1 + max(contexts) * 5 // len(text)))
    if len(ids_all) < max(contexts):
        print(f"error: the sample text has only {len(ids_all)} tokens", file=sys.stderr)
        return 1
    linear_mode, kv_dtype = llm.engine.linear_mode, llm.engine.kv_dtype.name

    def kvcli_once(n: int) -> tuple[float, float]:
        """(seconds to the first token, seconds from it to the last) of one generation."""
        eng, ids = llm.engine, ids_all[:n]
        t0 = time.perf_counter()
        eng.add_request(ids, SamplingParams(max_tokens=a.new_tokens, ignore_eos=True))
        first = None
        while eng.has_unfinished():
            outs = eng.step()
            if first is None and any(o.new_token_ids for o in outs):
                first = time.perf_counter()
        assert first is not None
        return first - t0, time.perf_counter() - first

    path = bundled_gguf_path()
    hf = None
    if "transformers" in engines:
        from transformers import AutoModelForCausalLM, GenerationConfig

        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        hf.generation_config = GenerationConfig(eos_token_id=None, pad_token_id=0)

    def hf_once(n: int, m: int | None = None) -> tuple[float, float]:
        x = torch.tensor([ids_all[:n]])
        m = a.new_tokens if m is None else m
        stamps: list[float] = []  # put() gets the prompt first, then each new token

        class Clock:
            def put(self, _value) -> None:
                stamps.append(time.perf_counter())

            def end(self) -> None:
                pass
        t0 = time.perf_counter()
        with torch.inference_mode():
            hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=m, min_new_tokens=m,
                        do_sample=False, streamer=Clock())
        return stamps[1] - t0, stamps[-1] - stamps[1]

    # Rounds: each engine once per context per round, best of the rounds; a phase of the machine (a shared
    # VM's neighbours) then weighs on every engine alike instead of on whichever ran during it.
    times: dict[str, dict[int, list[tuple[float, float]]]] = {}
    llama = "llama.cpp" in engines  # False once its worker is found missing or failing
    for n in contexts:  # warm-ups
        if "kvcli" in engines:
            kvcli_once(n)
        if hf is not None:
            hf_once(n, 2)
    for rnd in range(a.repeats):
        if "kvcli" in engines:
            for n in contexts:
                times.setdefault("kvcli", {}).setdefault(n, []).append(kvcli_once(n))
        if hf is not None:
            for n in contexts:
                times.setdefault("transformers", {}).setdefault(n, []).append(hf_once(n))
        if llama:
            # one worker process per round (it warms up on each context first)
            job = {"model": str(path), "threads": torch.get_num_threads(), "contexts": contexts,
                   "new_tokens": a.new_tokens, "repeats": 1, "prompt_ids": ids_all[:max(contexts)]}
            res, note = llama_bench.run(job, a.isa)
            if res is None:
                notes.append(note)
                llama = False
            else:
                for r in res["batch1"]:  # rates back to seconds, so that every engine is reduced alike
                    times.setdefault("llama.cpp", {}).setdefault(r["context"], []).append(
                        (r["context"] / r["prefill_tok_s"], a.new_tokens / r["decode_tok_s"]))
                version = f"llama.cpp: llama-cpp-python {res['llama_cpp_version']}; {res['system_info'].strip()}"
                if version not in notes:
                    notes.append(version)
        print(f"round {rnd + 1} of {a.repeats} done", file=sys.stderr, flush=True)
    for eng, per_n in times.items():
        decoded = a.new_tokens if eng == "llama.cpp" else a.new_tokens - 1  # llama.cpp times m decode calls
        results[eng] = {n: (n / min(t[0] for t in runs), decoded / min(t[1] for t in runs)) for n, runs in per_n.items()}

    load_after = os.getloadavg()[0]
    print(f"# CPU batch-1 benchmark — {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(machine_line())
    busy = max(load_before, load_after) > (os.cpu_count() or 1)
    print(f"load average (1 min): {load_before:.2f} at start, {load_after:.2f} at end"
          + (" — other work shared the CPU, timings are not clean" if busy else ""))
    print("command: python scripts/bench_cpu.py" + ("" if len(sys.argv) == 1 else " " + shlex.join(sys.argv[1:])))
    print(f"model: SmolLM2-135M-Instruct Q4_1 GGUF; kvcli {linear_mode} weights, fp32 activations, {kv_dtype} KV "
          f"(default --kv-dtype); transformers fp32; {a.new_tokens} new tokens, greedy, batch 1\n")
    print("| context | engine | prefill tok/s | decode tok/s | kvcli prefill ratio | kvcli decode ratio |")
    print("|---:|---|---:|---:|---:|---:|")
    for n in contexts:
        k = results.get("kvcli", {}).get(n)
        for eng, res in results.items():
            p, d = res[n]
            rp = f"{k[0] / p:.2f}x" if k and eng != "kvcli" else "—"
            rd = f"{k[1] / d:.2f}x" if k and eng != "kvcli" else "—"
            print(f"| {n} | {eng} | {p:.1f} | {d:.1f} | {rp} | {rd} |")
    print()
    for note in notes:
        print(f"- {note}")
    k = results.get("kvcli")
    if k:
        for n in contexts:
            if "llama.cpp" in results:
                r = k[n][1] / results["llama.cpp"][n][1]
                print(f"goal decode >= 1.0x llama.cpp at {n}: {'met' if r >= 1 else 'missed'} ({r:.2f}x)")
            if "transformers" in results:
                r = k[n][0] / results["transformers"][n][0]
                print(f"goal prefill >= 1.0x transformers at {n}: {'met' if r >= 1 else 'missed'} ({r:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
