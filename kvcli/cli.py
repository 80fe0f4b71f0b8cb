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
from kvcli.cli_errors import OneLineErrorGroup


app = typer.Typer(
    cls=OneLineErrorGroup,
    name="kvcli",
    help="Run and profile long-context LLM generation through a paged KV cache.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)


class Truncate(str, Enum):
    none = "none"
    head = "head"


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
    "--quant", help="For Hugging Face checkpoints: nf4 (bitsandbytes), int4 (kvcli's group-wise "
    "Q4_1-style) or none; auto = nf4 when bitsandbytes is installed, else int4 (with a note). GGUF files "
    "keep their own quantization.")]
DequantOpt = Annotated[bool, typer.Option(
    "--dequantize", help="Expand INT4 weights to dense fp32 once at load: exact against transformers, "
    "about 8x the weight memory, faster on some CPUs.")]
DeviceOpt = Annotated[Optional[str], typer.Option("--device", help="cpu or cuda[:N]. Default: cuda when available.",
                                                  show_default=False)]
BackendOpt = Annotated[Backend, typer.Option("--attention-backend", help="Paged attention implementation: "
                                             "triton on CUDA, torch on CPU when auto. invariant (CPU): every "
                                             "row computed the same way whatever the batch, so speculation, "
                                             "preemption and batching give bit-identical greedy text; slower.")]
MaxLenOpt = Annotated[Optional[int], typer.Option("--max-model-len", help="Context length limit. "
                                                  "Default: the model's.", show_default=False)]
PrefixOpt = Annotated[bool, typer.Option("--prefix-cache/--no-prefix-cache", help="Reuse the KV blocks of "
                                         "prompt prefixes seen before (paged layout).")]
KVDtypeOpt = Annotated[Optional[str], typer.Option(
    "--kv-dtype", help="KV cache format: auto, fp32, fp16, bf16, int8 or fp8 (e4m3; codes + one fp32 scale "
    "per token and KV head: 0.53x fp16's bytes; fp8 on the Triton backend needs compute capability >= 8.9). "
    "auto: fp16 on CPU for quantized weights where kvcli's C decode-attention kernel runs (as llama.cpp), "
    "else the compute dtype (fp32 on CPU, and always with --dequantize).", show_default=False)]
ChunkOpt = Annotated[int, typer.Option("--max-batch-tokens", help="Tokens computed per engine step; "
                                       "long prompts are prefilled in chunks of this size.")]


class Speculate(str, Enum):
    none = "none"
    ngram = "ngram"


SpecOpt = Annotated[Speculate, typer.Option(
    "--speculate", help="Speculative decoding. ngram: guess the next tokens by prompt lookup (the last "
    "tokens matched earlier in the prompt and output) and verify them in one step; greedy output is "
    "unchanged, sampling keeps its distribution.")]
SpecTokensOpt = Annotated[int, typer.Option("--num-speculative-tokens", help="Most tokens guessed per step "
                                            "(they count against --max-batch-tokens).")]
NgramMinOpt = Annotated[int, typer.Option("--ngram-min", help="Shortest suffix matched by prompt lookup.")]
NgramMaxOpt = Annotated[int, typer.Option("--ngram-max", help="Longest suffix matched by prompt lookup "
                                          "(longest match first).")]


