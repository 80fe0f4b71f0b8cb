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
from kvcli.cli_help import KvcliGroup
from kvcli.commands.engine_flags import FLAGS, NO_FLAGS, RETENTION, SPECULATION, EngineFlags, engine_flags


app = typer.Typer(
    cls=KvcliGroup,
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


# Engine flags (--model, --block-size, --kv-dtype, ...) are declared once, in commands/engine_flags.py: each
# command names the ones it takes with @engine_flags and receives their values as one EngineFlags.


# Penalties on repeats, shared by continue and chat (kvcli/sampler.py; the same fields as serve's API): the bundled
# model loops on one sentence under greedy decoding without them.
RepetitionPenalty = Annotated[float, typer.Option(
    "--repetition-penalty", help="Divide the positive logits of every token already in the text or the output by "
    "this (multiply the negative ones), as transformers and llama.cpp do; 1 = off, 1.1-1.3 breaks loops.")]
PresencePenalty = Annotated[float, typer.Option(
    "--presence-penalty", help="Subtract this from the logit of every token already generated (OpenAI's, -2..2).")]
FrequencyPenalty = Annotated[float, typer.Option(
    "--frequency-penalty", help="Subtract this times its count so far from each generated token's logit "
    "(OpenAI's, -2..2).")]


# The key of a server started with one (serve --api-key; vLLM's and llama-server's too): watch and profile --endpoint.
ClientApiKey = Annotated[Optional[str], typer.Option(
    "--api-key", envvar="KVCLI_API_KEY", help="Send 'Authorization: Bearer KEY' to the server (kvcli serve "
    "--api-key, vLLM, llama-server). Default: KVCLI_API_KEY when set.", show_default=False)]


@app.command("continue")
@engine_flags("model", "block_size", "kv_budget", "quant", "dequantize", "device", "threads", "attention_backend",
              "cuda_graphs", "max_model_len", "max_batch_tokens", "kv_dtype", "prefix_cache", *SPECULATION, *RETENTION,
              kv_window=FLAGS["kv_window"].but(help="Bound the KV: keep the first --sink-tokens tokens and the last "
              "W, so a text longer than the context streams through (kept keys re-rotated as blocks drop; the "
              "model sees only positions inside its context) and generation is bounded only by --max-tokens. "
              "Default auto: W = the context less the sink blocks and a margin of --max-tokens for the "
              "generation (at least one block); not yet on a sliding-window model, where auto keeps every token. "
              "none: a text longer than the context is an error (or --truncate head)."))
def continue_(
    file: Annotated[Path, typer.Argument(help="UTF-8 text to continue.", show_default=False)],
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="Tokens to generate.")] = 256,
    temperature: Annotated[float, typer.Option("--temperature", "-t", help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass, in (0, 1].")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens; 0 = off.")] = 0,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Sampling seed.", show_default=False)] = None,
    repetition_penalty: RepetitionPenalty = 1.0,
    presence_penalty: PresencePenalty = 0.0,
    frequency_penalty: FrequencyPenalty = 0.0,
    truncate: Annotated[Truncate, typer.Option(
        "--truncate", help="When the text does not fit the context: none = stream it through the bounded KV "
        "cache (--kv-window; with --kv-window none an error), head = drop the start, keeping the last tokens "
        "that fit with room for --max-tokens.")] = Truncate.none,
    json_out: Annotated[bool, typer.Option("--json", help="Print only a JSON report on stdout "
                                           "(token ids, text, metrics).")] = False,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Also write the continuation to "
                                                   "this file.", show_default=False)] = None,
    live: Annotated[bool, typer.Option("--live/--no-live", help="Live dashboard (VRAM, KV block map, "
                                       "fragmentation, throughput) on a terminal; plain output otherwise."
                                       )] = True,
    engine: EngineFlags = NO_FLAGS,
) -> None:
    """Continue a long text file with the model.

    The prompt is prefilled in chunks (progress bar, or the live dashboard on a terminal), the
    continuation streams to stdout, and a summary (tokens, speeds, KV blocks and bytes, weight
    bytes, the KV a contiguous reservation would have taken) follows on stderr."""
    from kvcli.commands.common import sampling_params
    from kvcli.commands.continue_cmd import ContinueArgs, run_continue

    args = ContinueArgs(
        file=file, params=sampling_params(fail, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                          top_k=top_k, seed=seed, repetition_penalty=repetition_penalty,
                                          presence_penalty=presence_penalty, frequency_penalty=frequency_penalty),
        truncate=truncate.value, json_out=json_out, output=output, model=engine.model, quant=engine.quant,
        live=live, options=engine.options(fail, **_continue_window(engine, truncate.value, max_tokens)),
    )
    code = run_continue(args, fail)
    if code:
        raise typer.Exit(code)


