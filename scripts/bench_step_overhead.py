"""Per-step CPU cost of greedy decode on the bundled model, split into the model forward and the rest.

Batch 1 and batch 16, ~512 tokens of context (the 16 requests share a 496-token prefix through the
prefix cache, so the set-up prefills 512 + 15 x 16 tokens, and each has its own last block). After
warm-up steps, every timed step is a decode-only engine.step(). Timing is the calling thread's CPU
time (time.thread_time, torch held to 1 thread, so every kernel runs on this thread): other users of
a shared machine inflate it far less than wall time. Wall time is printed beside it.

Phases of a step, measured by wrapping the engine's parts (no change to the code measured):
  forward   LlamaModel.forward: embedding, 30 layers, norm, vocabulary projection
  runner    ModelRunner.execute minus the forward: block traffic, packing ids/positions/slots/block
            tables into tensors, sampling
  schedule  Scheduler.schedule;  update  Scheduler.update_from_output;  metrics  MetricsCollector.record
  engine    the rest of LLMEngine.step (detokenizing, outputs, counters)
Then torch.profiler over a few more steps: ops per step by count, and the forward's self CPU time split
into the heavy ops (matmuls, attention) and all other ops (profiler overhead inflates small ops).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import datetime, timezone

import torch

# The ops that do the arithmetic of a forward: linears (int4 / dense / vocabulary), attention.
HEAVY_OPS = ("aten::_weight_int4pack_mm_for_cpu", "aten::mm", "aten::addmm", "aten::bmm", "aten::matmul",
             "aten::linear", "aten::_scaled_dot_product_flash_attention_for_cpu",
             "aten::_scaled_dot_product_attention_math", "aten::scaled_dot_product_attention")
PHASES = ("forward", "runner", "schedule", "update", "metrics", "engine")


class PhaseTimer:
    """Wraps callables so that each call adds its thread CPU time to a named phase."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            t = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cpu[name] += time.thread_time() - t
        return timed


def decode_only(engine) -> bool:
    return all(len(r.output_token_ids) >= 1 for r in engine.scheduler.running) and not engine.scheduler.waiting


