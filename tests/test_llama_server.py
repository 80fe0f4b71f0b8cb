"""llama.cpp's real server on the bundled GGUF with --metrics, driven like kvcli serve: `kvcli watch`
reads its llamacpp: metrics and `kvcli profile --endpoint` sends it a trace. Skipped until
scripts/build_llama_server.sh has built llama-server into .cache/llama.cpp (or KVCLI_LLAMA_SERVER
names a binary). Everything on 127.0.0.1."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from kvcli.cli import app

REPO = Path(__file__).resolve().parents[1]
LLAMA = Path(os.environ.get("KVCLI_LLAMA_SERVER", REPO / ".cache" / "llama.cpp" / "bin" / "llama-server"))
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not LLAMA.is_file(), reason=f"llama.cpp's llama-server is not built ({LLAMA}); run scripts/build_llama_server.sh")]
runner = CliRunner()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def llama_url(gguf_path):
    port = _free_port()
    proc = subprocess.Popen([str(LLAMA), "-m", str(gguf_path), "--host", "127.0.0.1", "--port", str(port),
                             "--metrics", "-np", "4", "-c", "2048"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 120
    while time.monotonic() < end:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("llama-server did not become healthy in 120 s")
    yield url
    proc.terminate()
    proc.wait(30)


def test_watch_reads_llamacpp_metrics(llama_url):
    r = runner.invoke(app, ["watch", llama_url, "--once"])
    assert r.exit_code == 0, r.output
    assert "llama.cpp" in r.stdout


def test_profile_endpoint_drives_llama_server(llama_url, tmp_path):
    rep = tmp_path / "r.json"
    r = runner.invoke(app, ["profile", "--endpoint", llama_url, "-w", "alpaca", "-N", "4", "--max-model-len", "128",
                            "--concurrency", "4", "--json", str(rep)])
    assert r.exit_code == 0, r.output
    run = json.loads(rep.read_text())["endpoints"][0]
    assert run["completed"] == 4 and run["output_tokens"] > 0
    assert run["server_metrics"]["flavor"] == "llama.cpp"
