"""What batch invariance costs: `--attention-backend invariant` against the default torch backend on
the bundled model (INT4 weights), in one process, rounds interleaved (torch, invariant, torch, ...).

Rows: batch-1 decode after a 512-token prompt, 16-request decode after 256-token prompts, prefill of
512 and 2048 tokens. Time is the process's CPU time (one torch thread), so other processes on a
shared machine slow neither side; decode tok/s = batch x (N - 1) / (t_N - t_1), prefill tok/s =
tokens / t_1. Prints per-round figures and the median ratio invariant / torch.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvcli.bench.harness import REPO



def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=48)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)

    from kvcli.config import SamplingParams
    from kvcli.engine.llm_engine import EngineOptions, LLMEngine
    from kvcli.llm import LLM
    from kvcli.model.loader import load_weights

    print(f"# rounds {a.rounds} · process CPU time, 1 thread")
    loaded = load_weights(None)
    base = LLMEngine(loaded, EngineOptions(kv_budget="512MiB", max_model_len=4096, prefix_caching=False))
    llms = {"torch": LLM.from_engine(base)}
    # Each engine builds its own model (a model is planned for one attention backend), from its own load of
    # the same file (building a model takes the loaded tensors).
    llms["invariant"] = LLM.from_engine(LLMEngine(load_weights(None), EngineOptions(
        kv_budget="512MiB", max_model_len=4096, prefix_caching=False, attention_backend="invariant")))
    ids = loaded.tokenizer.encode((REPO / "samples" / "keepers-log.txt").read_text() * 4)

    def cpu(llm, prompts, n: int) -> float:
        t = time.process_time()
        llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
        return time.process_time() - t

    def decode(llm, batch: int, prompt: int) -> float:
        prompts = [ids[i * 7:i * 7 + prompt] for i in range(batch)]
        t1, tn = cpu(llm, prompts, 1), cpu(llm, prompts, a.new_tokens)
        return batch * (a.new_tokens - 1) / (tn - t1)

    def prefill(llm, n: int) -> float:
        return n / cpu(llm, [ids[:n]], 1)

    cases = [("decode tok/s, batch 1, 512-token prompt", lambda llm: decode(llm, 1, 512)),
             ("decode tok/s, batch 16, 256-token prompts", lambda llm: decode(llm, 16, 256)),
             ("prefill tok/s, 512 tokens", lambda llm: prefill(llm, 512)),
             ("prefill tok/s, 2048 tokens", lambda llm: prefill(llm, 2048))]
    for llm in llms.values():  # warm-up (scratch buffers, first-touch of the pool)
        decode(llm, 2, 64)
    print("| case | torch (per round) | invariant (per round) | median ratio invariant / torch |")
    print("|---|---|---|---:|")
    for name, fn in cases:
        got: dict[str, list[float]] = {k: [] for k in llms}
        for r in range(a.rounds):
            order = list(llms) if r % 2 == 0 else list(reversed(llms))
            for k in order:
                got[k].append(fn(llms[k]))
        ratios = [i / t for i, t in zip(got["invariant"], got["torch"])]
        fmt = lambda xs: ", ".join(f"{x:.1f}" for x in xs)  # noqa: E731
        print(f"| {name} | {fmt(got['torch'])} | {fmt(got['invariant'])} | {statistics.median(ratios):.2f}x |",
              flush=True)
