"""Before/after of the per-step overhead work, in one process, steps interleaved: load from other users
of a shared machine falls on both sides alike (separate runs minutes apart differed by 20 % here).

The base side is git revision BASE's code for what that work changed: LlamaModel.forward, Rotary,
ModelRunner.execute with its build_metadata, and the sampler, loaded from BASE's files under other
module names and bound to the same model weights, KV cache and engine. Every other part (scheduler,
metrics, attention backend, linears) is this tree's on both sides. Steps alternate base/new; each
side's logits must equal the other's bit for bit (checked on every step), or the script stops.

  python scripts/ab_step_overhead.py --base 9527c2e --batches 1,16 --steps 40
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from datetime import datetime, timezone

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_step_overhead import decode_only, set_up  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..")


def load_base(rev: str, rel: str, name: str, into: str) -> types.ModuleType:
    path = os.path.join(into, os.path.basename(rel))
    with open(path, "wb") as f:
        f.write(subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{rel}"], check=True, capture_output=True).stdout)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--base", required=True, help="git revision of the code before")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40, help="timed steps, half on each side")
    a = ap.parse_args()
    torch.set_num_threads(1)

    from kvcli.bench.machine import machine_line
    from kvcli.engine.llm_engine import EngineOptions, LLMEngine
    from kvcli.model.loader import load_weights

    with tempfile.TemporaryDirectory() as tmp:
        b_layers = load_base(a.base, "kvcli/model/layers.py", "base_layers", tmp)
        b_llama = load_base(a.base, "kvcli/model/llama.py", "base_llama", tmp)
        b_sampler = load_base(a.base, "kvcli/sampler.py", "base_sampler", tmp)
        b_runner = load_base(a.base, "kvcli/runner/model_runner.py", "base_runner", tmp)
    b_runner.sample = b_sampler.sample  # the base runner imported this tree's sampler

    loaded = load_weights(None)
    model = LLMEngine(loaded, EngineOptions(device="cpu", kv_budget="16MiB")).model
    c = model.config
    base_model = copy.copy(model)  # the same weights; the base's rotary table and forward
    base_model.rotary = b_layers.Rotary(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling,
                                        model.device)
    base_model.forward = types.MethodType(b_llama.LlamaModel.forward, base_model)
    sample = open(os.path.join(ROOT, "samples", "keepers-log.txt"), encoding="utf-8").read()
    ids = loaded.tokenizer.encode(sample)

    rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", a.base], check=True, capture_output=True,
                         text=True).stdout.strip()
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    print(f"# Per-step overhead, before/after in one process — {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(machine_line())
    print(f"load average (1 min): {os.getloadavg()[0]:.2f}")
    print(f"command: python scripts/ab_step_overhead.py --base {a.base} --batches {a.batches} --warmup {a.warmup} "
          f"--steps {a.steps}")
    print(f"base {rev} (forward, rotary, runner packing, sampler) vs this tree at {head}; "
          f"model: bundled ({model.linear_mode}), compute fp32, context ~512 tokens, greedy")
    for batch in (int(b) for b in a.batches.split(",")):
        engine = set_up(model, loaded, batch, ids, a.warmup + a.steps + 4)
        runner = engine.runner
        new_execute = runner.execute
        sides = {
            "base": (base_model, types.MethodType(b_runner.ModelRunner.execute, runner)),
            "new": (model, new_execute),
        }

        def use(side: str) -> None:
            m, execute = sides[side]
            fwd = m.forward
            timer = {"forward": 0.0}

            def timed_forward(*args, **kwargs):
                t = time.thread_time()
                out = fwd(*args, **kwargs)
                timer["forward"] += time.thread_time() - t
                return out
            runner.model = types.SimpleNamespace(forward=timed_forward)
            runner.execute = execute
            use.timer = timer

        cpu: dict[str, list[float]] = {"base": [], "new": []}
        fwd: dict[str, list[float]] = {"base": [], "new": []}
        wall: dict[str, list[float]] = {"base": [], "new": []}
        for i in range(a.warmup + a.steps):
            side = ("base", "new")[i % 2]
            assert decode_only(engine) and len(engine.scheduler.running) == batch
            use(side)
            w, t = time.perf_counter(), time.thread_time()
            engine.step()
            c_s, w_s = time.thread_time() - t, time.perf_counter() - w
            if i >= a.warmup:
                cpu[side].append(c_s)
                wall[side].append(w_s)
                fwd[side].append(use.timer["forward"])
        # Bitwise check: the same step (same KV, positions) through both forwards.
        out = engine.scheduler.schedule()
        meta_args = b_runner.build_metadata(out, engine.kv_cache.block_size, model.device)
        rows = torch.tensor(meta_args[3], dtype=torch.int64)
        got = {s: sides[s][0].forward(meta_args[0], meta_args[1], engine.kv_cache, meta_args[2], runner.backend, rows)
               for s in sides}
        assert torch.equal(got["base"], got["new"]), "logits differ between base and new"
        runner.model, runner.execute = model, new_execute
        print(f"\n## batch {batch}: {len(cpu['new'])} timed steps per side, interleaved; medians")
        med = {s: statistics.median(cpu[s]) for s in cpu}
        for s in ("base", "new"):
            f, st = statistics.median(fwd[s]), med[s]
            print(f"{s:>4}: step {st * 1e3:7.2f} ms thread CPU ({batch / st:6.1f} tok/s), forward {f * 1e3:7.2f} ms, "
                  f"everything else {statistics.median(x - y for x, y in zip(cpu[s], fwd[s])) * 1e3:5.2f} ms; "
                  f"wall {statistics.median(wall[s]) * 1e3:7.2f} ms ({batch / statistics.median(wall[s]):6.1f} tok/s)")
        print(f"new/base step CPU time: {med['new'] / med['base']:.3f}  (decode tok/s by CPU time x{med['base'] / med['new']:.3f}); "
              f"logits of one more step through both forwards: bitwise equal")


if __name__ == "__main__":
    main()