def _spec(speculate: "Speculate", k: int, ngram_min: int, ngram_max: int) -> dict:
    """The speculation fields of EngineOptions, as the commands pass them on."""
    return {"speculate": speculate.value, "num_speculative_tokens": k, "ngram_min": ngram_min,
            "ngram_max": ngram_max}


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
    kv_dtype: KVDtypeOpt = None,
    live: Annotated[bool, typer.Option("--live/--no-live", help="Live dashboard (VRAM, KV block map, "
                                       "fragmentation, throughput) on a terminal; plain output otherwise."
                                       )] = True,
    prefix_cache: PrefixOpt = True,
    speculate: SpecOpt = Speculate.none,
    num_speculative_tokens: SpecTokensOpt = 5,
    ngram_min: NgramMinOpt = 2,
    ngram_max: NgramMaxOpt = 4,
) -> None:
    """Continue a long text file with the model.

    The prompt is prefilled in chunks (progress bar, or the live dashboard on a terminal), the
    continuation streams to stdout, and a summary (tokens, speeds, KV blocks and bytes, weight
    bytes, the KV a contiguous reservation would have taken) follows on stderr."""
    from kvcli.commands.common import engine_options, sampling_params
    from kvcli.commands.continue_cmd import ContinueArgs, run_continue

    args = ContinueArgs(
        file=file, params=sampling_params(fail, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                          top_k=top_k, seed=seed),
        truncate=truncate.value, json_out=json_out, output=output, model=model, quant=quant.value, live=live,
        options=engine_options(fail, device=device, block_size=block_size, kv_budget=kv_budget,
                               dequantize=dequantize, max_model_len=max_model_len,
                               max_num_batched_tokens=max_batch_tokens, attention_backend=attention_backend.value,
                               kv_dtype=kv_dtype, prefix_caching=prefix_cache,
                               **_spec(speculate, num_speculative_tokens, ngram_min, ngram_max)),
    )
    code = run_continue(args, fail)
    if code:
        raise typer.Exit(code)


@app.command("chat")
def chat(
    system: Annotated[Optional[str], typer.Option("--system", "-s", help="System prompt.",
                                                  show_default=False)] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="Most tokens per reply.")] = 256,
    temperature: Annotated[float, typer.Option("--temperature", "-t", help="0 = greedy.")] = 0.7,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass, in (0, 1].")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens; 0 = off.")] = 0,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Sampling seed (turn i uses seed + i).",
                                                show_default=False)] = None,
    truncate: Annotated[bool, typer.Option(
        "--truncate", help="When the conversation outgrows the context, drop the oldest turns instead of "
        "refusing the message.")] = False,
    model: ModelOpt = None,
    block_size: BlockSizeOpt = 16,
    kv_budget: KVBudgetOpt = None,
    quant: QuantOpt = Quant.auto,
    dequantize: DequantOpt = False,
    device: DeviceOpt = None,
    attention_backend: BackendOpt = Backend.auto,
    max_model_len: MaxLenOpt = None,
    kv_dtype: KVDtypeOpt = None,
    prefix_cache: PrefixOpt = True,
    live: Annotated[bool, typer.Option("--live/--no-live", help="While a reply streams on a terminal, show the "
                                       "full dashboard (memory, KV blocks, fragmentation, throughput) instead "
                                       "of only the status line after it; /live toggles it.")] = False,
    speculate: SpecOpt = Speculate.none,
    num_speculative_tokens: SpecTokensOpt = 5,
    ngram_min: NgramMinOpt = 2,
    ngram_max: NgramMaxOpt = 4,
) -> None:
    """Chat with the model in a multi-turn REPL.

    Uses the model's chat template; replies stream to stdout, a status line per turn goes to stderr
    (prompt tokens, prefix-cache hits, prefill saved, speed, KV blocks). Slash commands: /stats
    /blocks /live /reset /save FILE /help /quit. With stdin not a terminal, each line is one message
    and replies go to stdout, one after another."""
    from kvcli.commands.chat import ChatArgs, run_chat
    from kvcli.commands.common import engine_options, sampling_params

    args = ChatArgs(
        system=system, params=sampling_params(fail, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                              top_k=top_k, seed=seed),
        truncate=truncate, model=model, quant=quant.value,
        options=engine_options(fail, device=device, block_size=block_size, kv_budget=kv_budget,
                               dequantize=dequantize, max_model_len=max_model_len,
                               attention_backend=attention_backend.value, kv_dtype=kv_dtype,
                               prefix_caching=prefix_cache,
                               **_spec(speculate, num_speculative_tokens, ngram_min, ngram_max)),
        live=live,
    )
    code = run_chat(args, fail)
    if code:
        raise typer.Exit(code)


class Compare(str, Enum):
    none = "none"
    contiguous = "contiguous"
    hf = "hf"
    spec = "spec"


class Layout(str, Enum):
    paged = "paged"
    contiguous = "contiguous"


