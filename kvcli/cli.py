"""kvcli's command line: thin Typer commands that parse, validate and hand off.

Every expected failure (bad file, bad flag, model that will not load, budget too small) is reported
as one line on stderr with a non-zero exit; tracebacks are for bugs only.
"""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvcli import __version__

app = typer.Typer(
    name="kvcli",
    help="Run and profile long-context LLM generation through a paged KV cache.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


class Truncate(str, Enum):
    none = "none"
    head = "head"


class Backend(str, Enum):
    auto = "auto"
    torch = "torch"
    triton = "triton"


class Quant(str, Enum):
    auto = "auto"
    nf4 = "nf4"
    int4 = "int4"
    none = "none"


def _version(value: bool) -> None:
    if value:
        print(f"kvcli {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True,
                                                    help="Print the version and exit.")] = None,
) -> None:
    """Run and profile long-context LLM generation through a paged KV cache.

    The default model is the bundled SmolLM2-135M-Instruct (Q4_1 GGUF, weights kept 4-bit).
    """


def fail(message: str, code: int = 1) -> None:
    """One line on stderr, no traceback."""
    print(f"kvcli: error: {message}", file=sys.stderr)
    raise typer.Exit(code)


# Options shared by the commands that load a model --------------------------------------------------
ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", "-m", help="A .gguf file, a Hugging Face checkpoint folder, or dummy:NAME "
    "(smollm2-135m, llama-2-7b, llama-2-13b, llama-3-8b, mistral-7b, qwen2-0.5b, or a config.json). "
    "Default: the bundled SmolLM2-135M-Instruct Q4_1.", show_default=False)]
BlockSizeOpt = Annotated[int, typer.Option("--block-size", help="Tokens per KV block.")]
KVBudgetOpt = Annotated[Optional[str], typer.Option(
    "--kv-budget", help="Bytes for the KV pool (2GiB, 512MB) or a fraction of free memory (0.5). "
    "Default: 90% of free GPU memory; on CPU min(1GiB, four full contexts).", show_default=False)]
QuantOpt = Annotated[Quant, typer.Option(
    "--quant", help="For Hugging Face checkpoints: nf4 (bitsandbytes, the default), int4 (kvcli's "
    "group-wise Q4_1-style) or none. GGUF files keep their own quantization.")]
DequantOpt = Annotated[bool, typer.Option(
    "--dequantize", help="Expand INT4 weights to dense fp32 once at load: exact against transformers, "
    "about 8x the weight memory, faster on some CPUs.")]
DeviceOpt = Annotated[Optional[str], typer.Option("--device", help="cpu or cuda[:N]. Default: cuda when available.",
                                                  show_default=False)]
BackendOpt = Annotated[Backend, typer.Option("--attention-backend", help="Paged attention implementation: "
                                             "triton on CUDA, torch on CPU when auto.")]
MaxLenOpt = Annotated[Optional[int], typer.Option("--max-model-len", help="Context length limit. "
                                                  "Default: the model's.", show_default=False)]
ChunkOpt = Annotated[int, typer.Option("--max-batch-tokens", help="Tokens computed per engine step; "
                                       "long prompts are prefilled in chunks of this size.")]


@app.command("continue")
def continue_(
    file: Annotated[Path, typer.Argument(help="UTF-8 text to continue.", show_default=False)],
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="Tokens to generate.")] = 256,
    temperature: Annotated[float, typer.Option("--temperature", "-t", help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass, in (0, 1].")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens; 0 = off.")] = 0,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Sampling seed.", show_default=False)] = None,
    truncate: Annotated[Truncate, typer.Option(
        "--truncate", help="When the text does not fit the context: none = error, head = drop the start, "
        "keeping the last tokens that fit with room for --max-tokens.")] = Truncate.none,
    json_out: Annotated[bool, typer.Option("--json", help="Print only a JSON report on stdout "
                                           "(token ids, text, metrics).")] = False,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Also write the continuation to "
                                                   "this file.", show_default=False)] = None,
    model: ModelOpt = None,
    block_size: BlockSizeOpt = 16,
    kv_budget: KVBudgetOpt = None,
    quant: QuantOpt = Quant.auto,
    dequantize: DequantOpt = False,
    device: DeviceOpt = None,
    attention_backend: BackendOpt = Backend.auto,
    max_model_len: MaxLenOpt = None,
    max_batch_tokens: ChunkOpt = 512,
) -> None:
    """Continue a long text: chunked prefill with a progress bar, then the continuation streamed to
    stdout and a summary (tokens, speeds, KV blocks and bytes, weight bytes) on stderr."""
    from kvcli.commands.continue_cmd import ContinueArgs, run_continue

    args = ContinueArgs(
        file=file, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
        truncate=truncate.value, json_out=json_out, output=output, model=model, block_size=block_size,
        kv_budget=kv_budget, quant=quant.value, dequantize=dequantize, device=device,
        attention_backend=attention_backend.value, max_model_len=max_model_len,
        max_batch_tokens=max_batch_tokens,
    )
    code = run_continue(args, fail)
    if code:
        raise typer.Exit(code)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
