"""/metrics parsing and `kvcli watch` against small local HTTP servers: vLLM's exposition (a fixture
in vLLM's documented format: vLLM cannot run here), garbage, and a server that turns bad mid-watch.
No model is loaded; every server is on 127.0.0.1."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli_helpers import one_line_error
from kvcli.cli import app
from kvcli.remote.scrape import Histogram, ScrapeError, parse

VLLM = (Path(__file__).parent / "data" / "vllm_metrics.txt").read_text()
runner = CliRunner()


def test_vllm_exposition_parsed():
    s = parse(VLLM)
    assert s.flavor == "vllm"
    assert s.running == 5 and s.waiting == 4  # two engines' series summed
    assert s.kv_usage == 0.25 and s.blocks_total == 4000 and s.blocks_used == 1000
    assert s.preemptions == 7 and s.prefix_hits == 250 and s.prefix_queries == 1000
    assert s.generation_tokens == 2048 and s.prompt_tokens == 5120
    assert s.cache_info["block_size"] == "16" and "engine" not in s.cache_info
    assert s.detail is None  # vLLM exports no breakdown
    # 50 of 100 TTFTs in (0.1, 0.25], 50 in (0.25, 0.5]: the median is the first bucket's top.
    assert s.ttft.quantile(0.5) == pytest.approx(0.25)
    assert s.ttft.quantile(0.75) == pytest.approx(0.375)
    assert s.itl.quantile(0.25) == pytest.approx(0.0175)  # 500th of 2000: halfway through (0.01, 0.025]
    assert s.itl.quantile(0.99) == pytest.approx(0.05)  # the open +Inf bucket: its lower bound


def test_histogram_delta_and_empty():
    a = Histogram(((0.1, 2.0), (1.0, 4.0), (float("inf"), 4.0)), 4.0, 1.0)
    b = Histogram(((0.1, 2.0), (1.0, 10.0), (float("inf"), 10.0)), 10.0, 5.0)
    d = b.minus(a)
    assert d.count == 6 and d.buckets[0][1] == 0  # the new observations all fell in (0.1, 1.0]
    assert d.quantile(0.5) == pytest.approx(0.55)
    assert Histogram((), 0.0, 0.0).quantile(0.5) is None
    assert b.minus(Histogram(((0.1, 50.0),), 50.0, 9.0)) is b  # counts fell (restart): no delta


LLAMACPP = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 300
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 900
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 4
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 2
"""


def test_llamacpp_exposition_parsed():
    """The names llama.cpp's server README documents for --metrics (this version has no KV usage)."""
    s = parse(LLAMACPP)
    assert s.flavor == "llama.cpp" and s.running == 4 and s.waiting == 2
    assert s.generation_tokens == 900 and s.prompt_tokens == 300
    assert s.kv_usage is None and s.ttft is None and s.preemptions is None


@pytest.mark.parametrize("body", ["<html><body>It works!</body></html>", "{\"status\": \"ok\"}",
                                  "# HELP x y\n# TYPE x gauge\nx 1\n"])
def test_garbage_is_a_scrape_error(body):
    with pytest.raises(ScrapeError):
        parse(body)


class _Server:
    """A tiny HTTP server on a free loopback port whose /metrics body the test can change."""

    def __init__(self, body: str, status: int = 200, then: str | None = None, after: int = 0) -> None:
        self.body, self.status = body, status
        self.served = 0
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                outer.served += 1
                if then is not None and outer.served > after:
                    outer.body = then  # turns bad after `after` good answers
                data = outer.body.encode()
                self.send_response(outer.status)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def vllm_server():
    s = _Server(VLLM)
    yield s
    s.close()


def test_watch_once_over_vllm(vllm_server):
    r = runner.invoke(app, ["watch", vllm_server.url, "--once"])
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "vllm" in out and "25.0%" in out and "1,000 of 4,000 x 16 tokens" in out
    assert "running 5 · waiting 4" in out
    assert "25.0% hit (250 of 1,000 tokens)" in out
    assert "breakdown and the contiguous what-if need per-request lengths" in out


def test_watch_keeps_last_sample_when_server_turns_bad(tmp_path):
    """Three good scrapes, then garbage: the run still ends normally, the view says what went wrong
    and the record holds the good samples and the errors."""
    server = _Server(VLLM, then="<html>oops</html>", after=3)
    rec = tmp_path / "t.json"
    try:
        r = runner.invoke(app, ["watch", server.url, "--duration", "1.5", "--interval", "0.1", "--record",
                                str(rec), "--no-live"])
    finally:
        server.close()
    assert r.exit_code == 0, r.output
    data = json.loads(rec.read_text())
    assert data["flavor"] == "vllm" and len(data["samples"]) == 3
    assert data["errors"] and "not Prometheus text" in data["errors"][-1]["message"]
    assert "showing the last good sample" in r.stdout
    assert "running 5 · waiting 4" in r.stdout  # the final view still shows the last good sample


def test_watch_ends_at_its_duration_inside_a_long_interval(vllm_server, tmp_path):
    """--duration 1 with --interval 30 once slept the whole interval (and a huge interval never ended): the run ends
    at its duration, with the first sample recorded and no scrape after it."""
    import time

    rec = tmp_path / "t.json"
    t0 = time.monotonic()
    r = runner.invoke(app, ["watch", vllm_server.url, "--duration", "1", "--interval", "30", "--record", str(rec),
                            "--no-live"])
    assert r.exit_code == 0, r.output
    assert time.monotonic() - t0 < 15
    assert len(json.loads(rec.read_text())["samples"]) == 1


def test_watch_unreachable_is_one_line(tmp_path):
    s = _Server("")
    url = s.url
    s.close()  # nothing listens there now
    one_line_error(runner.invoke(app, ["watch", url, "--once"]), "cannot watch")


def test_watch_garbage_at_start_is_one_line():
    s = _Server("<html>hello</html>")
    try:
        one_line_error(runner.invoke(app, ["watch", s.url, "--once"]), "not Prometheus text")
        s.body = "# TYPE up gauge\nup 1\n"  # valid exposition, but from no serving engine
        one_line_error(runner.invoke(app, ["watch", s.url, "--once"]), "no vLLM, kvcli or llama.cpp metrics")
        s.status = 404
        one_line_error(runner.invoke(app, ["watch", s.url, "--once"]), "HTTP 404")
    finally:
        s.close()


@pytest.mark.parametrize("args,needle", [(["--interval", "0"], "--interval must be > 0"),
                                         (["--duration", "-1"], "--duration must be > 0"),
                                         (["--record", "/nonexistent-dir/x.json"], "x.json")])
def test_watch_bad_flags(args, needle):
    one_line_error(runner.invoke(app, ["watch", "http://127.0.0.1:9", *args]), needle)
