"""A request trace sent to OpenAI-compatible servers, measured at the client.

Each request is a streamed POST /v1/completions with the prompt as token ids (every server sees the
same tokens; vLLM and llama.cpp's server accept ids as kvcli serve does), `ignore_eos` so outputs run
to their drawn length, and greedy sampling. Arrivals follow the trace (Poisson or all at once); at
most `concurrency` requests are in flight. TTFT is the time to the first streamed text, ITL the gaps
between later chunks. The server's /metrics is sampled meanwhile. Only the given URL is contacted.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from kvcli.metrics.server import Timeline
from kvcli.remote.auth import auth_headers, refused_key
from kvcli.remote.scrape import ScrapeError, parse
from kvcli.workloads import Trace


class EndpointError(RuntimeError):
    pass


@dataclass
class RequestResult:
    ok: bool
    output_tokens: int = 0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    error: str | None = None


@dataclass
class EndpointRun:
    url: str
    model: str
    results: list[RequestResult]
    wall_s: float
    timeline: Timeline
    scrape_errors: int = 0

    @property
    def completed(self) -> int:
        return sum(r.ok for r in self.results)

    @property
    def failures(self) -> int:
        return len(self.results) - self.completed

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.results if r.ok)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def ttft(self) -> list[float]:
        return [r.ttft_s for r in self.results if r.ok and r.ttft_s is not None]

    @property
    def itl(self) -> list[float]:
        return [x for r in self.results if r.ok for x in r.itl_s]


def base_url(url: str) -> str:
    url = url.strip().rstrip("/")
    for suffix in ("/v1", "/metrics"):
        if url.endswith(suffix):
            url = url[: -len(suffix)]
    return url if url.startswith(("http://", "https://")) else "http://" + url


def model_id(url: str, api_key: str | None = None) -> str:
    """The first model the server lists (vLLM needs it in each request); fails when it cannot say."""
    import httpx

    url = base_url(url)
    try:
        r = httpx.get(f"{url}/v1/models", timeout=10.0, trust_env=False, headers=auth_headers(api_key))
    except httpx.HTTPError as e:
        raise EndpointError(f"{url}: cannot reach /v1/models ({type(e).__name__}: {e})") from None
    if r.status_code in (401, 403):
        raise EndpointError(f"{url}/v1/models: HTTP {r.status_code}{refused_key(r.status_code, api_key)}")
    try:
        data = r.json()["data"]
        return str(data[0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise EndpointError(f"{url}/v1/models: HTTP {r.status_code}, not an OpenAI model list") from None


async def _one(client, url: str, model: str, prompt: list[int], max_tokens: int) -> RequestResult:
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    itl: list[float] = []
    chunks = 0
    usage_tokens = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode("utf-8", "replace")[:200]
                return RequestResult(False, error=f"HTTP {r.status_code}: {text}", latency_s=time.perf_counter() - t0)
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                obj = json.loads(payload)
                if "error" in obj:
                    return RequestResult(False, error=str(obj["error"])[:200], latency_s=time.perf_counter() - t0)
                if obj.get("usage"):
                    usage_tokens = obj["usage"].get("completion_tokens")
                choices = obj.get("choices") or []
                if choices and choices[0].get("text"):
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        itl.append(now - last)
                    last = now
                    chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return RequestResult(False, error=f"{type(e).__name__}: {e}", latency_s=time.perf_counter() - t0)
    tokens = usage_tokens if isinstance(usage_tokens, int) else chunks
    return RequestResult(True, tokens, None if first is None else first - t0, itl, time.perf_counter() - t0)


async def _sample_metrics(client, url: str, tl: Timeline, t0: float, interval: float, stop: asyncio.Event) -> int:
    import httpx

    errors = 0
    while not stop.is_set():
        try:
            r = await client.get(f"{url}/metrics", timeout=5.0)
            if r.status_code == 200:
                tl.add(parse(r.text, time.perf_counter() - t0))
            else:
                errors += 1
        except (httpx.HTTPError, ScrapeError):
            errors += 1
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass
    return errors


async def run_endpoint(url: str, trace: Trace, prompts: list[list[int]], concurrency: int, model: str | None = None,
                       metrics_interval: float = 0.5, request_timeout: float = 600.0,
                       api_key: str | None = None) -> EndpointRun:
    import httpx

    url = base_url(url)
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(request_timeout, connect=10.0), limits=limits,
                                 trust_env=False, headers=auth_headers(api_key)) as client:
        if model is None:
            model = await asyncio.to_thread(model_id, url, api_key)
        tl = Timeline(f"{url}/metrics")
        sem = asyncio.Semaphore(concurrency)
        stop = asyncio.Event()
        t0 = time.perf_counter()
        sampler = asyncio.create_task(_sample_metrics(client, url, tl, t0, metrics_interval, stop))

        async def fire(req, ids) -> RequestResult:
            delay = t0 + req.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with sem:
                return await _one(client, url, model, ids, req.max_tokens)

        results = await asyncio.gather(*(fire(r, p) for r, p in zip(trace.requests, prompts)))
        wall = time.perf_counter() - t0
        stop.set()
        errors = await sampler
        # One last sample after the trace: what the server holds once every request has ended.
        try:
            r = await client.get(f"{url}/metrics", timeout=5.0)
            if r.status_code == 200:
                tl.add(parse(r.text, time.perf_counter() - t0))
        except (httpx.HTTPError, ScrapeError):
            errors += 1
    return EndpointRun(url, model, list(results), wall, tl, errors)
