"""What the C glue of a CPU decode step buys, in one process, steps interleaved (load from other users of a
shared machine falls on every side alike). Three ways to run the same model on the same prompts:

  torch glue   layer by layer; rotary, KV store and SwiGLU as torch ops (the code before 2026-12-01 16:00 UTC)
  C glue       layer by layer; rotary + KV store in one C call per layer (kernels/cpu_rope_kv.c), SwiGLU in
               one pass (kernels/cpu_swiglu.c)
  one call     every layer of a decode-only step in one C call (kernels/cpu_decode_layers.c)

Each side has its own engine over the shared weights, set up like scripts/bench_step_overhead.py (~512
tokens of context; batch 16 shares a 496-token prefix). Per round, each side runs --steps decode steps;
the figure is the median wall time per step over all rounds, torch's default thread count. "C glue" and
"one call" must produce the same tokens (the same kernels in the same order); "torch glue" rounds SwiGLU
differently (a few ulp), so its tokens may part at a near tie and are only compared.

  python scripts/ab_decode_glue.py [--batches 1,16] [--rounds 6] [--steps 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import datetime, timezone

sys.path.insert(0, os.path.dirname(__file__))
from bench_step_overhead import decode_only, set_up  # noqa: E402

SIDES = ("torch glue", "C glue", "one call")


def configure(engine, model, side: str, native_decode, swiglu_lib) -> None:
    """Point the shared model (and this side's backend) at one side's code before its steps."""
    model.native_decode = native_decode if side == "one call" else None
    model.swiglu.native = None if side == "torch glue" else swiglu_lib
    if side == "torch glue":
        engine.backend.rope_kv_writer = lambda *args: None  # the instance attribute shadows the method
    else:
        engine.backend.__dict__.pop("rope_kv_writer", None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()

    from kvcli.bench.machine import machine_line
    from kvcli.engine.llm_engine import EngineOptions, LLMEngine
    from kvcli.model.loader import load_weights

    loaded = load_weights(None)
    model = LLMEngine(loaded, EngineOptions(device="cpu", kv_budget="16MiB")).model
    native_decode, swiglu_lib = model.native_decode, model.swiglu.native
    if native_decode is None or swiglu_lib is None:
        raise SystemExit("kvcli's C kernels do not all run here (KVCLI_NATIVE=0, no compiler, or a plain C build)")
    sample = open(os.path.join(os.path.dirname(__file__), "..", "samples", "keepers-log.txt"), encoding="utf-8").read()
    ids = loaded.tokenizer.encode(sample)

    print(f"# C glue of a CPU decode step, A/B/C in one process — {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(machine_line())
    print(f"load average (1 min): {os.getloadavg()[0]:.2f}")
    print(f"command: python scripts/ab_decode_glue.py --batches {a.batches} --rounds {a.rounds} --steps {a.steps}")
    print(f"model: bundled ({model.linear_modes()}), fp32 compute, default KV dtype, context ~512 tokens\n")
    print("| batch | side | ms per step | tok/s | vs torch glue |")
    print("|---:|---|---:|---:|---:|")
    notes = []
    for batch in (int(b) for b in a.batches.split(",")):
        total = a.rounds * a.steps + 4
        engines = {}
        for side in SIDES:  # prompts prefilled with every C kernel on, then each side decodes its own way
            model.native_decode, model.swiglu.native = native_decode, swiglu_lib
            engines[side] = set_up(model, loaded, batch, ids, total)
        times: dict[str, list[float]] = {s: [] for s in SIDES}
        for _ in range(a.rounds):
            for side in SIDES:
                eng = engines[side]
                configure(eng, model, side, native_decode, swiglu_lib)
                for _ in range(a.steps):
                    assert decode_only(eng) and len(eng.scheduler.running) == batch
                    t = time.perf_counter()
                    eng.step()
                    times[side].append(time.perf_counter() - t)
        base = statistics.median(times["torch glue"])
        for side in SIDES:
            ms = statistics.median(times[side])
            print(f"| {batch} | {side} | {ms * 1e3:.2f} | {batch / ms:.1f} | {base / ms:.2f}x |")
        tokens = {s: [list(r.output_token_ids) for r in engines[s].scheduler.running] for s in SIDES}
        assert tokens["C glue"] == tokens["one call"], "one call and C glue must give the same tokens"
        notes.append(f"batch {batch}: tokens of C glue and one call identical; torch glue "
                     f"{'identical' if tokens['torch glue'] == tokens['C glue'] else 'parted at a near tie'}")
    model.native_decode, model.swiglu.native = native_decode, swiglu_lib
    print()
    for n in notes:
        print(f"- {n}")


if __name__ == "__main__":
    main()
