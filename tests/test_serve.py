"""`kvcli serve` for real: the bundled model in a subprocess on a free loopback port, driven over HTTP
(completions, chat, streaming, bad requests, a client that goes away), then by `kvcli profile
--endpoint` and `kvcli watch`. One server for the module; it must shut down cleanly on SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from typer.testing import CliRunner

from cli_helpers import one_line_error
from kvcli.cli import app
from kvcli.remote.scrape import parse

pytestmark = pytest.mark.slow
MAX_LEN = 256
runner = CliRunner()


class ServeProcess:
    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "kvcli.cli", "serve", "--port", "0", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
        self.lines: list[str] = []
        self.url: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                self.url = m.group(1)
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float = 180) -> str:
        self._ready.wait(timeout)
        if self.url is None:
            self.proc.kill()
            raise RuntimeError("kvcli serve did not start:\n" + "".join(self.lines))
        return self.url

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)


@pytest.fixture(scope="module")
def server():
    s = ServeProcess("--kv-budget", "24MiB", "--max-model-len", str(MAX_LEN), "--max-num-seqs", "16")
    url = s.wait_ready()
    yield url
    rc = s.stop()
    time.sleep(0.2)
    assert rc == 0, "".join(s.lines)
    assert "kvcli serve: stopped" in "".join(s.lines)
    assert "Traceback" not in "".join(s.lines)


def metrics(url: str):
    return parse(httpx.get(f"{url}/metrics", timeout=10).text)


def wait_idle(url: str, timeout: float = 10.0):
    """The server's metrics once nothing runs or waits (an abort takes a step to land)."""
    end = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if (m.running == 0 and m.waiting == 0 and m.blocks_used == 0) or time.monotonic() > end:
            return m
        time.sleep(0.1)


def post(url: str, path: str, body) -> httpx.Response:
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(f"{url}{path}", content=data, headers={"Content-Type": "application/json"}, timeout=120)


def sse(text: str) -> list[dict | str]:
    out = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            payload = block[6:]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_models_health(server):
    assert httpx.get(f"{server}/health").status_code == 200
    data = httpx.get(f"{server}/v1/models").json()["data"]
    assert data[0]["id"].endswith(".gguf") and data[0]["max_model_len"] == MAX_LEN


def test_completion_stream_equals_whole(server):
    """Greedy: the streamed pieces join into the non-streamed text; usage counts every token."""
    body = {"prompt": "The keeper wrote in his log that", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    whole = post(server, "/v1/completions", body).json()
    assert whole["object"] == "text_completion" and whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == 12
    r = post(server, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.text)
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 12
    chunks = [e for e in events[:-2]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["usage"] is None for c in chunks)
    # vLLM's continuous_usage_stats: the usage so far on every chunk, rising to the total
    opts = {"include_usage": True, "continuous_usage_stats": True}
    events = sse(post(server, "/v1/completions", {**body, "stream": True, "stream_options": opts}).text)
    counts = [e["usage"]["completion_tokens"] for e in events[:-1]]
    assert counts == sorted(counts) and counts[-1] == 12 and counts[0] < 12
    assert all(e["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"] for e in events[:-1])
    # Token ids as the prompt (what profile --endpoint sends) give the same text.
    from kvcli.model.loader import load_tokenizer

    ids = load_tokenizer(None).encode(body["prompt"])
    by_ids = post(server, "/v1/completions", {**body, "prompt": ids}).json()
    assert by_ids["choices"][0]["text"] == whole["choices"][0]["text"]


def test_chat_uses_the_template(server):
    from kvcli.model.loader import load_tokenizer

    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    expect = len(load_tokenizer(None).apply_chat_template(msgs))
    whole = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 8, "temperature": 0}).json()
    assert whole["object"] == "chat.completion" and whole["usage"]["prompt_tokens"] == expect
    assert whole["choices"][0]["message"]["role"] == "assistant"
    r = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 8, "temperature": 0, "stream": True})
    events = sse(r.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1])
    assert text == whole["choices"][0]["message"]["content"] and events[-1] == "[DONE]"


@pytest.mark.parametrize("path,body,status,needle", [
    ("/v1/completions", "{not json", 400, "not valid JSON"),
    ("/v1/completions", {"prompt": "hi", "max_token": 5}, 400, "max_token: Extra inputs are not permitted"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": MAX_LEN}, 400, "maximum context length is 256"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt is empty"),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, 400, "outside the vocabulary"),
    ("/v1/completions", {"prompt": "hi", "n": 17}, 400, "at most 16 sequences"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "does not exist"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
])
def test_bad_requests(server, path, body, status, needle):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


