"""Goal check for `kvcli serve` (issue #15): one request trace through the in-process engine and
through `kvcli serve` over HTTP (streamed /v1/completions, the client in this process), then the
server again with `kvcli watch` polling its /metrics at 4 Hz.

Goals: serve within 10 % of the in-process engine's output tokens/s, no request lost, every KV block
free afterwards (read from the server's /metrics); watch at 4 Hz costs under 5 % of the server's
throughput. Runs are ordered in-process, serve, serve + watch, serve + watch, serve, in-process,
so drift on a shared machine cancels in both comparisons. Raw output goes to stdout and, with --out, to a file headed by the date and machine line.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from kvcli.bench.machine import machine_line
from kvcli.engine.llm_engine import LLMEngine
from kvcli.model.loader import load_weights
from kvcli.options import EngineOptions
from kvcli.profile import run_trace
from kvcli.remote.loadgen import run_endpoint
from kvcli.remote.scrape import parse
from kvcli.workloads import load as load_trace, prompt_ids


def start_server(args: list[str]) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-m", "kvcli.cli", "serve", "--port", "0", *args],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for line in p.stderr:
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()  # drain
            return p, m.group(1)
    raise SystemExit(f"kvcli serve did not start (exit {p.wait()})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workload", default="alpaca")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--kv-budget", default="128MiB")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads for the engine, in-process and in "
                    "the server (default: torch's). 1 is steadier when other work shares the cores.")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    lines: list[str] = []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)
        if a.out is not None:  # rewritten after every line: an interrupted run still leaves its numbers
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text("\n".join(lines) + "\n")

    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
        os.environ["OMP_NUM_THREADS"] = str(a.threads)  # the server subprocess reads it at torch's start
    say(f"bench_serve · {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}")
    say(machine_line() + ("" if not a.threads else " (set for the engine in-process and in the server)"))
    say("note: measured while other work may share this machine's cores; treat the numbers as provisional")
    say(f"trace: {a.workload}, {a.num_requests} requests, all at t=0, max_model_len {a.max_model_len}, "
        f"kv-budget {a.kv_budget}, greedy, ignore_eos; client concurrency {a.concurrency}")
    opts = EngineOptions(kv_budget=a.kv_budget, max_model_len=a.max_model_len, max_num_seqs=a.concurrency)
    trace = load_trace(a.workload, a.num_requests, a.max_model_len, float("inf"), a.seed)
    loaded = load_weights(None)
    prompts = prompt_ids(trace, loaded.tokenizer, a.seed)
    total_out = sum(r.max_tokens for r in trace.requests)

    model = []  # building an engine consumes the loaded tensors: the second one reuses the first's model

    def in_process(tag: str) -> float:
        engine = LLMEngine(loaded, opts, model=model[0] if model else None)
        model[:] = [engine.model]
        res = run_trace(engine, trace, prompts, "in-process")
        say(f"in-process engine ({tag}) : {res.completed}/{res.num_requests} done, {res.output_tokens} tokens in "
            f"{res.wall_s:.1f} s = {res.tokens_per_s:.1f} tok/s · load avg {os.getloadavg()[0]:.1f}")
        return res.tokens_per_s

    inproc = [in_process("before")]

    server_args = ["--kv-budget", a.kv_budget, "--max-model-len", str(a.max_model_len),
                   "--max-num-seqs", str(a.concurrency)]
    proc, url = start_server(server_args)
    rates: dict[bool, list[float]] = {False: [], True: []}
    ok = True
    try:
        for with_watch in (False, True, True, False):
            watch = None
            if with_watch:
                watch = subprocess.Popen([sys.executable, "-m", "kvcli.cli", "watch", url, "--interval", "0.25",
                                          "--no-live", "--duration", "3600"], stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL)
                time.sleep(3)  # its startup (imports) is not part of what is measured
            run = asyncio.run(run_endpoint(url, trace, prompts, a.concurrency))
            if watch is not None:
                watch.send_signal(signal.SIGTERM)  # (SIGINT is ignored by a shell's background jobs)
                watch.wait(60)
            m = parse(httpx.get(f"{url}/metrics", timeout=10).text)
            lost = len(run.results) - run.completed
            tokens_ok = run.output_tokens == total_out
            free = m.blocks_used == 0 and m.running == 0 and m.waiting == 0
            ok &= lost == 0 and tokens_ok and free
            rates[with_watch].append(run.tokens_per_s)
            say(f"kvcli serve{' + watch 4 Hz' if with_watch else '             '} : {run.completed}/{len(run.results)} done, "
                f"{run.output_tokens} tokens ({'all' if tokens_ok else 'NOT all'} asked) in {run.wall_s:.1f} s = "
                f"{run.tokens_per_s:.1f} tok/s · after: {m.blocks_used} blocks used, running {m.running:.0f}, "
                f"waiting {m.waiting:.0f} · TTFT p50 {sorted(run.ttft)[len(run.ttft) // 2]:.2f} s · load avg {os.getloadavg()[0]:.1f}")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    inproc.append(in_process("after"))  # in-process before and after the server runs: drift cancels
    base = sum(inproc) / len(inproc)
    serve = sum(rates[False]) / len(rates[False])
    watched = sum(rates[True]) / len(rates[True])
    say(f"serve / in-process : {serve / base:.3f} (goal >= 0.90) -> {'met' if serve >= 0.9 * base else 'NOT met'}")
    say(f"watch overhead     : {1 - watched / serve:+.1%} of serve's tok/s (goal < 5 %) -> "
        f"{'met' if watched >= 0.95 * serve else 'NOT met'}")
    say(f"no request lost, all tokens, all blocks free after each run: {'yes' if ok else 'NO'}")


if __name__ == "__main__":
    main()
