"""The flags that build an engine, declared once and shared by every command that takes them.

Each flag is one `Flag`: its Typer option (name, help text, type), its default and the EngineOptions field
it sets. A command names the flags it takes with `@engine_flags(...)`; the decorator adds them to the
command's signature (where its `engine` parameter stands, in the order named) and hands the command one
`EngineFlags` holding their values. The command builds its EngineOptions from that with
`engine.options(fail, **overrides)` where it wants its options validated (a bad value is one line naming
the flag), so the order of its checks does not change:

    @app.command("perplexity")
    @engine_flags("model", "block_size", "kv_budget", "kv_dtype", ...)
    def perplexity(file: ..., window: ... = None, engine: EngineFlags = NO_FLAGS) -> None:
        options = engine.options(fail, prefix_caching=False)

A command whose flag means something of its own (plan's --kv-dtype, a format to plan for; profile's, a
list of formats) declares that parameter itself and passes its value as an override. A per-command
default or help text is a `flag.but(...)` given by keyword: `@engine_flags(..., max_num_seqs=256)`.

Only typer is imported here (`kvcli --help` stays fast); EngineOptions is built through
commands/common.py on first use.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from types import MappingProxyType
from typing import TYPE_CHECKING, Annotated, Any, Optional, TypeVar

import typer

if TYPE_CHECKING:
    from kvcli.commands.common import Fail
    from kvcli.options import EngineOptions


class Backend(str, Enum):
    auto = "auto"
    torch = "torch"
    triton = "triton"
    invariant = "invariant"


class Quant(str, Enum):
    auto = "auto"
    nf4 = "nf4"
    int4 = "int4"
    none = "none"


class Layout(str, Enum):
    paged = "paged"
    contiguous = "contiguous"


class Reserve(str, Enum):
    max_len = "max-len"
    request = "request"


class Preempt(str, Enum):
    recompute = "recompute"
    swap = "swap"


class Speculate(str, Enum):
    none = "none"
    ngram = "ngram"


class DraftLength(str, Enum):
    adaptive = "adaptive"
    fixed = "fixed"


@dataclass(frozen=True)
class Flag:
    """One engine flag: the command-line parameter `param`, its type and typer.Option, its default, and the
    EngineOptions field it sets (None: not an EngineOptions field: --model and --quant pick the weights)."""

    param: str
    type: Any
    option: Any  # a typer.Option(...) (an OptionInfo)
    default: Any
    sets: str | None = None  # the EngineOptions field

    def but(self, **changes: Any) -> "Flag":
        """This flag with another default, help text or show_default (one command's variant)."""
        option = copy.copy(self.option)
        for name in ("help", "show_default"):
            if name in changes:
                setattr(option, name, changes.pop(name))
        return replace(self, option=option, **changes)

    def parameter(self) -> inspect.Parameter:
        return inspect.Parameter(self.param, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                 annotation=Annotated[self.type, self.option], default=self.default)

    def value(self, given: Any) -> Any:
        """The EngineOptions value of what was given on the command line."""
        return given.value if isinstance(given, Enum) else given


def _flags(*flags: Flag) -> dict[str, Flag]:
    return {f.param: f for f in flags}


FLAGS: Mapping[str, Flag] = MappingProxyType(_flags(
    Flag("model", Optional[str], typer.Option(
        "--model", "-m", help="A .gguf file, a Hugging Face checkpoint folder, or dummy:NAME "
        "(smollm2-135m, llama-2-7b, llama-2-13b, llama-3-8b, mistral-7b, gemma-3-4b, gemma-3-270m, gemma-2-2b, "
        "qwen2-0.5b, or a config.json). "
        "Default: the bundled SmolLM2-135M-Instruct Q4_1.", show_default=False), None),
    Flag("quant", Quant, typer.Option(
        "--quant", help="For Hugging Face checkpoints: nf4 (bitsandbytes), int4 (kvcli's group-wise "
        "Q4_1-style linears, an 8-bit vocabulary table: its integer kernel on the CPU) or none; auto = int4 "
        "on a machine without CUDA (NF4 decodes ~8x slower on the CPU: docs/benchmarks.md), nf4 with CUDA "
        "when bitsandbytes is installed, else int4 (with a note). GGUF files keep their own quantization."),
        Quant.auto),
    Flag("block_size", int, typer.Option("--block-size", help="Tokens per KV block."), 16, "block_size"),
    Flag("kv_budget", Optional[str], typer.Option(
        "--kv-budget", help="Bytes for the KV pool (2GiB, 512MB) or a fraction of free memory (0.5). "
        "Default: 90% of free GPU memory; on CPU min(1GiB, four full contexts).", show_default=False),
        None, "kv_budget"),
    Flag("kv_dtype", Optional[str], typer.Option(
        "--kv-dtype", help="KV cache format: auto, fp32, fp16, bf16, int8 or fp8 (e4m3; codes + one fp32 "
        "scale per token and KV head: 0.53x fp16's bytes; fp8 on the Triton backend needs compute capability "
        ">= 8.9). auto: fp16 on CPU for quantized weights where kvcli's C decode-attention kernel runs (as "
        "llama.cpp), else the compute dtype (fp32 on CPU, and always with --dequantize).", show_default=False),
        None, "kv_dtype"),
    Flag("max_model_len", Optional[int], typer.Option(
        "--max-model-len", help="Context length limit. Default: the model's.", show_default=False),
        None, "max_model_len"),
    Flag("max_batch_tokens", int, typer.Option(
        "--max-batch-tokens", help="Tokens computed per engine step; long prompts are prefilled in chunks of "
        "this size."), 512, "max_num_batched_tokens"),
    Flag("max_num_seqs", int, typer.Option("--max-num-seqs", help="Most requests running at once."), 64,
         "max_num_seqs"),
    Flag("kv_layout", Layout, typer.Option(
        "--kv-layout", help="paged, or contiguous preallocation (for comparison)."), Layout.paged, "kv_layout"),
    Flag("reserve", Reserve, typer.Option(
        "--reserve", help="Contiguous layout: reserve max_model_len slots per request, or prompt + max_tokens."),
        Reserve.max_len, "reserve"),
    Flag("preempt", Preempt, typer.Option(
        "--preempt", help="When blocks run out: recompute the preempted request later, or swap its blocks to "
        "host memory."), Preempt.recompute, "preempt"),
    Flag("dequantize", bool, typer.Option(
        "--dequantize", help="Expand INT4 weights to dense fp32 once at load: exact against transformers, "
        "about 8x the weight memory, faster on some CPUs."), False, "dequantize"),
    Flag("device", Optional[str], typer.Option(
        "--device", help="cpu or cuda[:N]. Default: cuda when available.", show_default=False), None, "device"),
    Flag("attention_backend", Backend, typer.Option(
        "--attention-backend", help="Paged attention implementation: triton on CUDA, torch on CPU when auto. "
        "invariant (CPU): every row computed the same way whatever the batch, so speculation, preemption and "
        "batching give bit-identical greedy text; slower."), Backend.auto, "attention_backend"),
    Flag("cuda_graphs", bool, typer.Option(
        "--cuda-graphs/--no-cuda-graphs", help="On CUDA with the Triton backend, replay decode steps from CUDA "
        "graphs (one per batch-size bucket, captured at first use) instead of launching every kernel from "
        "Python; --no-cuda-graphs launches eagerly (for comparison or debugging)."), True, "cuda_graphs"),
    Flag("prefix_cache", bool, typer.Option(
        "--prefix-cache/--no-prefix-cache", help="Reuse the KV blocks of prompt prefixes seen before (paged "
        "layout)."), True, "prefix_caching"),
    Flag("speculate", Speculate, typer.Option(
        "--speculate", help="Speculative decoding. ngram: guess the next tokens by prompt lookup (the last "
        "tokens matched earlier in the prompt and output) and verify them in one step; greedy output is "
        "unchanged, sampling keeps its distribution."), Speculate.none, "speculate"),
    Flag("num_speculative_tokens", int, typer.Option(
        "--num-speculative-tokens", help="Most tokens guessed per step (they count against "
        "--max-batch-tokens)."), 5, "num_speculative_tokens"),
    Flag("draft_length", DraftLength, typer.Option(
        "--draft-length", help="adaptive: each step verifies as many of the guesses (1 up to "
        "--num-speculative-tokens) as the request's recent acceptance and this engine's measured step times make "
        "fastest; fixed: always up to --num-speculative-tokens."), DraftLength.adaptive, "draft_length"),
    Flag("ngram_min", int, typer.Option("--ngram-min", help="Shortest suffix matched by prompt lookup."), 2,
         "ngram_min"),
    Flag("ngram_max", int, typer.Option(
        "--ngram-max", help="Longest suffix matched by prompt lookup (longest match first)."), 4, "ngram_max"),
    Flag("kv_window", Optional[str], typer.Option(
        "--kv-window", help="Bound each request's KV: keep its first --sink-tokens tokens and its last W tokens, "
        "giving the blocks between back to the pool, so a text longer than the context streams through (rotary "
        "positions stay inside the context: kept keys are re-rotated as blocks drop). A number of tokens, auto "
        "(the context less the sink blocks and a margin) or none (a text must fit the context). Default: auto on "
        "chat (a conversation past the context goes on), none on serve, perplexity and profile.",
        show_default=False), None, "kv_window"),
    Flag("threads", str, typer.Option(
        "--threads", help="CPU threads for the kernels: a number, or auto (every core torch uses, and fewer while "
        "that decodes faster: when another process holds a core, each step waits on the thread sharing it; the "
        "engine times decode steps at the other count every few seconds and keeps the faster)."), "auto",
        "threads"),
    Flag("sink_tokens", int, typer.Option(
        "--sink-tokens", help="With --kv-window: the first tokens always kept (attention sinks, StreamingLLM); "
        "rounded up to whole KV blocks."), 4, "sink_tokens"),
))

# Flag groups several commands take together.
SPECULATION = ("speculate", "num_speculative_tokens", "draft_length", "ngram_min", "ngram_max")
RETENTION = ("kv_window", "sink_tokens")


@dataclass(frozen=True)
class EngineFlags:
    """The engine flags a command was given (param -> value as parsed), and what they build."""

    values: Mapping[str, Any] = field(default_factory=dict)

    @property
    def model(self) -> str | None:
        return self.values.get("model")

    @property
    def quant(self) -> str:
        return FLAGS["quant"].value(self.values.get("quant", FLAGS["quant"].default))

    def option_values(self) -> dict[str, Any]:
        """The EngineOptions fields these flags set."""
        return {FLAGS[p].sets: FLAGS[p].value(v) for p, v in self.values.items() if FLAGS[p].sets}

    def options(self, fail: "Fail", **overrides: Any) -> "EngineOptions":
        """The command's EngineOptions, validated now: a bad value ends the command with one line that
        names its flag. `overrides`: EngineOptions fields the command sets itself."""
        from kvcli.commands.common import engine_options

        return engine_options(fail, **{**self.option_values(), **overrides})


NO_FLAGS = EngineFlags()  # the `engine` parameter's placeholder default; the decorator always passes one

F = TypeVar("F", bound=Callable[..., Any])


def engine_flags(*names: str, **variants: Any) -> Callable[[F], F]:
    """Give a Typer command the engine flags `names` (declared in FLAGS), in that order, where its `engine`
    parameter stands; the command receives them as one EngineFlags in `engine`. `variants`: per-command
    defaults (`max_num_seqs=256`) or whole Flag variants (`kv_layout=FLAGS["kv_layout"].but(help=...)`)."""
    unknown = [n for n in (*names, *variants) if n not in FLAGS]
    if unknown or set(variants) - set(names):
        raise ValueError(f"engine_flags: unknown or unlisted flags {unknown or sorted(set(variants) - set(names))}")
    flags = [variants[n] if isinstance(variants.get(n), Flag) else
             FLAGS[n].but(default=variants[n]) if n in variants else FLAGS[n] for n in names]

    def decorate(command: F) -> F:
        sig = inspect.signature(command, eval_str=True)
        params = list(sig.parameters.values())
        at = [p.name for p in params].index("engine")
        taken = {p.name for p in params}
        clash = [f.param for f in flags if f.param in taken]
        if clash:
            raise ValueError(f"engine_flags: {command.__name__} declares {clash} itself")
        params[at:at + 1] = [f.parameter() for f in flags]

        @functools.wraps(command)
        def run(*args: Any, **kwargs: Any) -> Any:
            given = {f.param: kwargs.pop(f.param, f.default) for f in flags}
            return command(*args, engine=EngineFlags(MappingProxyType(given)), **kwargs)

        del run.__wrapped__  # Typer reads the signature below, not the command's own
        run.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in params}
        return run  # type: ignore[return-value]

    return decorate
