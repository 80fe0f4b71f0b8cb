"""What every command shares: its options object built and validated once, sampling parameters with
errors named after their flags, and engine construction with every expected failure turned into a
one-line message."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, NoReturn

from kvcli.config import SamplingParams
from kvcli.engine.llm_engine import LLMEngine
from kvcli.model.loader import ModelLoadError, load_weights
from kvcli.options import ConfigError, EngineOptions

Fail = Callable[[str], NoReturn]

_SAMPLING_FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temperature", "top_p": "--top-p",
                   "top_k": "--top-k", "seed": "--seed", "repetition_penalty": "--repetition-penalty",
                   "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty"}


def engine_options(fail: Fail, **values: Any) -> EngineOptions:
    """The command's EngineOptions; a bad value fails here, before any slow load."""
    try:
        return EngineOptions(**values)
    except ConfigError as e:
        fail(str(e))


def sampling_params(fail: Fail, **values: Any) -> SamplingParams:
    try:
        return SamplingParams(**values)
    except ValueError as e:
        msg = str(e)
        for field, flag in _SAMPLING_FLAGS.items():
            msg = msg.replace(field, flag)
        fail(msg)


def build_engine(model: str | None, quant: str, options: EngineOptions, fail: Fail) -> LLMEngine:
    try:
        loaded = load_weights(model, quant=quant)
        ctx = loaded.config.max_position_embeddings
        if options.max_model_len and options.max_model_len > ctx:
            loaded.notes.append(f"--max-model-len {options.max_model_len:,} is past the model's {ctx:,}-token context: "
                                f"{ctx:,} is used")
        print_notes(loaded.notes)
        return LLMEngine(loaded, options)
    except (ModelLoadError, ConfigError) as e:
        fail(str(e))
    except MemoryError:
        fail("out of memory while loading the model (try a smaller --kv-budget or model)")


def print_notes(notes: list[str]) -> None:
    for note in notes:
        print(f"kvcli: note: {note}", file=sys.stderr)
