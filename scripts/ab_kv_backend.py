"""Whole-engine decode steps, torch attention backend of git revision BASE against this tree's, in one
process with steps interleaved (base, new, base, new, ...): a shared machine's load falls on both
sides alike. One engine per --kv-dtypes entry on the bundled model (INT4 weights), --batch requests
sharing a prefix of --context - 32 tokens (prefilled once through the prefix cache) plus their own
16-token tails, so every step decodes --batch rows at about --context tokens each. Only the engine's
attention backend object is swapped between steps (BASE's module is loaded from its git blob under
another name); everything else is this tree's. Timed by this thread's CPU time, 1 torch thread.
Outputs are not compared (one engine advances through both sides): the backends' numerics are the
tests' business (tests/test_torch_backend.py, tests/test_kv_dtype.py).

  python scripts/ab_kv_backend.py --base 8784ef9 --batch 16 --context 4096 --kv-dtypes fp32,int8
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def base_backend_class(rev: str, tmp: str):
    path = os.path.join(tmp, "torch_backend_base.py")
    blob = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:kvcli/attention/torch_backend.py"], check=True,
                          capture_output=True).stdout
    with open(path, "wb") as f:
        f.write(blob)
    spec = importlib.util.spec_from_file_location("torch_backend_base", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.TorchAttentionBackend


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git revision whose kvcli/attention/torch_backend.py is 'base'")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--kv-dtypes", default="fp32,int8")
    ap.add_argument("--pairs", type=int, default=8, help="timed base/new step pairs per KV dtype")
    a = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    from kvcli.attention.torch_backend import TorchAttentionBackend
    from kvcli.bench.machine import machine_line
    from kvcli.config import SamplingParams
    from kvcli.engine.llm_engine import EngineOptions, LLMEngine
    from kvcli.model.loader import load_weights

    with tempfile.TemporaryDirectory() as tmp:
        Base = base_backend_class(a.base, tmp)
    rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"# ab_kv_backend: base {a.base} vs tree at {rev}, batch {a.batch} at ~{a.context} context, "
          f"{a.pairs} interleaved step pairs per KV dtype, thread CPU time, 1 torch thread · "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"# {machine_line()}")
    loaded = load_weights(None)
    text = open(os.path.join(ROOT, "samples", "heldout-gpl-3.0.txt"), encoding="utf-8").read()
    ids = loaded.tokenizer.encode(text)
    prefix_len = a.context - 32
    prefix = ids[:prefix_len]
    model = None
    print("| KV dtype | base ms/step, median | new ms/step, median | median per-pair ratio new/base | pairs |")
    print("|---|---:|---:|---:|---|")
    for name in a.kv_dtypes.split(","):
        engine = LLMEngine(loaded, EngineOptions(kv_dtype=name, max_model_len=a.context + 64,
                                                 kv_budget="1GiB"), model=model)
        model = engine.model
        engine.add_request(prefix + ids[prefix_len:prefix_len + 16], SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        params = SamplingParams(max_tokens=2 * a.pairs + 8, ignore_eos=True)
        for b in range(a.batch):
            engine.add_request(prefix + ids[prefix_len + 16 * (b + 1):prefix_len + 16 * (b + 2)], params)
        while not all(len(r.output_token_ids) >= 1 for r in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        sides = {"base": Base(), "new": TorchAttentionBackend()}
        for s in sides.values():  # warm-up: scratch buffers, lazy init
            engine.runner.backend = s
            engine.step()
        times: dict[str, list[float]] = {"base": [], "new": []}
        for _ in range(a.pairs):
            for side, backend in sides.items():
                engine.runner.backend = backend
                assert len(engine.scheduler.running) == a.batch
                t = time.thread_time()
                engine.step()
                times[side].append((time.thread_time() - t) * 1e3)
        ratio = statistics.median(n / b for n, b in zip(times["new"], times["base"]))
        print(f"| {name} | {statistics.median(times['base']):.1f} | {statistics.median(times['new']):.1f} | "
              f"{ratio:.2f}x | " + " ".join(f"{b:.0f}/{n:.0f}" for b, n in zip(times["base"], times["new"])) + " |",
              flush=True)
        del engine


if __name__ == "__main__":
    main()