class Reserve(str, Enum):
    max_len = "max-len"
    request = "request"


class Preempt(str, Enum):
    recompute = "recompute"
    swap = "swap"


MaxSeqsOpt = Annotated[int, typer.Option("--max-num-seqs", help="Most requests running at once.")]
PreemptOpt = Annotated[Preempt, typer.Option("--preempt", help="When blocks run out: recompute the "
                                             "preempted request later, or swap its blocks to host memory.")]


@app.command("profile")
def profile(
    workload: Annotated[str, typer.Option("--workload", "-w", help="sharegpt (mean 161 prompt / 338 output "
                                          "tokens), alpaca (19 / 58), uniform, or a FILE.jsonl of "
                                          '{"prompt": ..., "max_tokens": N} lines.')] = "sharegpt",
    num_requests: Annotated[int, typer.Option("--num-requests", "-N", help="Requests in the trace.")] = 64,
    request_rate: Annotated[str, typer.Option("--request-rate", help="Poisson arrivals in requests/s "
                                              "(engine steps when simulating); inf = all at once.")] = "inf",
    seed: Annotated[int, typer.Option("--seed", help="Trace seed.")] = 0,
    compare: Annotated[Compare, typer.Option("--compare", help="contiguous: the same trace again with "
                                             "contiguous preallocation in the same budget; hf: against "
                                             "transformers on the same weights; spec: speculative "
                                             "(--speculate ngram) beside plain decoding.")] = Compare.none,
    kv_layout: Annotated[Layout, typer.Option("--kv-layout", help="KV layout of the (first) run.")] = Layout.paged,
    reserve: Annotated[Reserve, typer.Option("--reserve", help="Contiguous layout: reserve max_model_len "
                                             "slots per request, or prompt + max_tokens.")] = Reserve.max_len,
    preempt: PreemptOpt = Preempt.recompute,
    simulate: Annotated[bool, typer.Option("--simulate", help="Run the scheduler and block manager without "
                                           "the model (KV in fp16 unless --kv-dtype): exact memory figures "
                                           "for any config in seconds.")] = False,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write the full report with the per-step "
                                                      "timeline to FILE.", show_default=False)] = None,
    plot_path: Annotated[Optional[Path], typer.Option("--plot", help="Draw KV memory over time, stacked by "
                                                      "category, to FILE.png.", show_default=False)] = None,
    live: Annotated[bool, typer.Option("--live/--no-live", help="Live dashboard on a terminal.")] = True,
    endpoint: Annotated[Optional[list[str]], typer.Option(
        "--endpoint", help="Send the trace to a running OpenAI-compatible server (http://host:port; vLLM, "
        "llama.cpp's server, kvcli serve) instead of a local engine: streamed /v1/completions with token-id "
        "prompts, measured at the client while its /metrics is sampled. Repeat for several servers, run one "
        "after the other and reported side by side. Only these URLs are contacted; --model names the "
        "tokenizer for the prompts.", show_default=False)] = None,
    concurrency: Annotated[int, typer.Option("--concurrency", help="--endpoint: most requests in flight per "
                                             "server (1..1024).")] = 64,
    model: ModelOpt = None,
    block_size: BlockSizeOpt = 16,
    kv_budget: KVBudgetOpt = None,
    kv_dtype: Annotated[Optional[str], typer.Option(
        "--kv-dtype", help="KV cache format (auto, fp32, fp16, bf16, int8, fp8), or several separated by commas "
        "(fp32,int8) to run the same trace once per format, side by side. Default: as --kv-dtype auto "
        "elsewhere (fp16 on CPU with kvcli's C attention kernel); fp16 with --simulate.", show_default=False)] = None,
    max_model_len: Annotated[int, typer.Option("--max-model-len", help="Context limit (and the contiguous "
                                               "max-len reservation).")] = 2048,
    max_batch_tokens: ChunkOpt = 512,
    max_num_seqs: MaxSeqsOpt = 256,
    quant: QuantOpt = Quant.auto,
    dequantize: DequantOpt = False,
    device: DeviceOpt = None,
    attention_backend: BackendOpt = Backend.auto,
    prefix_cache: PrefixOpt = True,
    speculate: SpecOpt = Speculate.none,
    num_speculative_tokens: SpecTokensOpt = 5,
    ngram_min: NgramMinOpt = 2,
    ngram_max: NgramMaxOpt = 4,
) -> None:
    """Profile a request trace: paged vs contiguous KV memory, side by side.

    Reports the KV memory breakdown (token states / reserved / internal / external fragmentation),
    peak concurrency, throughput and latency; with --compare contiguous, paged and contiguous
    preallocation run the same trace under the same KV budget."""
    from kvcli.commands.common import engine_options
    from kvcli.commands.profile_cmd import ProfileArgs, run_profile

    kv_dtypes = tuple(d.strip() for d in kv_dtype.split(",")) if kv_dtype else (None,)
    kv_dtype = kv_dtypes[0] or ("fp16" if simulate else None)
    for d in kv_dtypes[1:]:
        engine_options(fail, kv_dtype=d)  # each format validated before the model loads
    args = ProfileArgs(kv_dtypes=kv_dtypes if len(kv_dtypes) > 1 else (None,),
        endpoints=tuple(endpoint or ()), concurrency=concurrency,
        model=model, workload=workload, num_requests=num_requests, request_rate=request_rate, seed=seed,
        compare=compare.value, simulate=simulate, json_path=json_path, plot_path=plot_path, quant=quant.value,
        live=live,
        options=engine_options(fail, device=device, block_size=block_size, kv_budget=kv_budget,
                               dequantize=dequantize, max_model_len=max_model_len,
                               max_num_batched_tokens=max_batch_tokens, max_num_seqs=max_num_seqs,
                               attention_backend=attention_backend.value, kv_layout=kv_layout.value,
                               reserve=reserve.value, preempt=preempt.value,
                               kv_dtype=kv_dtype, prefix_caching=prefix_cache,
                               **_spec(speculate, num_speculative_tokens, ngram_min, ngram_max)))
    code = run_profile(args, fail)
    if code:
        raise typer.Exit(code)


