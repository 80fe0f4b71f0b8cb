"""llama.cpp's real server on the bundled GGUF with --metrics, driven like kvcli serve: `kvcli watch`
reads its llamacpp: metrics and `kvcli profile --endpoint` sends it a trace. `make test` builds llama-server
first (scripts/build_llama_server.sh, into the cache outside the clone, once); without it (a failed build, or
pytest run alone on a fresh machine) these skip, naming the path. $KVCLI_LLAMA_SERVER points elsewhere.
Everything on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import subprocess
import time

import httpx
import pytest
from typer.testing import CliRunner

from kvcli.bench.llama_server import candidates, find_llama_server
from kvcli.cli import app

LLAMA = find_llama_server()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    LLAMA is None, reason=f"llama.cpp's llama-server is not built (looked for {', '.join(map(str, candidates()))}); "
                          "run scripts/build_llama_server.sh")]
runner = CliRunner()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def llama_url(gguf_path, tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("llama-server") / "llama-server.log"
    with log.open("w") as f:
        proc = subprocess.Popen([str(LLAMA), "-m", str(gguf_path), "--host", "127.0.0.1", "--port", str(port),
                                 "--metrics", "-np", "4", "-c", "2048", "-t", "1", "-tb", "1"], stdout=f,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 120
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"llama-server exited ({proc.returncode}):\n{log.read_text()[-2000:]}")
            if time.monotonic() > end:
                pytest.fail(f"llama-server did not become healthy in 120 s:\n{log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_watch_reads_llamacpp_metrics(llama_url):
    r = runner.invoke(app, ["watch", llama_url, "--once"])
    assert r.exit_code == 0, r.output
    assert "llama.cpp" in r.stdout


def test_profile_endpoint_drives_llama_server(llama_url, tmp_path):
    from kvcli.remote.scrape import parse
    from kvcli.workloads import load

    asked = sum(r.max_tokens for r in load("alpaca", 4, 128).requests)  # the trace profile builds (seed 0)
    before = parse(httpx.get(f"{llama_url}/metrics", timeout=10, trust_env=False).text)
    rep = tmp_path / "r.json"
    r = runner.invoke(app, ["profile", "--endpoint", llama_url, "-w", "alpaca", "-N", "4", "--max-model-len", "128",
                            "--concurrency", "4", "--json", str(rep)])
    assert r.exit_code == 0, r.output
    run = json.loads(rep.read_text())["endpoints"][0]
    # ignore_eos and max_tokens were honoured: every asked token came back, as the client counts them
    assert run["completed"] == 4 and run["failures"] == 0
    assert run["output_tokens"] == asked
    assert run["ttft_s"]["p50"] is not None and run["ttft_s"]["p50"] > 0
    sm = run["server_metrics"]
    assert sm["flavor"] == "llama.cpp" and sm["samples"] >= 1
    # ... and as llama.cpp's own counter says, with every slot idle afterwards
    after = parse(httpx.get(f"{llama_url}/metrics", timeout=10, trust_env=False).text)
    assert after.generation_tokens - before.generation_tokens == asked
    assert after.running == 0 and after.waiting == 0
