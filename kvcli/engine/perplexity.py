"""Teacher-forced perplexity through the engine's own paged cache: whole text when it fits one
window, else sliding windows.

Windows start every `stride` tokens and hold up to `window` tokens. The first window scores all but
its first token; a later window scores only the tokens past the end of the window before it (each
token is scored once, with at least window - stride tokens of context). With stride == window
(the default) the windows do not overlap and each scores all but its first token.

Under a bounded cache (--kv-window W, --sink-tokens S: kvcache/retention.py) the whole text is one
stream instead: every token but the first is scored with the cache as its context (the sinks and the last
W to W + block - 1 tokens, chunks of at most W), and the result carries the most KV tokens any step held,
as the KV layout measured it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from kvcli.engine.llm_engine import LLMEngine
from kvcli.options import ConfigError


@dataclass(frozen=True)
class Window:
    start: int  # first token of the window
    end: int  # one past its last token
    first_scored: int  # absolute index of the first token it scores


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    mean_nll: float
    tokens_scored: int
    tokens_total: int
    windows: int
    window: int
    stride: int
    kv_dtype: str
    kv_bytes_per_token: int
    kv_window: int | None = None  # bounded cache only: W, S, and the most KV tokens a step held (measured)
    sink_tokens: int | None = None
    kv_tokens_peak: int | None = None


def windows(num_tokens: int, window: int, stride: int) -> list[Window]:
    if window < 2:
        raise ConfigError(f"--window must be at least 2 tokens (got {window})")
    if not 1 <= stride <= window:
        raise ConfigError(f"--stride must be in [1, window = {window}] (got {stride})")
    if num_tokens < 2:
        raise ConfigError(f"the text has {num_tokens} token(s); perplexity needs at least 2")
    out: list[Window] = []
    scored_to = 1  # tokens before this index are scored (or are the text's first token)
    start = 0
    while scored_to < num_tokens:
        end = min(start + window, num_tokens)
        first = max(scored_to, start + 1)
        if first < end:
            out.append(Window(start, end, first))
            scored_to = end
        start += stride
    return out


def perplexity(engine: LLMEngine, ids: list[int], window: int, stride: int,
               on_progress: Callable[[int], None] | None = None) -> PerplexityResult:
    r = engine.retention
    if r is not None:  # one stream through the bounded cache
        if len(ids) < 2:
            raise ConfigError(f"the text has {len(ids)} token(s); perplexity needs at least 2")
        nll = engine.score(ids, 1, on_progress)
        mean = float(nll.sum()) / nll.numel()
        return PerplexityResult(perplexity=math.exp(mean), mean_nll=mean, tokens_scored=int(nll.numel()),
                                tokens_total=len(ids), windows=1, window=len(ids), stride=len(ids),
                                kv_dtype=str(engine.kv_dtype),
                                kv_bytes_per_token=engine.config.kv_bytes_per_token(engine.kv_dtype),
                                kv_window=r.window, sink_tokens=r.sink_tokens, kv_tokens_peak=engine.kv.peak_slots)
    ws = windows(len(ids), window, stride)
    total = 0.0
    count = 0
    for w in ws:
        nll = engine.score(ids[w.start:w.end], w.first_scored - w.start, on_progress)
        total += float(nll.sum())
        count += int(nll.numel())
    mean = total / count
    return PerplexityResult(perplexity=math.exp(mean), mean_nll=mean, tokens_scored=count, tokens_total=len(ids),
                            windows=len(ws), window=window, stride=stride, kv_dtype=str(engine.kv_dtype),
                            kv_bytes_per_token=engine.config.kv_bytes_per_token(engine.kv_dtype))


def progress_total(num_tokens: int, window: int, stride: int) -> int:
    """Tokens the engine computes over all windows (for a progress bar)."""
    return sum(w.end - w.start for w in windows(num_tokens, window, stride))