def _continue_window(engine: EngineFlags, truncate: str, max_tokens: int) -> dict:
    """continue's default bounded cache: --kv-window auto with --max-tokens of room, unless the window was
    given or --truncate head keeps only the text's end."""
    if truncate == "head":
        return {"kv_window": None}
    if engine.values.get("kv_window") is None:
        return {"kv_window": "auto", "kv_window_margin": max(max_tokens, 0)}
    return {"kv_window_margin": max(max_tokens, 0)}


@app.command("chat")
@engine_flags("model", "block_size", "kv_budget", "quant", "dequantize", "device", "threads", "attention_backend",
              "cuda_graphs", "max_model_len", "kv_dtype", "prefix_cache", *SPECULATION, *RETENTION)
def chat(
    system: Annotated[Optional[str], typer.Option("--system", "-s", help="System prompt.",
                                                  show_default=False)] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="Most tokens per reply.")] = 256,
    temperature: Annotated[float, typer.Option("--temperature", "-t", help="0 = greedy.")] = 0.7,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass, in (0, 1].")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens; 0 = off.")] = 0,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Sampling seed (turn i uses seed + i).",
                                                show_default=False)] = None,
    repetition_penalty: RepetitionPenalty = 1.0,
    presence_penalty: PresencePenalty = 0.0,
    frequency_penalty: FrequencyPenalty = 0.0,
    truncate: Annotated[bool, typer.Option(
        "--truncate", help="When the conversation outgrows the context, drop the oldest turns (instead of going "
        "on through the bounded KV cache, --kv-window: the system prompt among the sinks, the latest tokens in "
        "the window; with --kv-window none the message is refused).")] = False,
    live: Annotated[bool, typer.Option("--live/--no-live", help="While a reply streams on a terminal, show the "
                                       "full dashboard (memory, KV blocks, fragmentation, throughput) instead "
                                       "of only the status line after it; /live toggles it.")] = False,
    engine: EngineFlags = NO_FLAGS,
) -> None:
    """Chat with the model in a multi-turn REPL.

    Uses the model's chat template; replies stream to stdout, a status line per turn goes to stderr
    (prompt tokens, prefix-cache hits, prefill saved, speed, KV blocks). Slash commands: /stats
    /blocks /live /reset /save FILE /help /quit. With stdin not a terminal, each line is one message
    and replies go to stdout, one after another."""
    from kvcli.commands.chat import ChatArgs, run_chat
    from kvcli.commands.common import sampling_params

    args = ChatArgs(
        system=system, params=sampling_params(fail, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                              top_k=top_k, seed=seed, repetition_penalty=repetition_penalty,
                                              presence_penalty=presence_penalty,
                                              frequency_penalty=frequency_penalty),
        truncate=truncate, model=engine.model, quant=engine.quant, live=live,
        options=engine.options(fail, **_continue_window(engine, "head" if truncate else "none", max_tokens)),
    )
    code = run_chat(args, fail)
    if code:
        raise typer.Exit(code)


class Compare(str, Enum):
    none = "none"
    contiguous = "contiguous"
    hf = "hf"
    spec = "spec"


# profile's variants of two engine flags: the first run's layout, and a context default for its traces
KVLayoutProfile = FLAGS["kv_layout"].but(help="KV layout of the (first) run.")
MaxLenProfile = FLAGS["max_model_len"].but(type=int, default=2048, show_default=True,
                                           help="Context limit (and the contiguous max-len reservation).")


@app.command("profile")
@engine_flags("model", "block_size", "kv_budget", "max_model_len", "max_batch_tokens", "max_num_seqs",
              "kv_layout", "reserve", "preempt", "quant", "dequantize", "device", "threads", "attention_backend",
              "cuda_graphs", "prefix_cache", *SPECULATION, *RETENTION, kv_layout=KVLayoutProfile,
              max_model_len=MaxLenProfile,
              max_num_seqs=256)
