"""The bundled model through the real command line: `profile` without --simulate (and against
transformers with --compare hf) on a tiny trace, and `continue` drawing its dashboard on a terminal."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
KVCLI = [sys.executable, "-c", "from kvcli.cli import main; main()"]


def test_profile_real_model_against_transformers(tmp_path):
    trace = tmp_path / "tiny.jsonl"
    trace.write_text(json.dumps({"prompt": "The lighthouse keeper", "max_tokens": 3}) + "\n"
                     + json.dumps({"prompt": "Write one sentence about the sea.", "max_tokens": 4}) + "\n")
    js = tmp_path / "r.json"
    p = subprocess.run([*KVCLI, "profile", "--workload", str(trace), "--compare", "hf", "--no-live",
                        "--kv-budget", "64MiB", "--max-model-len", "256", "--json", str(js)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    run = json.loads(js.read_text())["runs"][0]
    assert run["layout"] == "paged" and run["simulated"] is False
    assert run["completed"] == 2 and run["output_tokens"] == 7 and run["output_tokens_per_s"] > 0
    assert run["ttft_s"]["p50"] > 0  # real time, not simulated steps
    out = " ".join(p.stdout.split())
    assert "kvcli profile · tiny" in out and "simulated" not in out
    assert "throughput against transformers" in out
    for mode in ("sequential", "static", "generate_batch"):
        assert f"transformers {mode}" in out
    # the kvcli row shows the run's rate (one decimal, the JSON two: both rounded from the same rate)
    shown = re.search(r"kvcli \(paged\) │ ([\d,.]+) │", out)
    assert shown is not None, out
    assert abs(float(shown.group(1).replace(",", "")) - run["output_tokens_per_s"]) <= 0.051


def test_continue_dashboard_on_a_terminal(tmp_path):
    """`kvcli continue` on a real terminal (a tmux pane) draws the live dashboard's panels."""
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed: no terminal to draw the dashboard on")
    src = tmp_path / "in.txt"
    src.write_text((REPO / "samples" / "keepers-log.txt").read_text(encoding="utf-8")[:1500])
    session = f"kvcli-test-{os.getpid()}"
    env = f"PYTHONPATH={shlex.quote(os.environ.get('PYTHONPATH', str(REPO)))} HF_HUB_OFFLINE=1"
    cmd = f"env {env} {' '.join(map(shlex.quote, KVCLI))} continue {shlex.quote(str(src))} -n 100; echo KVCLI-EXITED; sleep 60"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "140", "-y", "60", cmd], check=True)
    seen = ""
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            seen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True,
                                  text=True).stdout
            if all(panel in seen for panel in ("KV blocks", "KV fragmentation", "memory")) or "KVCLI-EXITED" in seen:
                break
            time.sleep(0.3)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    assert "KV blocks" in seen and "KV fragmentation" in seen and "memory" in seen, seen
    assert "Traceback" not in seen


def test_continue_log_lines_start_their_own_line_when_stdout_shares_stderr():
    """--no-live with stdout and stderr joined (a terminal, `2>&1`): the status lines on stderr, the last one
    printed as the run ends, start a line of their own instead of running on from the continuation's unfinished
    line; stdout alone holds only the continuation."""
    args = [*KVCLI, "continue", str(REPO / "samples" / "keepers-log.txt"), "-n", "12", "--no-live"]
    joined = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert joined.returncode == 0, joined.stdout
    lines = joined.stdout.splitlines()
    status = [i for i, line in enumerate(lines) if re.search(r"step \d+ · running \d+ waiting", line)]
    assert status and all(lines[i].startswith(("step ", "prefill ")) for i in status), joined.stdout
    # the first one comes while the prompt is prefilled, and says how far it has got
    assert re.match(r"prefill [\d,]+ of [\d,]+ tokens · step 1 · ", lines[status[0]]), lines[status[0]]
    assert lines[status[-1]].startswith("step ")  # the last one after it: no prefill to report
    apart = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert "step " not in apart.stdout and apart.stdout.endswith("\n") and apart.stdout.count("\n") >= 1
