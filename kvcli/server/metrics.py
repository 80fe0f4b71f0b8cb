"""Prometheus exposition for `kvcli serve`, through prometheus_client.

Names and meanings follow vLLM's /metrics wherever vLLM has the metric (docs.vllm.ai "Production
Metrics"), with the same `model_name` label, so dashboards and `kvcli watch` read kvcli and vLLM alike.
What vLLM does not export, the vLLM paper's Fig. 2 breakdown of KV memory and the contiguous what-if,
is published under `kvcli:` names.

Two kinds of source: per-request histograms and counters are observed by the engine thread as tokens
come out (prometheus_client's metric objects are thread-safe); engine-wide state is read at scrape
time from the latest immutable `Snapshot` the engine thread published, so a scrape never touches the
engine itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvcli.metrics.snapshot import Snapshot

# No `_created` series: vLLM's exposition has none, and watchers have no use for them.
disable_created_metrics()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets for these histograms, so quantiles over kvcli and vLLM servers compare like for like.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


def _token_buckets(max_model_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to the context (vLLM's build_1_2_5_buckets)."""
    out, base = [], 1
    while True:
        for m in (1, 2, 5):
            if m * base > max_model_len:
                return tuple(out)
            out.append(float(m * base))
        base *= 10


class ServerMetrics:
    """The registry behind /metrics, its request-level metrics and the snapshot-backed collector."""

    def __init__(self, model_name: str, max_model_len: int, latest: Callable[[], Snapshot | None],
                 cache_info: dict[str, str]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             labels, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             labels, buckets=E2E_BUCKETS, registry=r).labels(model_name)
        tb = _token_buckets(max_model_len)
        self.req_prompt = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                    labels, buckets=tb, registry=r).labels(model_name)
        self.req_gen = Histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                 labels, buckets=tb, registry=r).labels(model_name)
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                labels + ["finished_reason"], registry=r)
        r.register(_SnapshotCollector(model_name, latest, cache_info))

    def finished(self, reason: str | None, e2e_s: float, prompt_tokens: int, output_tokens: int) -> None:
        """One finished request. vLLM counts aborted requests apart (not as successes), so does kvcli."""
        self.e2e.observe(e2e_s)
        self.req_prompt.observe(prompt_tokens)
        self.req_gen.observe(output_tokens)
        if reason in ("stop", "length"):
            self._success.labels(self.model_name, reason).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _SnapshotCollector(Collector):
    """Engine-wide gauges and counters, read from the latest snapshot at scrape time."""

    def __init__(self, model_name: str, latest: Callable[[], Snapshot | None], cache_info: dict[str, str]) -> None:
        self.model_name = model_name
        self.latest = latest
        self.cache_info = cache_info

    def describe(self) -> list[Metric]:
        return []  # families depend on the snapshot (the what-if exists for the paged layout only)

    def collect(self) -> Iterator[Metric]:
        m = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(m, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(m, value)
            return c

        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=["model_name", *self.cache_info])
        info.add_metric([self.model_name, *self.cache_info.values()], 1.0)
        yield info
        s = self.latest()
        if s is None:
            return
        usage = s.blocks_used / s.num_blocks if s.num_blocks else 0.0
        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", s.num_preempted)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      s.prefix_query_tokens)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      s.prefix_hit_tokens)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", s.generated_tokens)
        # kvcli's own: the pool in bytes and blocks, and the vLLM paper's Fig. 2 categories.
        yield gauge("kvcli:kv_pool_bytes", "Bytes of the KV pool (usable blocks and the null block).", s.kv_pool_bytes)
        yield gauge("kvcli:kv_blocks_usable", "Usable KV blocks in the pool.", s.num_blocks)
        yield gauge("kvcli:kv_blocks_used", "KV blocks held by requests now.", s.blocks_used)
        yield gauge("kvcli:kv_block_size_tokens", "Tokens per KV block.", s.block_size)
        yield gauge("kvcli:kv_bytes_per_token", "KV bytes per token over all layers (scales included).",
                    s.kv_bytes_per_token)
        yield gauge("kvcli:max_model_len", "Context length limit of a request.", s.max_model_len)
        yield gauge("kvcli:num_requests_swapped", "Requests whose blocks are swapped out to host memory.",
                    s.num_swapped)
        # A bounded cache (--kv-window): what each request keeps, and what the rule has given back so far.
        w = s.window
        yield counter("kvcli:kv_tokens_dropped", "Tokens whose KV a bounded cache (--kv-window) dropped, over all "
                      "requests.", w.dropped_tokens if w else 0)
        yield counter("kvcli:kv_blocks_recycled", "KV blocks a bounded cache (--kv-window) gave back to the pool.",
                      w.recycled_blocks if w else 0)
        if w is not None:
            yield gauge("kvcli:kv_window_tokens", "W of --kv-window: the recent tokens each request keeps.", w.window)
            yield gauge("kvcli:kv_sink_tokens", "Tokens each request keeps from its start (--sink-tokens in whole "
                        "blocks).", w.sink_slots)
            yield gauge("kvcli:kv_request_tokens_peak", "The most KV tokens one request has held.", w.peak_tokens)
        if s.cpu_threads:  # the CPU's kernels: their thread count now, and how often --threads auto changed it
            yield gauge("kvcli:cpu_threads", "CPU threads the kernels run on now (--threads).", s.cpu_threads)
            yield counter("kvcli:cpu_thread_switches", "Times --threads auto changed the kernels' thread count.",
                          s.thread_switches)
        yield from _breakdown("kvcli:kv", "the live KV layout", s.kv, m)
        if s.contiguous_whatif is not None:
            yield from _breakdown("kvcli:whatif_contiguous", "the running requests under max-length contiguous "
                                  "preallocation in a pool of the same size", s.contiguous_whatif, m)
            yield gauge("kvcli:whatif_contiguous_max_requests", "How many max-length contiguous regions the pool "
                        "holds at once.", s.whatif_fits or 0)


_PARTS = (("token_bytes", "holding a token's K/V"),
          ("reserved_bytes", "set aside for tokens a request has not produced yet"),
          ("internal_fragmentation_bytes", "allocated but never to hold a token"),
          ("external_fragmentation_bytes", "free but unusable by the next waiting request"),
          ("free_bytes", "free"))


def _breakdown(prefix: str, what: str, kv, labels: list[str]) -> Iterator[Metric]:
    values = (kv.token_bytes, kv.reserved_bytes, kv.internal_bytes, kv.external_bytes, kv.free_bytes)
    for (name, doc), v in zip(_PARTS, values):
        g = GaugeMetricFamily(f"{prefix}_{name}", f"KV bytes {doc}, in {what} (vLLM paper Fig. 2).",
                              labels=["model_name"])
        g.add_metric(labels, v)
        yield g