def profile(
    workload: Annotated[str, typer.Option("--workload", "-w", help="sharegpt (mean 161 prompt / 338 output "
                                          "tokens), alpaca (19 / 58), uniform, or a FILE.jsonl of "
                                          '{"prompt": ..., "max_tokens": N} lines.')] = "sharegpt",
    num_requests: Annotated[int, typer.Option("--num-requests", "-N",
                                              help="Requests in the trace (at most 100,000).")] = 64,
    request_rate: Annotated[str, typer.Option("--request-rate", help="Poisson arrivals in requests/s "
                                              "(engine steps when simulating); inf = all at once.")] = "inf",
    seed: Annotated[int, typer.Option("--seed", help="Trace seed.")] = 0,
    compare: Annotated[Compare, typer.Option("--compare", help="contiguous: the same trace again with "
                                             "contiguous preallocation in the same budget; hf: against "
                                             "transformers on the same weights; spec: speculative "
                                             "(--speculate ngram) beside plain decoding.")] = Compare.none,
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
    api_key: ClientApiKey = None,
    kv_dtype: Annotated[Optional[str], typer.Option(
        "--kv-dtype", help="KV cache format (auto, fp32, fp16, bf16, int8, fp8), or several separated by commas "
        "(fp32,int8) to run the same trace once per format, side by side. Default: as --kv-dtype auto "
        "elsewhere (fp16 on CPU with kvcli's C attention kernel); fp16 with --simulate.", show_default=False)] = None,
    engine: EngineFlags = NO_FLAGS,
) -> None:
    """Profile a request trace: paged vs contiguous KV memory, side by side.

    Reports the KV memory breakdown (token states / reserved / internal / external fragmentation),
    peak concurrency, throughput and latency; with --compare contiguous, paged and contiguous
    preallocation run the same trace under the same KV budget."""
    from kvcli.commands.common import engine_options
    from kvcli.commands.profile_cmd import ProfileArgs, run_profile

    kv_dtypes = tuple(d.strip() for d in kv_dtype.split(",")) if kv_dtype else (None,)
    kv_dtype = kv_dtypes[0] or None  # auto; a simulation stores fp16 then (kvcache.kv_dtype.resolve_kv_dtype)
    for d in kv_dtypes[1:]:
        engine_options(fail, kv_dtype=d)  # each format validated before the model loads
    args = ProfileArgs(kv_dtypes=kv_dtypes if len(kv_dtypes) > 1 else (None,),
        endpoints=tuple(endpoint or ()), concurrency=concurrency, api_key=api_key,
        model=engine.model, workload=workload, num_requests=num_requests, request_rate=request_rate, seed=seed,
        compare=compare.value, simulate=simulate, json_path=json_path, plot_path=plot_path, quant=engine.quant,
        live=live, options=engine.options(fail, kv_dtype=kv_dtype))
    code = run_profile(args, fail)
    if code:
        raise typer.Exit(code)


@app.command("serve")
@engine_flags("model", "block_size", "kv_budget", "kv_dtype", "max_model_len", "max_batch_tokens", "max_num_seqs",
              "kv_layout", "preempt", "quant", "dequantize", "device", "threads", "attention_backend", "cuda_graphs",
              "prefix_cache", *SPECULATION, *RETENTION)
