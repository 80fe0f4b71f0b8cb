"""What each weight tier costs on the CPU (kvcli/model/weight_plan.py): batch-1 decode of the bundled model
with kvcli's int8 kernel ("cpu"), with torch's int4 kernel as a machine without a C compiler runs it
("int4-cpu", KVCLI_NATIVE=0), and with the codes dequantized per call ("exact", KVCLI_NATIVE=0: what such a
machine would run without the torch int4 tier). This is the figure behind keeping the torch int4 tier.

Each measurement runs in its own process (KVCLI_NATIVE is read when a model is built, and a machine without
a compiler has no C kernel at all, attention included); rounds interleave the tiers. Reported: decode tok/s
(wall clock after the first token), best of the rounds, and each tier's ratio to "cpu" per round.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from kvcli.bench.harness import busy_note, interleaved, load1, sample_text

TIERS = {"cpu": {}, "int4-cpu": {"KVCLI_NATIVE": "0"}, "exact": {"KVCLI_NATIVE": "0"}}


def _child(tier: str, context: int, new_tokens: int) -> None:
    import torch

    from kvcli.engine.llm_engine import EngineOptions, LLMEngine
    from kvcli.model.loader import load_weights
    from kvcli.bench.engines import KvcliEngine
    from kvcli.bench.internals import LlamaModel, Native, plan_loaded, plan_model
    from kvcli.llm import LLM
    from kvcli.native.capabilities import capabilities

    opts = EngineOptions(kv_budget="256MiB", max_model_len=2048, prefix_caching=False)
    loaded = load_weights(None)
    cpu = torch.device("cpu")
    plan = plan_loaded(loaded, dequantize=False, device=cpu, dtype=torch.float32, backend="torch")
    if tier != "cpu":  # what the engine's "cpu" tier becomes without a C compiler, or one tier further down
        plan = plan_model(loaded.config, loaded.weights, tier=tier, dtype=torch.float32, device=cpu,
                          head_dtype=plan.head.dtype, caps=capabilities(), native=Native.here(cpu, torch.float32))
    model = LlamaModel(loaded.config, loaded.weights, plan=plan, device=cpu)
    engine = LLMEngine(load_weights(None), opts, model=model)
    runner = KvcliEngine.__new__(KvcliEngine)  # its timing over an engine built here
    runner.llm = LLM.from_engine(engine)
    ids = engine.tokenizer.encode(sample_text("keepers-log.txt"))[:context]
    runner.timed(ids[:64], 4)  # warm-up
    _, decode_s = runner.timed(ids, new_tokens)
    print(json.dumps({"tier": tier, "forms": model.linear_mode, "tok_s": (new_tokens - 1) / decode_s}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvcli.bench weight-tiers", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--context", type=int, default=512, help="prompt tokens before decoding")
    p.add_argument("--new-tokens", type=int, default=17)
    p.add_argument("--child", choices=list(TIERS), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        _child(a.child, a.context, a.new_tokens)
        return 0
    before = load1()  # (python -m kvcli.bench prints the header)

    def measure(tier: str, _round: int) -> dict:
        env = dict(os.environ, **TIERS[tier])
        out = subprocess.run([sys.executable, "-m", "kvcli.bench.weight_tiers", "--child", tier, "--context",
                              str(a.context), "--new-tokens", str(a.new_tokens)], env=env, capture_output=True,
                             text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    rounds = interleaved(list(TIERS), a.rounds, measure, alternate=True)
    print(f"bundled SmolLM2-135M Q4_1, batch 1, {a.context}-token prompt, {a.new_tokens} new tokens, "
          f"{a.rounds} rounds interleaved, one process per measurement\n")
    print("| tier | forms | decode tok/s (best) | per round | ratio to cpu (median of rounds) |")
    print("|---|---|---|---|---|")
    tok = lambda r: r["tok_s"]  # noqa: E731
    for tier in TIERS:
        per = ", ".join(f"{r['tok_s']:.1f}" for r in rounds.samples[tier])
        ratio = sorted(rounds.ratios(tier, "cpu", tok))[len(rounds.samples[tier]) // 2]
        print(f"| {tier} | {rounds.samples[tier][0]['forms']} | {max(tok(r) for r in rounds.samples[tier]):.1f} "
              f"| {per} | {ratio:.3f}x |")
    print(f"\n{busy_note(before, load1())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
