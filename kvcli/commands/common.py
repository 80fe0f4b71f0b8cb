"""Building an engine from CLI options, with every expected failure turned into a one-line message."""

from __future__ import annotations

from collections.abc import Callable

from kvcli.engine.llm_engine import ConfigError, EngineOptions, LLMEngine, SUPPORTED_BLOCK_SIZES, parse_kv_budget
from kvcli.model.loader import ModelLoadError, load_weights

Fail = Callable[[str], None]


def validate_engine_flags(block_size: int, kv_budget: str | None, fail: Fail) -> None:
    """Checks that need no model, so bad flags fail before a slow load."""
    if block_size not in SUPPORTED_BLOCK_SIZES:
        fail(f"--block-size must be one of {', '.join(map(str, SUPPORTED_BLOCK_SIZES))} (got {block_size})")
    if kv_budget and kv_budget != "auto":
        try:
            parse_kv_budget(kv_budget)
        except ConfigError as e:
            fail(str(e))


def build_engine(model: str | None, quant: str, options: EngineOptions, fail: Fail) -> LLMEngine:
    try:
        loaded = load_weights(model, quant=quant)
        return LLMEngine(loaded, options)
    except (ModelLoadError, ConfigError) as e:
        fail(str(e))
    except MemoryError:
        fail("out of memory while loading the model (try a smaller --kv-budget or model)")
    raise AssertionError("unreachable")