def set_up(model, loaded, batch: int, ids: list[int], steps: int):
    from kvcli.config import SamplingParams
    from kvcli.engine.llm_engine import EngineOptions, LLMEngine

    engine = LLMEngine(loaded, EngineOptions(device="cpu", kv_budget="256MiB", max_model_len=2048),
                       model=model)
    prefix, tail = ids[:496], 16
    params = SamplingParams(max_tokens=steps, ignore_eos=True)
    if batch > 1:  # fill the prefix cache first, so 16 prompts prefill 16 tokens each
        engine.add_request(prefix + ids[496:512], SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    for b in range(batch):
        engine.add_request(prefix + ids[496 + b * tail:512 + b * tail], params)
    while not decode_only(engine):
        engine.step()
    return engine


def measure(model, loaded, batch: int, ids: list[int], warmup: int, steps: int, prof_steps: int) -> dict:
    engine = set_up(model, loaded, batch, ids, warmup + steps + prof_steps + 4)
    timer = PhaseTimer()
    runner, sched, metrics = engine.runner, engine.scheduler, engine.metrics
    originals = {"forward": (model, "forward"), "runner": (runner, "execute"), "schedule": (sched, "schedule"),
                 "update": (sched, "update_from_output"), "metrics": (metrics, "record")}
    for _ in range(warmup):
        engine.step()
    for name, (obj, attr) in originals.items():
        setattr(obj, attr, timer.wrap(name, getattr(obj, attr)))
    cpu, wall, split = [], [], []
    for _ in range(steps):
        assert decode_only(engine) and len(sched.running) == batch
        before = dict(timer.cpu)
        w, t = time.perf_counter(), time.thread_time()
        engine.step()
        cpu.append(time.thread_time() - t)
        wall.append(time.perf_counter() - w)
        split.append({k: timer.cpu[k] - before.get(k, 0.0) for k in originals})
    for obj, attr in originals.values():
        delattr(obj, attr)  # back to the class methods
    phase = {k: statistics.median(s[k] for s in split) for k in originals}
    phase["runner"] -= phase["forward"]  # execute() includes the forward
    phase["engine"] = statistics.median(c - sum(v for k, v in s.items() if k != "forward") for c, s in zip(cpu, split))

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(prof_steps):
            engine.step()
    ops = [(e.key, e.count / prof_steps, e.self_cpu_time_total / prof_steps) for e in prof.key_averages()]
    return {"cpu": statistics.median(cpu), "wall": statistics.median(wall), "phase": phase, "ops": ops}


def report(batch: int, r: dict) -> list[str]:
    cpu, ph = r["cpu"], r["phase"]
    other = cpu - ph["forward"]
    lines = [f"## batch {batch}: median of the timed steps",
             f"step: {cpu * 1e3:.2f} ms thread CPU ({batch / cpu:.1f} tok/s by CPU time); "
             f"{r['wall'] * 1e3:.2f} ms wall ({batch / r['wall']:.1f} tok/s)",
             f"  forward (model)             {ph['forward'] * 1e3:8.2f} ms  {100 * ph['forward'] / cpu:5.1f} %",
             f"  everything else             {other * 1e3:8.2f} ms  {100 * other / cpu:5.1f} %"]
    for k in PHASES[1:]:
        lines.append(f"    {k:<26}{ph[k] * 1e3:8.2f} ms  {100 * ph[k] / cpu:5.1f} %")
    ops = r["ops"]
    heavy = sum(t for k, _, t in ops if k in HEAVY_OPS)
    total = sum(t for _, _, t in ops)
    calls = sum(n for _, n, _ in ops)
    lines += [f"profiler (self CPU per step, profiler overhead included): {total / 1e3:.2f} ms over "
              f"{calls:.0f} op calls; heavy ops (matmuls, attention) {heavy / 1e3:.2f} ms, "
              f"all other ops {(total - heavy) / 1e3:.2f} ms",
              "top 20 ops by calls per step:",
              f"  {'op':<52}{'calls':>8}{'self CPU us':>13}"]
    for key, n, t in sorted(ops, key=lambda o: -o[1])[:20]:
        lines.append(f"  {key:<52}{n:8.0f}{t:13.0f}")
    lines.append("top 10 ops by self CPU per step:")
    for key, n, t in sorted(ops, key=lambda o: -o[2])[:10]:
        lines.append(f"  {key:<52}{n:8.0f}{t:13.0f}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--profile-steps", type=int, default=4)
    a = ap.parse_args()
    torch.set_num_threads(1)

    from kvcli.bench.machine import machine_line
    from kvcli.engine.llm_engine import EngineOptions, LLMEngine
    from kvcli.model.loader import load_weights

    loaded = load_weights(None)
    model = LLMEngine(loaded, EngineOptions(device="cpu", kv_budget="16MiB")).model  # built once, shared
    sample = open(os.path.join(os.path.dirname(__file__), "..", "samples", "keepers-log.txt"), encoding="utf-8").read()
    ids = loaded.tokenizer.encode(sample)
    assert len(ids) >= 512 + 15 * 16, "the sample text is too short"

    print(f"# Per-step overhead of greedy decode — {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(machine_line())
    print(f"load average (1 min): {os.getloadavg()[0]:.2f}")
    print(f"command: python scripts/bench_step_overhead.py --batches {a.batches} --warmup {a.warmup} "
          f"--steps {a.steps} --profile-steps {a.profile_steps}")
    print(f"model: bundled ({model.linear_mode}), compute fp32, context ~512 tokens")
    for batch in (int(b) for b in a.batches.split(",")):
        r = measure(model, loaded, batch, ids, a.warmup, a.steps, a.profile_steps)
        print()
        print("\n".join(report(batch, r)))


if __name__ == "__main__":
    main()
