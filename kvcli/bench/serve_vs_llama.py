"""kvcli serve beside llama.cpp's own server (issue #15): one `kvcli profile --endpoint URL1
--endpoint URL2` run sends the same request trace to both, one server after the other, and prints
the side-by-side table. Same model file (the bundled GGUF), same machine, same thread count, and
llama-server gets as many parallel slots (-np) as kvcli's --max-num-seqs, each slot holding
max_model_len tokens (-c = slots * max_model_len), so both can run the whole trace at once.

Memory: kvcli's KV pool and its breakdown come from its /metrics (kvcli: metrics); llama.cpp's
--metrics export no KV figure in this version, so its KV buffer size is quoted from llama-server's
own startup log, labelled as such.

  python -m kvcli.bench serve-vs-llama-server --threads 1 --out docs/results/serve-vs-llama-server-DATE.txt
llama-server: --llama-server PATH, else as kvcli/bench/llama_server.py finds it ($KVCLI_LLAMA_SERVER, else
where scripts/build_llama_server.sh builds it: ~/.cache/kvcli/llama-server/<version>-<isa>/bin).
Loopback only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from kvcli.bench.llama_server import candidates, find_llama_server
from kvcli.bench.machine import machine_line
from kvcli.model.loader import bundled_gguf_path
from kvcli.remote.scrape import parse

from kvcli.bench.serve import start_server as start_kvcli


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_args(gguf: Path, slots: int, max_model_len: int, threads: int | None) -> list[str]:
    args = ["-m", str(gguf), "-a", gguf.name, "--metrics", "-np", str(slots), "-c", str(slots * max_model_len),
            "--no-webui"]
    return args + (["-t", str(threads), "-tb", str(threads)] if threads else [])


def start_llama(binary: Path, args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [str(binary), *args, "--host", "127.0.0.1", "--port", str(port)]
    p = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 180
    while time.monotonic() < end:
        if p.poll() is not None:
            raise SystemExit(f"llama-server exited ({p.returncode}); log: {log}\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                return p, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    p.kill()
    raise SystemExit(f"llama-server not healthy in 180 s; log: {log}")


def peak_rss_mib(pid: int) -> float | None:
    """VmHWM (peak resident set) of a process, from /proc (Linux)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def stop(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(60)
    except subprocess.TimeoutExpired:
        p.kill()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", type=Path, default=None)
    ap.add_argument("--workload", default="alpaca")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--kv-budget", default="128MiB")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="kvcli's; llama-server gets as many slots (-np)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for both servers (torch threads for "
                    "kvcli, -t/-tb for llama-server); default: each one's own")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    binary = a.llama_server or find_llama_server()
    if binary is None or not binary.is_file():
        raise SystemExit(f"llama-server not found ({a.llama_server or ', '.join(map(str, candidates()))}); "
                         "run scripts/build_llama_server.sh")
    out: list[str] = []

    def say(s: str) -> None:
        print(s, flush=True)
        out.append(s)
        if a.out is not None:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text("\n".join(out) + "\n")

    env = dict(os.environ)
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
        env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = str(a.threads)
    gguf = bundled_gguf_path()
    say(f"bench_serve_vs_llama · {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC} · {' '.join(argv or []) or '(defaults)'}")
    say(machine_line() + (f" (kvcli serve's torch threads; llama-server -t {a.threads} -tb {a.threads})" if a.threads
                          else " (this process; each server uses its own default)"))
    say(f"load average at start: {os.getloadavg()[0]:.1f}")
    say(f"model: {gguf.name} (the same file for both)")
    tmp = Path(tempfile.mkdtemp(prefix="kvcli-vs-llama-"))
    llog = tmp / "llama-server.log"
    kv_args = ["--kv-budget", a.kv_budget, "--max-model-len", str(a.max_model_len), "--max-num-seqs",
               str(a.max_num_seqs)]
    kproc, kurl = start_kvcli(kv_args)
    lproc = None
    try:
        largs = llama_args(gguf, a.max_num_seqs, a.max_model_len, a.threads)
        # Its memory breakdown is logged only at verbosity 4, which also logs every slot's work: read
        # it from a start of the same command that is stopped once it listens, then start the
        # measured one at the default verbosity.
        probe, _ = start_llama(binary, [*largs, "-lv", "4"], tmp / "llama-server-lv4.log")
        stop(probe)
        lproc, lurl = start_llama(binary, largs, llog)
        say(f"kvcli serve {' '.join(kv_args)}  -> {kurl}")
        say(f"{binary.name} {' '.join(largs).replace(str(gguf), gguf.name)}  -> {lurl}")
        ver = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
        say("llama-server --version: " + " · ".join(x.strip() for x in (ver.stdout + ver.stderr).splitlines()
                                                     if x.strip() and "version" in x.lower()))
        before = {u: parse(httpx.get(f"{u}/metrics", timeout=10, trust_env=False).text) for u in (kurl, lurl)}
        rep = tmp / "profile.json"
        cmd = [sys.executable, "-m", "kvcli.cli", "profile", "--endpoint", kurl, "--endpoint", lurl,
               "-w", a.workload, "-N", str(a.num_requests), "--max-model-len", str(a.max_model_len),
               "--concurrency", str(a.concurrency), "--seed", str(a.seed), "--json", str(rep)]
        say("$ kvcli " + " ".join(cmd[3:]).replace(str(rep), "r.json"))
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**env, "COLUMNS": "120"})
        for line in r.stdout.rstrip().splitlines():
            say(line)
        say(f"(exit {r.returncode}; load average after: {os.getloadavg()[0]:.1f})")
        if r.returncode != 0 and not rep.exists():
            raise SystemExit("kvcli profile --endpoint failed")
        report = json.loads(rep.read_text())
        rss = {"kvcli serve": peak_rss_mib(kproc.pid), "llama-server": peak_rss_mib(lproc.pid)}
    finally:
        stop(kproc)
        if lproc is not None:
            stop(lproc)

    say("")
    say("KV memory")
    k = before[kurl].detail
    if k is not None:
        say(f"  kvcli serve : pool {k.pool_bytes / 2**20:.1f} MiB ({before[kurl].blocks_total} blocks of "
            f"{k.block_size} tokens, {k.bytes_per_token} B/token), from its /metrics")
    for ep in report["endpoints"]:
        sm = ep["server_metrics"]
        if sm.get("kv_token_share_of_allocated") is not None:
            wi = sm.get("whatif_token_share_of_allocated")
            say(f"  kvcli serve : peak KV usage {sm['peak_kv_usage']:.1%} of the pool; over the run, token states "
                f"{sm['kv_token_share_of_allocated']:.1%} of allocated KV, internal fragmentation "
                f"{sm['kv_internal_share_of_allocated']:.1%}"
                + (f"; the same requests under max-length contiguous preallocation: token states {wi:.1%}"
                   if wi is not None else ""))
    kv_lines = [re.sub(r"^[\d.]+ \w ", "", ln.strip()) for ln in
                (tmp / "llama-server-lv4.log").read_text(errors="replace").splitlines()
                if re.search(r"memory breakdown|- Host|n_slots|n_ctx_seq +=|KV buffer size|llama_kv_cache: size|"
                             r"compute buffer size", ln)]
    say(f"  llama.cpp   : its /metrics export no KV figure (flavor {before[lurl].flavor}, kv_usage "
        f"{before[lurl].kv_usage}); from llama-server's startup log (same command, -lv 4):")
    for ln in list(dict.fromkeys(kv_lines))[:10]:  # (it prints the breakdown twice)
        say(f"                {ln}")
    say("  peak resident memory of each server process after the run (VmHWM): "
        + ", ".join(f"{k} {'n/a' if v is None else f'{v:,.0f} MiB'}" for k, v in rss.items()))
