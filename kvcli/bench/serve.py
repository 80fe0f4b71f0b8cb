"""Goal check for `kvcli serve` (issue #15): one request trace through the in-process engine and
through `kvcli serve` over HTTP (streamed /v1/completions, the client in this process), and the
server again with `kvcli watch` polling its /metrics at 4 Hz.

Goals: serve within 10 % of the in-process engine's output tokens/s, no request lost, every KV block
free afterwards (read from the server's /metrics); watch at 4 Hz costs under 5 % of the server's
throughput. The machine may be shared, so the three kinds of run are interleaved in rounds whose
order alternates (in-process, serve, serve + watch; then serve + watch, serve, in-process; ...), each
round's ratios are taken between its own runs, and the medians over rounds are the result: drift
in the machine's load hits both sides of a ratio about equally. Every run also reports the CPU
seconds it cost (engine process, server process, client), to say where a gap comes from.
Raw output goes to stdout and, with --out, to a file headed by the date and machine line.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import statistics
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


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workload", default="alpaca")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--kv-budget", default="128MiB")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of (in-process, serve, serve + watch)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for the engine, in-process and in "
                    "the server (default: torch's). 1 is steadier when other work shares the cores.")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
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
    say(f"bench_serve · {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC} · {' '.join(argv or []) or '(defaults)'}")
    say(machine_line() + ("" if not a.threads else " (set for the engine in-process and in the server)"))
    say(f"load average at start: {os.getloadavg()[0]:.1f} (the machine is shared; runs are interleaved, ratios "
        "taken within each round)")
    say(f"trace: {a.workload}, {a.num_requests} requests, all at t=0, max_model_len {a.max_model_len}, "
        f"kv-budget {a.kv_budget}, greedy, ignore_eos; client concurrency {a.concurrency}")
    opts = EngineOptions(kv_budget=a.kv_budget, max_model_len=a.max_model_len, max_num_seqs=a.concurrency)
    trace = load_trace(a.workload, a.num_requests, a.max_model_len, float("inf"), a.seed)
    loaded = load_weights(None)
    prompts = prompt_ids(trace, loaded.tokenizer, a.seed)
    total_out = sum(r.max_tokens for r in trace.requests)

    model = []  # building an engine consumes the loaded tensors: the next ones reuse the first's model

    def in_process() -> float:
        engine = LLMEngine(loaded, opts, model=model[0] if model else None)
        model[:] = [engine.model]
        c0 = time.process_time()
        res = run_trace(engine, trace, prompts, "in-process")
        cpu = time.process_time() - c0
        say(f"  in-process engine        : {res.completed}/{res.num_requests} done, {res.output_tokens} tokens in "
            f"{res.wall_s:.1f} s = {res.tokens_per_s:.1f} tok/s · CPU {cpu:.1f} s · load avg {os.getloadavg()[0]:.1f}")
        return res.tokens_per_s

    server_args = ["--kv-budget", a.kv_budget, "--max-model-len", str(a.max_model_len),
                   "--max-num-seqs", str(a.concurrency)]
    proc, url = start_server(server_args)
    ok = True

    def serve(with_watch: bool) -> float:
        nonlocal ok
        watch = None
        if with_watch:
            watch = subprocess.Popen([sys.executable, "-m", "kvcli.cli", "watch", url, "--interval", "0.25",
                                      "--no-live", "--duration", "3600"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
            time.sleep(3)  # its startup (imports) is not part of what is measured
        s0, c0 = cpu_seconds(proc.pid), time.process_time()
        w0 = cpu_seconds(watch.pid) if watch is not None else 0.0
        run = asyncio.run(run_endpoint(url, trace, prompts, a.concurrency))
        s_cpu, c_cpu = cpu_seconds(proc.pid) - s0, time.process_time() - c0
        w_cpu = cpu_seconds(watch.pid) - w0 if watch is not None else 0.0
        if watch is not None:
            watch.send_signal(signal.SIGTERM)  # (SIGINT is ignored by a shell's background jobs)
            watch.wait(60)
        m = parse(httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text)
        lost = len(run.results) - run.completed
        tokens_ok = run.output_tokens == total_out
        free = m.blocks_used == 0 and m.running == 0 and m.waiting == 0
        ok &= lost == 0 and tokens_ok and free
        say(f"  kvcli serve{' + watch 4 Hz' if with_watch else '             '} : {run.completed}/{len(run.results)} "
            f"done, {run.output_tokens} tokens ({'all' if tokens_ok else 'NOT all'} asked) in {run.wall_s:.1f} s = "
            f"{run.tokens_per_s:.1f} tok/s · CPU server {s_cpu:.1f} s, client {c_cpu:.1f} s"
            f"{f', watch {w_cpu:.2f} s' if watch is not None else ''} · after: {m.blocks_used} blocks used, running "
            f"{m.running:.0f}, waiting {m.waiting:.0f} · load avg {os.getloadavg()[0]:.1f}")
        return run.tokens_per_s

    kinds = {"in-process": in_process, "serve": lambda: serve(False), "serve+watch": lambda: serve(True)}
    order = list(kinds)
    ratio_serve: list[float] = []
    ratio_watch: list[float] = []
    try:
        for rnd in range(a.rounds):
            seq = order if rnd % 2 == 0 else order[::-1]
            say(f"round {rnd + 1}: {', '.join(seq)}")
            got = {k: kinds[k]() for k in seq}
            ratio_serve.append(got["serve"] / got["in-process"])
            ratio_watch.append(got["serve+watch"] / got["serve"])
            say(f"  serve / in-process {ratio_serve[-1]:.3f} · serve+watch / serve {ratio_watch[-1]:.3f}")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    rs, rw = statistics.median(ratio_serve), statistics.median(ratio_watch)
    say(f"serve / in-process : median {rs:.3f} over {len(ratio_serve)} rounds "
        f"({', '.join(f'{x:.3f}' for x in ratio_serve)}) (goal >= 0.90) -> {'met' if rs >= 0.9 else 'NOT met'}")
    say(f"watch overhead     : median {1 - rw:+.1%} of serve's tok/s ({', '.join(f'{1 - x:+.1%}' for x in ratio_watch)}) "
        f"(goal < 5 %) -> {'met' if rw > 0.95 else 'NOT met'}")
    say(f"no request lost, all tokens, all blocks free after each run: {'yes' if ok else 'NO'}")