def serve(
    host: Annotated[str, typer.Option("--host", help="Address to listen on. Loopback by default; 0.0.0.0 "
                                      "exposes it to the network (set --api-key).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", "-p", help="TCP port (0 = any free port, announced on "
                                      "stderr).")] = 8000,
    served_model_name: Annotated[Optional[str], typer.Option(
        "--served-model-name", help="The model id clients send and /v1/models lists. Default: the model "
        "file's name.", show_default=False)] = None,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn's log level (debug logs each "
                                           "request).")] = "warning",
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="KVCLI_API_KEY", help="Require "
                       "'Authorization: Bearer KEY' on every /v1 route (401 without it); /health stays open.",
                       show_default=False)] = None,
    metrics_need_key: Annotated[bool, typer.Option("--metrics-need-key", help="Require the API key on /metrics "
                                "too (watch and Prometheus then need it).")] = False,
    allowed_hosts: Annotated[Optional[str], typer.Option("--allowed-hosts", help="Comma-separated Host names "
                             "accepted besides localhost, 127.0.0.1 and [::1] ('*': any). Bound to loopback only "
                             "those three are accepted by default (DNS rebinding); elsewhere any Host.",
                             show_default=False)] = None,
    allowed_origins: Annotated[Optional[str], typer.Option("--allowed-origins", help="Comma-separated origins "
                               "allowed by CORS (https://app.example, or '*'). Default: no CORS headers.",
                               show_default=False)] = None,
    max_request_bytes: Annotated[str, typer.Option("--max-request-bytes", help="Largest request body "
                                 "(413 above it, refused before it is read).")] = "8MiB",
    max_tokens_default: Annotated[Optional[int], typer.Option("--max-tokens-default", help="Tokens to generate "
                                  "when a request sets no max_tokens (or null). Default: 16 for completions "
                                  "(OpenAI's), 1024 for chat; capped by the context left.", show_default=False)] = None,
    max_waiting_requests: Annotated[int, typer.Option("--max-waiting-requests", help="Requests allowed to wait "
                                    "beyond the running batch (--max-num-seqs); more get 429.")] = 256,
    request_timeout: Annotated[Optional[float], typer.Option("--request-timeout", help="Seconds a request may "
                               "run; then it ends with what it has (finish_reason length).",
                               show_default=False)] = None,
    engine: EngineFlags = NO_FLAGS,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API, with Prometheus metrics.

    Endpoints: POST /v1/completions, /v1/chat/completions and /v1/responses (stream: true for server-sent
    events), GET /v1/models, /health, and /metrics (vLLM's metric names, plus kvcli: ones for the KV memory
    breakdown and the contiguous what-if; `kvcli watch URL` shows them live). One engine thread runs
    every request through the paged KV cache with continuous batching; a client that disconnects
    frees its request's blocks. Ctrl-C or SIGTERM stops the server."""
    from kvcli.commands.serve_cmd import ServeArgs, run_serve

    if log_level not in ("critical", "error", "warning", "info", "debug"):
        fail(f"--log-level must be critical, error, warning, info or debug (got {log_level})")
    from kvcli.options import ConfigError, parse_bytes

    try:
        body_limit = parse_bytes(max_request_bytes, "--max-request-bytes")
    except ConfigError as e:
        fail(str(e))
    if max_tokens_default is not None and max_tokens_default < 1:
        fail(f"--max-tokens-default must be >= 1 (got {max_tokens_default})")
    if max_waiting_requests < 0:
        fail(f"--max-waiting-requests must be >= 0 (got {max_waiting_requests})")
    if request_timeout is not None and not request_timeout > 0:
        fail(f"--request-timeout must be > 0 seconds (got {request_timeout})")
    if body_limit < 1024:
        fail(f"--max-request-bytes must be at least 1KiB (got {body_limit})")

    def names(text: str | None) -> tuple[str, ...]:
        return tuple(x.strip() for x in (text or "").split(",") if x.strip())

    args = ServeArgs(
        model=engine.model, quant=engine.quant, host=host, port=port, served_model_name=served_model_name,
        log_level=log_level, options=engine.options(fail), api_key=api_key or None,
        metrics_need_key=metrics_need_key, allowed_hosts=names(allowed_hosts), allowed_origins=names(allowed_origins),
        max_request_bytes=body_limit, max_tokens_default=max_tokens_default,
        max_waiting_requests=max_waiting_requests, request_timeout=request_timeout)
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
    api_key: ClientApiKey = None,
) -> None:
    """Watch a serving engine through its Prometheus /metrics: KV usage and blocks over time,
    running / waiting requests, preemptions, prefix-cache hit rate, throughput, TTFT and
    inter-token latency percentiles; for kvcli serve also the KV memory breakdown and the
    contiguous what-if. A server that stops answering is reported in the view, which keeps its
    last sample; one unreachable at the start is an error."""
    from kvcli.commands.watch_cmd import WatchArgs, run_watch

    code = run_watch(WatchArgs(url=url, interval=interval, duration=duration, once=once, record=record,
                               plot=plot, live=live, api_key=api_key), fail)
    if code:
        raise typer.Exit(code)


