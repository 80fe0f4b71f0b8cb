"""The HTTP routes: OpenAI-compatible completions and chat completions (streamed as server-sent
events or whole), /v1/models, /health and /metrics. Handlers never touch the engine: they parse and
tokenize (in a thread pool, off the event loop), check limits, and talk to the EngineWorker through
its queues. `build_app` wraps the routes in the Host check, CORS (only if origins are allowed) and the
Guard (API key, JSON content type, body size): kvcli/server/guard.py."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvcli.config import SamplingParams
from kvcli.engine.outputs import RequestOutput
from kvcli.model.tokenizer import Tokenizer
from kvcli.server.guard import LOOPBACK_NAMES, Guard, HostCheck
from kvcli.server.metrics import CONTENT_TYPE, ServerMetrics
from kvcli.server.prompts import PromptEncoder, PromptError
from kvcli.server.protocol import ChatCompletionRequest, CompletionRequest, ResponsesRequest, Unsupported
from kvcli.server.worker import Accepted, EngineWorker, Rejected, RequestStream

BodyT = TypeVar("BodyT", bound=BaseModel)
DISCONNECT_CHECK_S = 0.5  # how often a handler asks whether its client is still there
GONE = object()  # put on a request's queue when its client disconnected
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_MAX_TOKENS = 1024  # kvcli's default for chat: a null or absent limit is not the whole context


@dataclass(frozen=True)
class ServerInfo:
    model_name: str
    max_model_len: int
    created: int
    vocab_size: int
    block_size: int = 16
    prefix_caching: bool = False
    request_capacity: int | None = None  # the most tokens one request reaches in the KV pool, when below max_model_len


@dataclass(frozen=True)
class ServeLimits:
    """What one request may cost; the flags of `kvcli serve` (docs/serving.md)."""

    max_request_bytes: int = 8 * 2**20
    max_tokens_default: int | None = None  # None: 16 for completions, CHAT_MAX_TOKENS for chat
    max_waiting_requests: int = 256  # beyond the running batch; more in flight -> 429
    max_num_seqs: int = 256
    request_timeout_s: float | None = None
    tokenizer_threads: int = 2


@dataclass(frozen=True)
class Security:
    api_key: str | None = None
    metrics_need_key: bool = False
    allowed_hosts: tuple[str, ...] | None = LOOPBACK_NAMES  # None: any Host
    allowed_origins: tuple[str, ...] = ()


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 type_: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.type = type_ or ("server_error" if status >= 500 else "rate_limit_error" if status == 429
                              else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ClientGone(Exception):
    pass


class DeadlinePassed(Exception):
    pass


def error_response(status: int, message: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    e = ApiError(status, message, code, param)
    return JSONResponse(e.body(), status_code=status)


def validation_error(errors: list) -> ApiError:
    """pydantic's errors as one OpenAI-shaped 400: the first error's field as `param`, every error in
    the message ('max_tokens: Input should be ...; foo: Extra inputs ...')."""
    parts, param, code = [], None, None
    for err in errors:
        if err.get("type") == "json_invalid":
            return ApiError(400, f"request body is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')})",
                            "invalid_json")
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        exc = err.get("ctx", {}).get("error")
        if isinstance(exc, Unsupported):
            param = param or exc.param
            code = code or "unsupported_value"
            parts.append(str(exc))
            continue
        param = param or (loc or None)
        kind = err.get("type", "")
        code = code or ("unknown_parameter" if kind == "extra_forbidden" else
                        "invalid_type" if kind.endswith("_type") or kind.endswith("_parsing") else "invalid_value")
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return ApiError(400, "; ".join(parts) or "invalid request", code, param)


class LogprobFormat:
    """Token log probabilities in OpenAI's two shapes: chat (`content`: token, logprob, bytes,
    top_logprobs) and completions (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`). A
    token's string is its own decode (a piece of a multi-byte character reads as U+FFFD; `bytes`
    has the character's UTF-8 as decoded)."""

    def __init__(self, tokenizer: Tokenizer, chat: bool) -> None:
        self.tok, self.chat = tokenizer, chat
        self._cache: dict[int, str] = {}

    def text(self, tid: int) -> str:
        t = self._cache.get(tid)
        if t is None:
            t = self._cache[tid] = self.tok.decode([tid])
        return t

    def format(self, items: list, offset: int = 0) -> dict:
        if self.chat:
            def entry(tid: int, lp: float) -> dict:
                t = self.text(tid)
                return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}

            return {"content": [{**entry(tid, lp.logprob), "top_logprobs": [entry(a, b) for a, b in lp.top]}
                                for tid, lp in items], "refusal": None}
        tokens, offsets, pos = [], [], offset
        for tid, _ in items:
            t = self.text(tid)
            tokens.append(t)
            offsets.append(pos)
            pos += len(t)
        return {"tokens": tokens, "token_logprobs": [None if lp is None else lp.logprob for _, lp in items],
                "top_logprobs": [{self.text(a): b for a, b in lp.top} if lp is not None and lp.top else None
                                 for _, lp in items],
                "text_offset": offsets}


@dataclass
class _InFlight:
    n: int = 0
    limit: int = 0


def create_app(worker: EngineWorker, tokenizer: Tokenizer, info: ServerInfo, metrics: ServerMetrics,
               limits: ServeLimits = ServeLimits()) -> FastAPI:
    app = FastAPI(title="kvcli serve", docs_url=None, redoc_url=None, openapi_url=None)
    encoder = PromptEncoder(tokenizer, info.max_model_len)
    pool = ThreadPoolExecutor(max_workers=limits.tokenizer_threads, thread_name_prefix="kvcli-tokenize")
    inflight = _InFlight(limit=limits.max_num_seqs + limits.max_waiting_requests)

    async def off_loop(fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        r = error_response(exc.status_code, str(exc.detail), code)
        r.headers.update(exc.headers or {})  # a 405's Allow
        return r

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if not worker.alive:
            return error_response(503, f"engine is not running ({worker.error or 'shut down'})", "engine_unavailable")
        return Response(status_code=200)

    def model_card() -> dict:
        return {"id": info.model_name, "object": "model", "created": info.created, "owned_by": "kvcli",
                "max_model_len": info.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        check_model(model_id)
        return model_card()

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    def check_model(name: str | None) -> None:
        if name is not None and name != info.model_name:
            raise ApiError(404, f"The model `{name}` does not exist (this server serves `{info.model_name}`).",
                           "model_not_found", "model")

    def too_long(prompt_len: int, param: str = "prompt") -> ApiError:
        return ApiError(400, f"This model's maximum context length is {info.max_model_len} tokens; the prompt "
                             f"has {prompt_len}.", "context_length_exceeded", param)

    def sampling(body: CompletionRequest | ChatCompletionRequest | ResponsesRequest, prompt_len: int,
                 max_tokens: int | None, default: int) -> SamplingParams:
        room = info.max_model_len - prompt_len
        prompt_param = ("messages" if isinstance(body, ChatCompletionRequest)
                        else "input" if isinstance(body, ResponsesRequest) else "prompt")
        if room <= 0:
            raise too_long(prompt_len, prompt_param)
        if max_tokens is not None and max_tokens > room:
            raise ApiError(400, f"This model's maximum context length is {info.max_model_len} tokens. However, "
                                f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                                f"{max_tokens} for the completion). Please reduce the prompt or max_tokens.",
                           "context_length_exceeded", "max_tokens")
        pool = info.request_capacity
        if pool is not None:  # past what the KV pool holds, a request would be cut short ("length") wherever it ran
            want = max_tokens or 1
            if prompt_len + want > pool:
                raise ApiError(400, f"This server's KV cache holds at most {pool} tokens of one request "
                                    f"(--kv-budget); you requested {prompt_len + want} tokens ({prompt_len} in the "
                                    f"prompt, {want} for the completion).", "context_length_exceeded",
                               "max_tokens" if max_tokens and prompt_len < pool else prompt_param)
            room = min(room, pool - prompt_len)
        if max_tokens is None:
            max_tokens = min(room, limits.max_tokens_default or default)
        n = getattr(body, "n", None) or 1
        if n > limits.max_num_seqs:
            raise ApiError(400, f"n is {n}; this server runs at most {limits.max_num_seqs} sequences at once "
                                "(--max-num-seqs)", "unsupported_value", "n")
        stop_ids = tuple(getattr(body, "stop_token_ids", None) or ())
        bad = [t for t in stop_ids if t >= info.vocab_size]
        if bad:
            raise ApiError(400, f"stop_token_ids: {bad[0]} is outside the vocabulary (size {info.vocab_size})",
                           "invalid_value", "stop_token_ids")
        # logprobs and penalties: completions and chat (the Responses API here is plain text)
        extra = {} if isinstance(body, ResponsesRequest) else {"logprobs": body.logprob_count(), **body.penalties()}
        if isinstance(body, CompletionRequest):  # echo with logprobs: the prompt's too
            extra["prompt_logprobs"] = body.prompt_logprob_count()
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p, top_k=max(0, getattr(body, "top_k", None) or 0),
                seed=body.seed, stop=getattr(body, "stop_list", ()), stop_token_ids=stop_ids,
                ignore_eos=bool(getattr(body, "ignore_eos", False)),
                include_stop_str_in_output=bool(getattr(body, "include_stop_str_in_output", False)), n=n, **extra)
        except ValueError as e:
            raise ApiError(400, str(e), "invalid_value") from None

    async def submit(req_id: str, ids: list[int], params: SamplingParams) -> RequestStream:
        stream = RequestStream(asyncio.get_running_loop())
        worker.submit(req_id, ids, params, stream)
        first = await stream.queue.get()
        if isinstance(first, Rejected):
            raise ApiError(first.status, first.message, "engine_unavailable" if first.status == 503 else None)
        assert isinstance(first, Accepted)
        return stream

    async def events(request: Request, req_id: str, stream: RequestStream, deadline: float | None,
                     n: int = 1) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(sample index, output) until all n samples finished; a client that went away aborts the
        request (the engine frees its blocks), and so does any other way out of the loop (cancellation
        at shutdown, starlette cancelling a stream whose client disconnected, the deadline)."""
        left = n

        async def watch_disconnect() -> None:
            # A slow poll, off the token path: a non-streamed request has no other way to notice.
            while not await request.is_disconnected():
                await asyncio.sleep(DISCONNECT_CHECK_S)
            stream.queue.put_nowait(GONE)

        watcher = asyncio.create_task(watch_disconnect())
        try:
            while left:
                if deadline is None:
                    item = await stream.queue.get()
                else:
                    try:
                        item = await asyncio.wait_for(stream.queue.get(), max(0.0, deadline - time.monotonic()))
                    except asyncio.TimeoutError:
                        raise DeadlinePassed from None
                if item is GONE:
                    raise ClientGone
                if isinstance(item, Rejected):  # the engine stopped under the request
                    left = 0
                    raise ApiError(item.status, item.message, "engine_unavailable")
                left -= item.finished
                # the engine names the samples of one prompt `{id}`, `{id}.1`, `{id}.2`, ...
                yield (0 if item.req_id == req_id else int(item.req_id.rsplit(".", 1)[1])), item
        finally:
            watcher.cancel()
            if left:
                worker.abort(req_id)

    def finish_reason(reason: str | None) -> str | None:
        # "kv_budget": the pool could not hold the request's context even alone; OpenAI clients know
        # only stop / length, and it did stop on a length.
        return "length" if reason == "kv_budget" else reason

    def cache_writes(prompt: int, stream: RequestStream) -> int:
        """Prompt tokens newly put in the prefix cache: its full KV blocks, less those it found there."""
        if not info.prefix_caching:
            return 0
        return max(0, prompt // info.block_size * info.block_size - stream.cached_tokens)

    def usage(prompt: int, completion: int, cached: int) -> dict:
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def sse(obj: dict) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def run(request: Request, body: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]],
                  max_tokens: int | None, chat: bool) -> Response:
        """Completions (a batch of prompts: choice i * n + j is sample j of prompt i) and chat (one prompt)."""
        default = CHAT_MAX_TOKENS if chat else COMPLETIONS_MAX_TOKENS
        params = [sampling(body, len(ids), max_tokens, default) for ids in prompts]
        req_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        rids = [req_id] if len(prompts) == 1 else [f"{req_id}-{p}" for p in range(len(prompts))]
        deadline = None if limits.request_timeout_s is None else time.monotonic() + limits.request_timeout_s
        streams: list[RequestStream] = []
        try:
            for rid, ids, sp in zip(rids, prompts, params):
                streams.append(await submit(rid, ids, sp))
        except BaseException:
            for rid in rids[:len(streams)]:
                worker.abort(rid)
            raise
        created = int(time.time())
        head = {"id": req_id, "created": created, "model": info.model_name, "system_fingerprint": None}
        fmt = LogprobFormat(tokenizer, chat) if params[0].logprobs is not None else None
        n = params[0].n
        echoes = [""] * len(prompts)  # completions' echo: each prompt's text ahead of its choices'
        if not chat and body.echo:
            echoes = [p if isinstance(p, str) else tokenizer.decode(ids) for p, ids in zip(body.prompts, prompts)]
        prompt_tokens = sum(map(len, prompts))

        def cached() -> int:
            return sum(s.cached_tokens for s in streams)

        def prompt_items(ids: list[int], out: RequestOutput) -> list:
            """echo with logprobs: the prompt's tokens, the first with none (OpenAI writes null)."""
            return [(ids[0], None), *zip(ids[1:], out.prompt_logprobs)]

        async def every_event():
            """(choice index, prompt index, output) over the prompts in turn (each is computed meanwhile);
            any way out aborts what is left."""
            done = 0
            try:
                for p, (rid, stream) in enumerate(zip(rids, streams)):
                    async for i, out in events(request, rid, stream, deadline, n):
                        yield p * n + i, p, out
                    done = p + 1
            finally:
                for rid in rids[done + 1:]:
                    worker.abort(rid)

        total = len(prompts) * n
        if not body.stream:
            texts, reasons, count = [[] for _ in range(total)], [None] * total, 0
            lps: list[list] = [[] for _ in range(total)]
            try:
                async for c, p, out in every_event():
                    texts[c].append(out.new_text)
                    count += len(out.new_token_ids)
                    if fmt is not None and out.prompt_logprobs is not None:
                        lps[c][:0] = prompt_items(prompts[p], out)
                    if fmt is not None and out.logprobs is not None:
                        lps[c].append((out.new_token_ids[0], out.logprobs))
                    if out.finished:
                        reasons[c] = out.finish_reason
            except ClientGone:
                return Response(status_code=499)  # nobody reads it; the request was aborted
            except DeadlinePassed:  # ended by the server's --request-timeout, as by a token limit
                reasons = [r or "length" for r in reasons]
            choices = []
            for c in range(total):
                joined = echoes[c // n] + "".join(texts[c])
                choice = ({"index": c, "message": {"role": "assistant", "content": joined, "refusal": None}}
                          if chat else {"index": c, "text": joined})
                choice["logprobs"] = None if fmt is None else fmt.format(lps[c])
                choice["finish_reason"] = finish_reason(reasons[c])
                choices.append(choice)
            return JSONResponse({**head, "object": "chat.completion" if chat else "text_completion",
                                 "choices": choices, "usage": usage(prompt_tokens, count, cached())})

        include_usage = body.stream_options is not None and bool(body.stream_options.include_usage)
        # vLLM's continuous_usage_stats: with include_usage, every chunk carries the usage so far
        continuous = include_usage and bool(body.stream_options.continuous_usage_stats)
        streamed_tokens = [0]  # completion tokens so far (body_iter counts them; chunk reads them)
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(i: int, text: str | None, reason: str | None, role: bool = False, lp=None) -> dict:
            if chat:
                delta: dict = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
                c = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}
            else:
                c = {"index": i, "text": text or "", "logprobs": lp, "finish_reason": reason}
            out = {**head, "object": kind, "choices": [c]}
            if include_usage:  # as OpenAI: null on every chunk but the last
                out["usage"] = usage(prompt_tokens, streamed_tokens[0], cached()) if continuous else None
            return out

        async def body_iter() -> AsyncIterator[str]:
            open_ = set(range(total))
            streamed = [len(echoes[c // n]) for c in range(total)]  # text offsets continue after the echo
            # echo with logprobs: a choice's echo waits for its prompt's log probabilities (its first output)
            echo_later = fmt is not None and any(echoes)
            try:
                if chat:
                    for i in range(n):
                        yield sse(chunk(i, None, None, role=True))
                elif any(echoes) and not echo_later:
                    for c in range(total):
                        yield sse(chunk(c, echoes[c // n], None))
                try:
                    async for c, p, out in every_event():
                        streamed_tokens[0] += len(out.new_token_ids)
                        if echo_later and out.prompt_logprobs is not None:
                            yield sse(chunk(c, echoes[p], None, lp=fmt.format(prompt_items(prompts[p], out))))
                        if fmt is not None and out.logprobs is not None:  # every token, its text or not
                            lp = fmt.format([(out.new_token_ids[0], out.logprobs)], offset=streamed[c])
                            streamed[c] += len(out.new_text)
                            yield sse(chunk(c, out.new_text, None, lp=lp))
                        elif out.new_text:
                            yield sse(chunk(c, out.new_text, None))
                        if out.finished:  # the reason on a chunk of its own, as OpenAI sends it
                            open_.discard(c)
                            yield sse(chunk(c, None, finish_reason(out.finish_reason)))
                except DeadlinePassed:
                    for c in sorted(open_):
                        yield sse(chunk(c, None, "length"))
                if include_usage:
                    yield sse({**head, "object": kind, "choices": [],
                               "usage": usage(prompt_tokens, streamed_tokens[0], cached())})
                yield "data: [DONE]\n\n"
            except ClientGone:
                return
            except ApiError as e:  # headers are sent: report in-band, as vLLM does
                yield sse(e.body())
                yield "data: [DONE]\n\n"

        return StreamingResponse(body_iter(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def parse(raw: bytes, model: type[BodyT]) -> BodyT:
        try:
            return model.model_validate_json(raw)
        except ValidationError as e:
            raise validation_error(e.errors()) from None

    def admit() -> None:
        if inflight.n >= inflight.limit:
            raise ApiError(429, f"the server is at its limit of {inflight.limit} requests in flight "
                                f"({limits.max_num_seqs} running, {limits.max_waiting_requests} waiting: "
                                "kvcli serve --max-waiting-requests); retry later", "queue_full")
        inflight.n += 1

    def prepare_completion(raw: bytes) -> tuple[CompletionRequest, list[list[int]]]:
        body = parse(raw, CompletionRequest)
        check_model(body.model)
        prompts = body.prompts
        if len(prompts) > 1 and len(prompts) * (body.n or 1) > limits.max_num_seqs:  # (n alone: sampling())
            raise ApiError(400, f"{len(prompts)} prompts x n = {body.n or 1} are more sequences than this server "
                                f"runs at once ({limits.max_num_seqs}: --max-num-seqs)", "unsupported_value", "prompt")
        batch = []
        for p in prompts:
            if isinstance(p, list):
                ids = list(p)
                if len(ids) >= info.max_model_len:
                    raise too_long(len(ids))
                if max(ids) >= info.vocab_size:
                    raise ApiError(400, f"prompt token id {max(ids)} is outside the vocabulary (size "
                                        f"{info.vocab_size})", "invalid_value", "prompt")
            else:
                try:
                    ids = encoder.encode(p, bool(body.parse_special_tokens))
                except PromptError as e:
                    raise ApiError(400, str(e), "context_length_exceeded", "prompt") from None
                if not ids:
                    raise ApiError(400, "prompt has no tokens", "invalid_value", "prompt")
            batch.append(ids)
        return body, batch

    def prepare_chat(raw: bytes) -> tuple[ChatCompletionRequest, list[int]]:
        body = parse(raw, ChatCompletionRequest)
        check_model(body.model)
        msgs = [m.as_template_message() for m in body.messages]
        try:
            ids = encoder.chat(msgs, bool(body.parse_special_tokens))
        except PromptError as e:
            code = "context_length_exceeded" if "characters" in str(e) else "invalid_value"
            raise ApiError(400, str(e), code, "messages") from None
        return body, list(ids)

    async def handle(request: Request, prepare: Callable, kind: str) -> Response:
        admit()
        released = False
        try:
            raw = await request.body()
            body, ids = await off_loop(prepare, raw)
            if kind == "responses":
                resp = await run_responses(request, body, ids)
            elif kind == "chat":
                resp = await run(request, body, [ids], body.limit, chat=True)
            else:
                resp = await run(request, body, ids, body.max_tokens, chat=False)
            if isinstance(resp, StreamingResponse):
                # The stream outlives this handler: count it until its body is sent.
                inner = resp.body_iterator

                async def counted():
                    try:
                        async for part in inner:
                            yield part
                    finally:
                        inflight.n -= 1

                resp.body_iterator = counted()
                released = True
            return resp
        finally:
            if not released:
                inflight.n -= 1

    def prepare_responses(raw: bytes) -> tuple[ResponsesRequest, list[int]]:
        body = parse(raw, ResponsesRequest)
        check_model(body.model)
        try:
            ids = encoder.chat(body.messages(), bool(body.parse_special_tokens))
        except PromptError as e:
            code = "context_length_exceeded" if "characters" in str(e) else "invalid_value"
            raise ApiError(400, str(e), code, "input") from None
        return body, list(ids)

    async def run_responses(request: Request, body: ResponsesRequest, ids: list[int]) -> Response:
        """OpenAI's Responses API over the chat path: one output message of one output_text part."""
        params = sampling(body, len(ids), body.max_output_tokens, CHAT_MAX_TOKENS)
        hexid = uuid.uuid4().hex
        req_id, msg_id = f"resp_{hexid}", f"msg_{hexid}"
        deadline = None if limits.request_timeout_s is None else time.monotonic() + limits.request_timeout_s
        stream = await submit(req_id, ids, params)
        created = int(time.time())

        def response(status: str, text: str | None, count: int, reason: str | None) -> dict:
            incomplete = status == "incomplete"
            output = [] if text is None else [message(text, status)]
            return {"id": req_id, "object": "response", "created_at": created, "status": status,
                    "background": False, "error": None,
                    "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                    "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                    "model": info.model_name, "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
                    "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "store": False,
                    "temperature": params.temperature, "text": {"format": {"type": "text"}},
                    "tool_choice": body.tool_choice if isinstance(body.tool_choice, str) else "auto", "tools": [],
                    "top_p": params.top_p, "truncation": "disabled", "user": body.user, "metadata": body.metadata or {},
                    "usage": None if status == "in_progress" else {
                        "input_tokens": len(ids), "input_tokens_details": {
                            "cached_tokens": stream.cached_tokens, "cache_write_tokens": cache_writes(len(ids), stream)},
                        "output_tokens": count, "output_tokens_details": {"reasoning_tokens": 0},
                        "total_tokens": len(ids) + count}}

        def part(text: str) -> dict:
            return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

        def message(text: str, status: str) -> dict:
            return {"id": msg_id, "type": "message", "status": status, "role": "assistant",
                    "content": [part(text)] if status != "in_progress" else []}

        def final_status(reason: str | None) -> str:
            return "incomplete" if finish_reason(reason) == "length" else "completed"

        if not body.stream:
            texts, count, reason = [], 0, None
            try:
                async for _, out in events(request, req_id, stream, deadline):
                    texts.append(out.new_text)
                    count += len(out.new_token_ids)
                    reason = out.finish_reason
            except ClientGone:
                return Response(status_code=499)
            except DeadlinePassed:
                reason = "length"
            return JSONResponse(response(final_status(reason), "".join(texts), count, reason))

        seq = 0

        def event(kind: str, **fields) -> str:
            nonlocal seq
            seq += 1
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **fields}, ensure_ascii=False)}\n\n"

        async def body_iter() -> AsyncIterator[str]:
            texts, count, reason = [], 0, None
            where = {"item_id": msg_id, "output_index": 0, "content_index": 0}
            try:
                yield event("response.created", response=response("in_progress", None, 0, None))
                yield event("response.in_progress", response=response("in_progress", None, 0, None))
                yield event("response.output_item.added", output_index=0, item=message("", "in_progress"))
                yield event("response.content_part.added", part=part(""), **where)
                try:
                    async for _, out in events(request, req_id, stream, deadline):
                        count += len(out.new_token_ids)
                        reason = out.finish_reason
                        if out.new_text:
                            texts.append(out.new_text)
                            yield event("response.output_text.delta", delta=out.new_text, logprobs=[], **where)
                except DeadlinePassed:
                    reason = "length"
                text, status = "".join(texts), final_status(reason)
                yield event("response.output_text.done", text=text, logprobs=[], **where)
                yield event("response.content_part.done", part=part(text), **where)
                yield event("response.output_item.done", output_index=0, item=message(text, status))
                yield event(f"response.{status}", response=response(status, text, count, reason))
            except ClientGone:
                return
            except ApiError as e:  # headers are sent: report in-band
                yield event("error", code=e.code, message=e.message, param=e.param)

        return StreamingResponse(body_iter(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await handle(request, prepare_responses, kind="responses")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, prepare_completion, kind="completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, prepare_chat, kind="chat")

    app.state.encoder = encoder
    app.state.inflight = inflight
    return app


def build_app(worker: EngineWorker, tokenizer: Tokenizer, info: ServerInfo, metrics: ServerMetrics,
              limits: ServeLimits = ServeLimits(), security: Security = Security()):
    """The routes behind the Host check, CORS (with allowed origins only) and the Guard."""
    app = create_app(worker, tokenizer, info, metrics, limits)
    posts = [r.path for r in app.routes if "POST" in getattr(r, "methods", ())]
    inner = Guard(app, api_key=security.api_key, metrics_need_key=security.metrics_need_key,
                  max_body_bytes=limits.max_request_bytes, body_paths=posts)
    if security.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        inner = CORSMiddleware(inner, allow_origins=list(security.allowed_origins), allow_methods=["GET", "POST"],
                               allow_headers=["Authorization", "Content-Type"], max_age=600)
    return HostCheck(inner, security.allowed_hosts)