@app.command("serve")
def serve(
    host: Annotated[str, typer.Option("--host", help="Address to listen on. Loopback by default: the API has "
                                      "no authentication; 0.0.0.0 exposes it to the network.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", "-p", help="TCP port (0 = any free port, announced on "
                                      "stderr).")] = 8000,
    served_model_name: Annotated[Optional[str], typer.Option(
        "--served-model-name", help="The model id clients send and /v1/models lists. Default: the model "
        "file's name.", show_default=False)] = None,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn's log level (debug logs each "
                                           "request).")] = "warning",
    model: ModelOpt = None,
    block_size: BlockSizeOpt = 16,
    kv_budget: KVBudgetOpt = None,
    kv_dtype: KVDtypeOpt = None,
    max_model_len: MaxLenOpt = None,
    max_batch_tokens: ChunkOpt = 512,
    max_num_seqs: MaxSeqsOpt = 64,
    kv_layout: Annotated[Layout, typer.Option("--kv-layout", help="paged, or contiguous preallocation "
                                              "(for comparison).")] = Layout.paged,
    preempt: PreemptOpt = Preempt.recompute,
    quant: QuantOpt = Quant.auto,
    dequantize: DequantOpt = False,
    device: DeviceOpt = None,
    attention_backend: BackendOpt = Backend.auto,
    prefix_cache: PrefixOpt = True,
    speculate: SpecOpt = Speculate.none,
    num_speculative_tokens: SpecTokensOpt = 5,
    ngram_min: NgramMinOpt = 2,
    ngram_max: NgramMaxOpt = 4,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API, with Prometheus metrics.

    Endpoints: POST /v1/completions and /v1/chat/completions (stream: true for server-sent events),
    GET /v1/models, /health, and /metrics (vLLM's metric names, plus kvcli: ones for the KV memory
    breakdown and the contiguous what-if; `kvcli watch URL` shows them live). One engine thread runs
    every request through the paged KV cache with continuous batching; a client that disconnects
    frees its request's blocks. Ctrl-C or SIGTERM stops the server."""
    from kvcli.commands.common import engine_options
    from kvcli.commands.serve_cmd import ServeArgs, run_serve

    if log_level not in ("critical", "error", "warning", "info", "debug"):
        fail(f"--log-level must be critical, error, warning, info or debug (got {log_level})")
    args = ServeArgs(
        model=model, quant=quant.value, host=host, port=port, served_model_name=served_model_name,
        log_level=log_level,
        options=engine_options(fail, device=device, block_size=block_size, kv_budget=kv_budget,
                               dequantize=dequantize, max_model_len=max_model_len,
                               max_num_batched_tokens=max_batch_tokens, max_num_seqs=max_num_seqs,
                               attention_backend=attention_backend.value, kv_layout=kv_layout.value,
                               preempt=preempt.value, kv_dtype=kv_dtype, prefix_caching=prefix_cache,
                               **_spec(speculate, num_speculative_tokens, ngram_min, ngram_max)))
    code = run_serve(args, fail)
    if code:
        raise typer.Exit(code)


