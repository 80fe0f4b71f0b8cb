"""One scrape of a server's /metrics, parsed with prometheus_client's parser and normalised into a
`ServerSample` that the views read: the same fields whatever served it.

Understood: vLLM (v1 names, and the v0 names where v1 renamed them), `kvcli serve` (vLLM's names plus
kvcli: ones for the KV breakdown and the contiguous what-if) and llama.cpp's server (`--metrics`,
llamacpp: names). Series that differ only in labels (model_name, engine) are summed: one number per
server, as a one-model deployment's dashboard shows it.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvcli.metrics.server import Histogram, KVDetail, ServerSample
from kvcli.metrics.snapshot import KVBreakdown

__all__ = ["Histogram", "KVDetail", "ScrapeError", "ServerSample", "parse"]


class ScrapeError(ValueError):
    """The body is not Prometheus text, or holds no metric kvcli understands."""


def _first(values: dict[str, float], *names: str) -> float | None:
    for n in names:
        if n in values:
            return values[n]
    return None


def parse(text: str, t: float = 0.0) -> ServerSample:
    values: dict[str, float] = {}
    hists: dict[str, dict[float, float]] = {}
    hsum: dict[str, float] = {}
    hcount: dict[str, float] = {}
    info: dict[str, str] = {}
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                name = s.name
                if fam.type == "histogram":
                    if name.endswith("_bucket"):
                        le = float(s.labels["le"])
                        b = hists.setdefault(fam.name, {})
                        b[le] = b.get(le, 0.0) + s.value
                    elif name.endswith("_sum"):
                        hsum[fam.name] = hsum.get(fam.name, 0.0) + s.value
                    elif name.endswith("_count"):
                        hcount[fam.name] = hcount.get(fam.name, 0.0) + s.value
                    continue
                if name.endswith("_created"):
                    continue
                if name == "vllm:cache_config_info":
                    info = {k: v for k, v in s.labels.items() if k not in ("model_name", "engine")}
                values[name] = values.get(name, 0.0) + s.value
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise ScrapeError(f"not Prometheus text ({e})") from None

    def hist(*names: str) -> Histogram | None:
        for n in names:
            if n in hists:
                return Histogram(tuple(sorted(hists[n].items())), hcount.get(n, 0.0), hsum.get(n, 0.0))
        return None

    if any(k.startswith("llamacpp:") for k in values):
        return _llamacpp(values, t)
    if not any(k.startswith(("vllm:", "kvcli:")) for k in (*values, *hists)):
        raise ScrapeError("no vLLM, kvcli or llama.cpp metrics in the response")
    flavor = "kvcli" if any(k.startswith("kvcli:") for k in values) else "vllm"
    total = _first(values, "kvcli:kv_blocks_usable", "kvcli:kv_blocks_total")  # the latter: kvcli before 2026-12-02
    if total is None and info.get("num_gpu_blocks", "").isdigit():
        total = float(info["num_gpu_blocks"])
    usage = _first(values, "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    used = values.get("kvcli:kv_blocks_used")
    if used is None and usage is not None and total is not None:
        used = round(usage * total)
    return ServerSample(
        t=t, flavor=flavor, kv_usage=usage, blocks_total=None if total is None else int(total),
        blocks_used=None if used is None else int(used),
        running=values.get("vllm:num_requests_running"), waiting=values.get("vllm:num_requests_waiting"),
        preemptions=_first(values, "vllm:num_preemptions_total"),
        prefix_queries=_first(values, "vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
        prefix_hits=_first(values, "vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
        prompt_tokens=values.get("vllm:prompt_tokens_total"),
        generation_tokens=values.get("vllm:generation_tokens_total"),
        ttft=hist("vllm:time_to_first_token_seconds"),
        itl=hist("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
        detail=_kvcli_detail(values), cache_info=info)


def _breakdown(values: dict[str, float], prefix: str) -> KVBreakdown | None:
    parts = ("token_bytes", "reserved_bytes", "internal_fragmentation_bytes", "external_fragmentation_bytes",
             "free_bytes")
    got = [values.get(f"{prefix}_{p}") for p in parts]
    if any(v is None for v in got):
        return None
    return KVBreakdown(*(int(v) for v in got))  # type: ignore[arg-type]


def _kvcli_detail(values: dict[str, float]) -> KVDetail | None:
    kv = _breakdown(values, "kvcli:kv")
    if kv is None:
        return None
    fits = values.get("kvcli:whatif_contiguous_max_requests")
    return KVDetail(kv=kv, whatif=_breakdown(values, "kvcli:whatif_contiguous"),
                    whatif_fits=None if fits is None else int(fits),
                    pool_bytes=int(values.get("kvcli:kv_pool_bytes", 0)),
                    bytes_per_token=int(values.get("kvcli:kv_bytes_per_token", 0)),
                    block_size=int(values.get("kvcli:kv_block_size_tokens", 0)),
                    max_model_len=int(values.get("kvcli:max_model_len", 0)))


def _llamacpp(values: dict[str, float], t: float) -> ServerSample:
    """llama.cpp's server: slots busy / deferred, token counters; KV usage where its version exports it
    (kv_cache_usage_ratio); no latency histograms, no preemptions (slots are preallocated)."""
    return ServerSample(
        t=t, flavor="llama.cpp", kv_usage=values.get("llamacpp:kv_cache_usage_ratio"), blocks_total=None,
        blocks_used=None, running=values.get("llamacpp:requests_processing"),
        waiting=values.get("llamacpp:requests_deferred"), preemptions=None, prefix_queries=None, prefix_hits=None,
        prompt_tokens=values.get("llamacpp:prompt_tokens_total"),
        generation_tokens=values.get("llamacpp:tokens_predicted_total"), ttft=None, itl=None)
