"""Ctrl-C during `kvcli continue`: generation stops, what was produced is kept (stdout and -o),
the summary is printed and the exit code is 130."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

pytestmark = pytest.mark.slow


def test_sigint_keeps_output_and_prints_summary(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("The keeper wrote in his log every evening. Tonight he wrote about the storm and")
    out_file = tmp_path / "out.txt"
    cmd = [sys.executable, "-c", "from kvcli.cli import main; main()", "continue", str(src), "-n", "4000",
           "--no-live", "-o", str(out_file)]
    # SIGINT at its default in the child, as under a terminal: a shell's background job (`cmd &` without job
    # control, e.g. a CI runner's) starts with SIGINT ignored, the child inherits that, and Python then installs
    # no KeyboardInterrupt handler, so the Ctrl-C below would rightly be ignored.
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    chunks: list[str] = []

    def read() -> None:
        while True:
            c = p.stdout.read(1)
            if not c:
                return
            chunks.append(c)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    errs: list[str] = []  # stderr drained alongside, so that the reader above alone consumes stdout
    te = threading.Thread(target=lambda: errs.append(p.stderr.read()), daemon=True)
    te.start()
    deadline = time.time() + 180
    while len("".join(chunks).split()) < 20 and time.time() < deadline and p.poll() is None:
        time.sleep(0.2)
    assert p.poll() is None, "finished before it could be interrupted"
    os.kill(p.pid, signal.SIGINT)
    p.wait(timeout=60)  # not communicate(): it would read stdout too, racing the reader for the last tokens
    t.join(timeout=10)
    te.join(timeout=10)
    err = "".join(errs)
    assert p.returncode == 130, err
    assert "Traceback" not in err
    assert "kvcli continue (interrupted)" in err and "generated tokens" in err
    printed = "".join(chunks)
    kept = out_file.read_text()
    assert len(kept.split()) >= 20 and printed.rstrip("\n") == kept