@app.command("watch")
def watch(
    url: Annotated[str, typer.Argument(help="The server: http://host:port (its /metrics is read) or the full "
                                       "metrics URL. vLLM, llama.cpp's server (--metrics) and kvcli serve.",
                                       show_default=False)],
    interval: Annotated[float, typer.Option("--interval", "-i", help="Seconds between scrapes (0.25 = 4 Hz).")] = 0.25,
    duration: Annotated[Optional[float], typer.Option("--duration", help="Stop after this many seconds "
                                                      "(default: until Ctrl-C).", show_default=False)] = None,
    once: Annotated[bool, typer.Option("--once", help="Scrape once, print the dashboard and exit.")] = False,
    record: Annotated[Optional[Path], typer.Option("--record", help="Write the timeline (one row per scrape, "
                                                   "and scrape errors) to FILE as JSON.", show_default=False)] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Draw KV memory, requests and throughput over "
                                                 "time to FILE.png.", show_default=False)] = None,
    live: Annotated[bool, typer.Option("--live/--no-live", help="Live dashboard on a terminal; otherwise one "
                                       "line per scrape, then the dashboard once.")] = True,
) -> None:
    """Watch a serving engine through its Prometheus /metrics: KV usage and blocks over time,
    running / waiting requests, preemptions, prefix-cache hit rate, throughput, TTFT and
    inter-token latency percentiles; for kvcli serve also the KV memory breakdown and the
    contiguous what-if. A server that stops answering is reported in the view, which keeps its
    last sample; one unreachable at the start is an error."""
    from kvcli.commands.watch_cmd import WatchArgs, run_watch

    code = run_watch(WatchArgs(url=url, interval=interval, duration=duration, once=once, record=record,
                               plot=plot, live=live), fail)
    if code:
        raise typer.Exit(code)


@app.command("plan")
def plan(
    context: Annotated[int, typer.Option("--context", "-c", help="Tokens per request (prompt + output).")] = 8192,
    batch: Annotated[Optional[int], typer.Option("--batch", "-b", help="Concurrent requests to check.",
                                                 show_default=False)] = None,
    memory: Annotated[Optional[str], typer.Option("--memory", help="Device memory, e.g. 24GiB. Default: this "
                                                  "GPU's, else 24GiB.", show_default=False)] = None,
    mean_tokens: Annotated[Optional[int], typer.Option("--mean-tokens", help="Average tokens a request "
                                                       "really holds (paged pays for these, contiguous "
                                                       "for --context). Default: context / 4.",
                                                       show_default=False)] = None,
    kv_dtype: Annotated[str, typer.Option("--kv-dtype", help="KV cache format to plan for: fp16, bf16, fp32, "
                                          "int8 or fp8 (scales included).")] = "fp16",
    block_size: BlockSizeOpt = 16,
    model: ModelOpt = None,
) -> None:
    """Will it fit? Weight and KV memory arithmetic from a model's config.

    INT4 weight bytes, KV bytes per token and per request, and how many tokens and requests fit in
    memory, paged against contiguous preallocation."""
    from kvcli.commands.common import engine_options
    from kvcli.commands.plan_cmd import PlanArgs, run_plan

    args = PlanArgs(model=model, context=context, batch=batch, memory=memory, mean_tokens=mean_tokens,
                    options=engine_options(fail, block_size=block_size, kv_dtype=kv_dtype))
    code = run_plan(args, fail)
    if code:
        raise typer.Exit(code)