def _first_chunk_then_drop(url: str, body: dict) -> None:
    with httpx.Client(timeout=60) as c, c.stream("POST", f"{url}/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                break  # leaving the block closes the connection mid-stream


def test_disconnect_aborts_and_frees_blocks(server):
    before = metrics(server)
    _first_chunk_then_drop(server, {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True,
                                    "stream": True})
    # A non-streamed request whose client goes away before the answer: a raw socket, closed early.
    host, port = server.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}).encode()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        end = time.monotonic() + 20
        while metrics(server).running == 0 and time.monotonic() < end:
            time.sleep(0.05)
        assert metrics(server).running >= 1
    after = wait_idle(server)
    assert after.running == 0 and after.blocks_used == 0 and after.detail.kv.token_bytes == 0
    # Neither ran to its 200 tokens: both were aborted early.
    assert after.generation_tokens - before.generation_tokens < 200


def test_metrics_have_vllm_names_and_kvcli_breakdown(server):
    text = httpx.get(f"{server}/metrics").text
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:cache_config_info", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "kvcli:kv_token_bytes", "kvcli:kv_internal_fragmentation_bytes",
                 "kvcli:whatif_contiguous_internal_fragmentation_bytes", "kvcli:whatif_contiguous_max_requests"):
        assert f"\n{name}" in text, name
    # promptool's rule: a gauge's name does not end in _total (that suffix is a counter's)
    gauges = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE") and line.endswith(" gauge")]
    assert "kvcli:kv_blocks_usable" in gauges and not [g for g in gauges if g.endswith("_total")], gauges
    m = parse(text)
    assert m.flavor == "kvcli" and m.ttft.count >= 1 and m.itl.count >= 1
    assert m.cache_info["block_size"] == "16" and int(m.cache_info["num_gpu_blocks"]) == m.blocks_total
    assert m.detail.kv.total_bytes == m.blocks_total * m.detail.pool_bytes // (m.blocks_total + 1)


def test_profile_endpoint_and_watch(server, tmp_path):
    """profile --endpoint drives the server while watch records it; every request completes, the
    server's blocks are all free afterwards, and both reports agree with the server's counters."""
    before = metrics(server)
    rec, rep = tmp_path / "watch.json", tmp_path / "profile.json"
    # watch runs as its own process (CliRunner redirects sys.stdout process-wide: two at once clash)
    # until SIGTERM after the trace (SIGINT would do, but a shell's background jobs ignore it); it prints
    # a line per scrape, the first once it is watching.
    watch = subprocess.Popen([sys.executable, "-m", "kvcli.cli", "watch", server, "--duration", "300",
                              "--interval", "0.25", "--record", str(rec), "--no-live"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    assert watch.stdout.readline().startswith("t=0.0s")
    r = runner.invoke(app, ["profile", "--endpoint", server, "--workload", "alpaca", "-N", "8", "--max-model-len",
                            "128", "--concurrency", "4", "--json", str(rep), "--seed", "3"])
    time.sleep(0.6)  # a couple of idle scrapes after the trace
    watch.send_signal(signal.SIGTERM)
    w_out, w_err = watch.communicate(timeout=60)
    assert r.exit_code == 0, r.output
    run = json.loads(rep.read_text())["endpoints"][0]
    assert run["completed"] == 8 and run["failures"] == 0
    sm = run["server_metrics"]
    assert sm["flavor"] == "kvcli" and sm["blocks_used_after"] == 0 and sm["peak_running"] >= 2
    after = wait_idle(server)
    assert after.generation_tokens - before.generation_tokens == run["output_tokens"]
    assert run["ttft_s"]["p50"] > 0 and run["itl_s"]["p50"] > 0
    assert watch.returncode == 143, w_err  # stopped by the signal; the record is still written
    samples = json.loads(rec.read_text())["samples"]
    span = samples[-1]["t"] - samples[0]["t"]
    assert len(samples) >= 2 * span  # 4 Hz asked; at least half of that on a busy machine
    assert max(s["running"] for s in samples) >= 2 and any(s["tok_s"] for s in samples)
    assert samples[-1]["running"] == 0 and samples[-1]["blocks_used"] == 0


def test_watch_once_shows_breakdown(server, tmp_path):
    png = tmp_path / "w.png"
    r = runner.invoke(app, ["watch", server, "--once", "--plot", str(png)])
    assert r.exit_code == 0, r.output
    assert "KV fragmentation" in r.stdout and "contiguous what-if" in r.stdout
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_serve_port_in_use_is_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        one_line_error(runner.invoke(app, ["serve", "--port", str(port)]), "address already in use")


def test_profile_endpoint_unreachable_is_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        one_line_error(runner.invoke(app, ["profile", "--endpoint", f"http://127.0.0.1:{port}", "-N", "2"]),
                       "cannot reach /v1/models")
