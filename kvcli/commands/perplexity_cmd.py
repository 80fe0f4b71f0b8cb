"""`kvcli perplexity FILE`: teacher-forced perplexity through kvcli's own paged engine (chunked
prefill, any --kv-dtype), over the whole text or over sliding windows."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from kvcli.model.tokenizer import document_ids
from kvcli.commands.common import Fail, build_engine
from kvcli.engine.perplexity import perplexity, progress_total
from kvcli.inputs import InputError, read_text_file
from kvcli.options import ConfigError, EngineOptions


@dataclass(frozen=True)
class PerplexityArgs:
    file: Path
    window: int | None  # None: the context length
    stride: int | None  # None: the window (no overlap)
    json_out: bool
    model: str | None
    quant: str
    options: EngineOptions


def run_perplexity(a: PerplexityArgs, fail: Fail) -> int:
    err = Console(stderr=True)
    try:
        text = read_text_file(a.file)
    except InputError as e:
        fail(str(e))
    with err.status("loading model…", spinner="dots"):
        engine = build_engine(a.model, a.quant, a.options, fail)
    ids = document_ids(engine.tokenizer, text, literal=True)  # as llama.cpp's perplexity reads a document
    if engine.retention is not None and (a.window or a.stride):
        fail("--window/--stride (windowed recomputation) and --kv-window (one stream through a bounded cache) "
             "are two ways to score a long text: give one")
    window = a.window or engine.max_model_len
    if window > engine.max_model_len:
        fail(f"--window {window} is longer than the {engine.max_model_len}-token context")
    stride = a.stride or window
    try:
        total = len(ids) if engine.retention is not None else progress_total(len(ids), window, stride)
        with Progress(TextColumn("scoring"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
                      TimeRemainingColumn(), console=err, transient=True,
                      disable=a.json_out or not err.is_terminal) as bar:
            task = bar.add_task("score", total=total)
            result = perplexity(engine, ids, window, stride, lambda n: bar.advance(task, n))
    except ConfigError as e:
        fail(str(e))
    if a.json_out:
        print(json.dumps(asdict(result) | {"model": engine.source, "file": str(a.file)}, indent=2))
        return 0
    if result.kv_window is not None:
        print(f"perplexity {result.perplexity:.4f}  (mean NLL {result.mean_nll:.5f} nats/token)")
        print(f"scored {result.tokens_scored:,} of {result.tokens_total:,} tokens as one stream through a bounded KV "
              f"cache: {result.sink_tokens} sink tokens (whole blocks) + a {result.kv_window:,}-token window; at "
              f"most {result.kv_tokens_peak:,} KV tokens held")
        print(f"KV {result.kv_dtype}: {result.kv_bytes_per_token:,} B per token · weights {engine.linear_mode} · "
              f"{Path(engine.source).name}")
        return 0
    per_window = ("the whole text in one window" if result.windows == 1 else
                  f"{result.windows} windows of {window:,} tokens, stride {stride:,}")
    print(f"perplexity {result.perplexity:.4f}  (mean NLL {result.mean_nll:.5f} nats/token)")
    print(f"scored {result.tokens_scored:,} of {result.tokens_total:,} tokens: {per_window}; all but the first "
          f"token of each window are scored" + ("" if stride == window else
                                                ", overlapping windows score only their new tokens"))
    print(f"KV {result.kv_dtype}: {result.kv_bytes_per_token:,} B per token · weights {engine.linear_mode} · "
          f"{Path(engine.source).name}")
    return 0