@app.command("inspect")
def inspect(
    model: Annotated[Optional[str], typer.Argument(
        help="A .gguf file, a Hugging Face checkpoint folder, or dummy:NAME. Default: the bundled model.",
        show_default=False)] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print only a JSON report on stdout.")] = False,
    load: Annotated[bool, typer.Option("--load/--no-load", help="Build the model to measure its resident "
                                       "bytes (seconds); --no-load reads only the file's metadata.")] = True,
    context: Annotated[Optional[int], typer.Option("--context", "-c", help="Tokens per request for the fit "
                                                   "figures. Default: the model's context length.",
                                                   show_default=False)] = None,
    block_size: BlockSizeOpt = 16,
    device: DeviceOpt = None,
) -> None:
    """What a model is and what it costs: architecture, tensors by type, memory after load, KV fit.

    Prints the architecture (layers, heads and KV heads, head dim, context length), the file's tensors
    by GGML type (count and bytes), the weights' resident bytes once kvcli has built the model and the
    matmul path each kind of linear takes, KV bytes per token for each KV dtype, and how many tokens and
    requests fit in the memory available on the device now (the same arithmetic as `kvcli plan`)."""
    from kvcli.commands.common import engine_options
    from kvcli.commands.inspect_cmd import run_inspect

    options = engine_options(fail, block_size=block_size, device=device)
    run_inspect(model, options, load, context, json_out, fail)


@app.command("perplexity")
def perplexity(
    file: Annotated[Path, typer.Argument(help="UTF-8 text to score.", show_default=False)],
    window: Annotated[Optional[int], typer.Option("--window", help="Tokens per window. Default: the context "
                                                  "length (--max-model-len).", show_default=False)] = None,
    stride: Annotated[Optional[int], typer.Option("--stride", help="Tokens between window starts; below "
                                                  "--window, windows overlap and each scores only its new "
                                                  "tokens. Default: the window.", show_default=False)] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print only a JSON report on stdout.")] = False,
    model: ModelOpt = None,
    block_size: BlockSizeOpt = 16,
    kv_budget: KVBudgetOpt = None,
    kv_dtype: KVDtypeOpt = None,
    quant: QuantOpt = Quant.auto,
    dequantize: DequantOpt = False,
    device: DeviceOpt = None,
    attention_backend: BackendOpt = Backend.auto,
    max_model_len: MaxLenOpt = None,
    max_batch_tokens: ChunkOpt = 512,
) -> None:
    """Teacher-forced perplexity of a text through kvcli's own paged engine.

    The text is prefilled in chunks through the KV cache in the chosen --kv-dtype; every token but
    the first of each window is scored. With --dequantize and fp32 KV this is the exact path
    (matches transformers within 1e-3)."""
    from kvcli.commands.common import engine_options
    from kvcli.commands.perplexity_cmd import PerplexityArgs, run_perplexity

    for flag, value in (("--window", window), ("--stride", stride)):
        if value is not None and value <= 0:
            fail(f"{flag} must be a positive integer (got {value})")
    args = PerplexityArgs(
        file=file, window=window, stride=stride, json_out=json_out, model=model, quant=quant.value,
        options=engine_options(fail, device=device, block_size=block_size, kv_budget=kv_budget,
                               dequantize=dequantize, max_model_len=max_model_len,
                               max_num_batched_tokens=max_batch_tokens, attention_backend=attention_backend.value,
                               kv_dtype=kv_dtype, prefix_caching=False))
    code = run_perplexity(args, fail)
    if code:
        raise typer.Exit(code)


def main() -> None:
    if sys.stdout is None:  # started with stdout closed (`kvcli ... >&-`)
        print("kvcli: error: standard output is closed", file=sys.stderr)
        sys.exit(1)
    app()


if __name__ == "__main__":
    main()