@app.command("plan")
@engine_flags("block_size", "model")
def plan(
    context: Annotated[Optional[int], typer.Option("--context", "-c", help="Tokens per request (prompt + output). "
                                                   "Default: the model's context length.",
                                                   show_default=False)] = None,
    batch: Annotated[Optional[int], typer.Option("--batch", "-b", help="Concurrent requests to check: the exit "
                                                 "status is 2 when neither layout holds them (0 when one does). "
                                                 "Default: none checked.", show_default=False)] = None,
    memory: Annotated[Optional[str], typer.Option("--memory", help="Device memory, e.g. 24GiB. Default: this "
                                                  "GPU's, else 24GiB.", show_default=False)] = None,
    mean_tokens: Annotated[Optional[int], typer.Option("--mean-tokens", help="Average tokens a request "
                                                       "really holds (paged pays for these, contiguous "
                                                       "for --context). Default: context / 4.",
                                                       show_default=False)] = None,
    kv_dtype: Annotated[str, typer.Option("--kv-dtype", help="KV cache format to plan for: fp16, bf16, fp32, "
                                          "int8 or fp8 (scales included).")] = "fp16",
    json_out: Annotated[bool, typer.Option("--json", help="Print only a JSON report on stdout (the same numbers, "
                                           "in bytes; the exit status as without).")] = False,
    engine: EngineFlags = NO_FLAGS,
) -> None:
    """Will it fit? Weight and KV memory arithmetic from a model's config.

    INT4 weight bytes, KV bytes per token and per request, and how many tokens and requests fit in
    memory, paged against contiguous preallocation."""
    from kvcli.commands.plan_cmd import PlanArgs, run_plan

    args = PlanArgs(model=engine.model, context=context, batch=batch, memory=memory, mean_tokens=mean_tokens,
                    options=engine.options(fail, kv_dtype=kv_dtype), json_out=json_out)
    code = run_plan(args, fail)
    if code:
        raise typer.Exit(code)


@app.command("inspect")
@engine_flags("block_size", "device")
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
    engine: EngineFlags = NO_FLAGS,
) -> None:
    """What a model is and what it costs: architecture, tensors by type, memory after load, KV fit.

    Prints the architecture (layers, heads and KV heads, head dim, context length), the file's tensors
    by GGML type (count and bytes), the weights' resident bytes once kvcli has built the model and the
    matmul path each kind of linear takes, KV bytes per token for each KV dtype, and how many tokens and
    requests fit in the memory available on the device now (the same arithmetic as `kvcli plan`)."""
    from kvcli.commands.inspect_cmd import run_inspect

    run_inspect(model, engine.options(fail), load, context, json_out, fail)


@app.command("perplexity")
@engine_flags("model", "block_size", "kv_budget", "kv_dtype", "quant", "dequantize", "device", "threads",
              "attention_backend", "max_model_len", "max_batch_tokens", *RETENTION)
def perplexity(
    file: Annotated[Path, typer.Argument(help="UTF-8 text to score.", show_default=False)],
    window: Annotated[Optional[int], typer.Option("--window", help="Tokens per window. Default: the context "
                                                  "length (--max-model-len).", show_default=False)] = None,
    stride: Annotated[Optional[int], typer.Option("--stride", help="Tokens between window starts; below "
                                                  "--window, windows overlap and each scores only its new "
                                                  "tokens. Default: the window.", show_default=False)] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print only a JSON report on stdout.")] = False,
    engine: EngineFlags = NO_FLAGS,
) -> None:
    """Teacher-forced perplexity of a text through kvcli's own paged engine.

    The text is prefilled in chunks through the KV cache in the chosen --kv-dtype; every token but
    the first of each window is scored. With --dequantize and fp32 KV this is the exact path
    (matches transformers within 1e-3)."""
    from kvcli.commands.perplexity_cmd import PerplexityArgs, run_perplexity

    for flag, value in (("--window", window), ("--stride", stride)):
        if value is not None and value <= 0:
            fail(f"{flag} must be a positive integer (got {value})")
    args = PerplexityArgs(
        file=file, window=window, stride=stride, json_out=json_out, model=engine.model, quant=engine.quant,
        options=engine.options(fail, prefix_caching=False))
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
