"""The HTTP routes: OpenAI-compatible completions and chat completions (streamed as server-sent
events or whole), /v1/models, /health and /metrics. Handlers never touch the engine: they tokenize,
check limits, and talk to the EngineWorker through its queues."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvcli.config import SamplingParams
from kvcli.engine.outputs import RequestOutput
from kvcli.model.tokenizer import Tokenizer
from kvcli.server.metrics import CONTENT_TYPE, ServerMetrics
from kvcli.server.protocol import ChatCompletionRequest, CompletionRequest
from kvcli.server.worker import Accepted, EngineWorker, Rejected, RequestStream

BodyT = TypeVar("BodyT", bound=BaseModel)
DISCONNECT_CHECK_S = 0.5  # how often a handler asks whether its client is still there
GONE = object()  # put on a request's queue when its client disconnected


@dataclass(frozen=True)
class ServerInfo:
    model_name: str
    max_model_len: int
    created: int
    vocab_size: int


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class ClientGone(Exception):
    pass


def error_response(status: int, message: str) -> JSONResponse:
    kind = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}.get(status, "Error")
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def validation_message(errors: list) -> str:
    """pydantic's errors as one line: 'max_tokens: Input should be ...; foo: Extra inputs ...'."""
    parts = []
    for err in errors:
        if err.get("type") == "json_invalid":
            return f"request body is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')})"
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return "; ".join(parts) or "invalid request"


def create_app(worker: EngineWorker, tokenizer: Tokenizer, info: ServerInfo, metrics: ServerMetrics) -> FastAPI:
    app = FastAPI(title="kvcli serve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.get("/health")
    async def health() -> Response:
        if not worker.alive:
            return error_response(503, f"engine is not running ({worker.error or 'shut down'})")
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": info.model_name, "object": "model", "created": info.created,
                                            "owned_by": "kvcli", "max_model_len": info.max_model_len}]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    def check_model(name: str | None) -> None:
        if name is not None and name != info.model_name:
            raise ApiError(404, f"The model `{name}` does not exist (this server serves `{info.model_name}`).")

    def sampling(body: CompletionRequest | ChatCompletionRequest, prompt_len: int, max_tokens: int | None) -> SamplingParams:
        room = info.max_model_len - prompt_len
        if room <= 0:
            raise ApiError(400, f"This model's maximum context length is {info.max_model_len} tokens; the prompt "
                                f"has {prompt_len}.")
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise ApiError(400, f"This model's maximum context length is {info.max_model_len} tokens. However, "
                                f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                                f"{max_tokens} for the completion). Please reduce the prompt or max_tokens.")
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                  top_k=max(0, body.top_k), seed=body.seed, stop=body.stop_list,
                                  stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos)
        except ValueError as e:
            raise ApiError(400, str(e)) from None

    async def submit(req_id: str, ids: list[int], params: SamplingParams) -> RequestStream:
        stream = RequestStream(asyncio.get_running_loop())
        worker.submit(req_id, ids, params, stream)
        first = await stream.queue.get()
        if isinstance(first, Rejected):
            raise ApiError(first.status, first.message)
        assert isinstance(first, Accepted)
        return stream

    async def events(request: Request, req_id: str, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        """The request's outputs until it finishes; a client that went away aborts it (the engine frees
        its blocks), and so does any other way out of the loop (cancellation at shutdown, or starlette
        cancelling a stream whose client disconnected)."""
        done = False

        async def watch_disconnect() -> None:
            # A slow poll, off the token path: a non-streamed request has no other way to notice.
            while not await request.is_disconnected():
                await asyncio.sleep(DISCONNECT_CHECK_S)
            stream.queue.put_nowait(GONE)

        watcher = asyncio.create_task(watch_disconnect())
        try:
            while not done:
                item = await stream.queue.get()
                if item is GONE:
                    raise ClientGone
                if isinstance(item, Rejected):  # the engine stopped under the request
                    done = True
                    raise ApiError(item.status, item.message)
                done = item.finished
                yield item
        finally:
            watcher.cancel()
            if not done:
                worker.abort(req_id)

    def finish_reason(reason: str | None) -> str | None:
        # "kv_budget": the pool could not hold the request's context even alone; OpenAI clients know
        # only stop / length, and it did stop on a length.
        return "length" if reason == "kv_budget" else reason

    def usage(prompt: int, completion: int) -> dict:
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def sse(obj: dict) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def run(request: Request, body: CompletionRequest | ChatCompletionRequest, ids: list[int],
                  max_tokens: int | None, chat: bool) -> Response:
        check_model(body.model)
        params = sampling(body, len(ids), max_tokens)
        req_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        stream = await submit(req_id, ids, params)
        created = int(time.time())
        head = {"id": req_id, "created": created, "model": info.model_name}

        if not body.stream:
            text, n, reason = [], 0, None
            try:
                async for out in events(request, req_id, stream):
                    text.append(out.new_text)
                    n += len(out.new_token_ids)
                    reason = out.finish_reason
            except ClientGone:
                return Response(status_code=499)  # nobody reads it; the request was aborted
            joined = "".join(text)
            choice = ({"index": 0, "message": {"role": "assistant", "content": joined}} if chat
                      else {"index": 0, "text": joined, "logprobs": None})
            choice["finish_reason"] = finish_reason(reason)
            return JSONResponse({**head, "object": "chat.completion" if chat else "text_completion",
                                 "choices": [choice], "usage": usage(len(ids), n)})

        include_usage = body.stream_options is not None and body.stream_options.include_usage
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, reason: str | None, role: bool = False) -> dict:
            if chat:
                delta: dict = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
                c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                c = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
            return {**head, "object": kind, "choices": [c]}

        async def body_iter() -> AsyncIterator[str]:
            n = 0
            try:
                if chat:
                    yield sse(chunk(None, None, role=True))
                async for out in events(request, req_id, stream):
                    n += len(out.new_token_ids)
                    if out.finished:
                        yield sse(chunk(out.new_text or None, finish_reason(out.finish_reason)))
                    elif out.new_text:
                        yield sse(chunk(out.new_text, None))
                if include_usage:
                    yield sse({**head, "object": kind, "choices": [], "usage": usage(len(ids), n)})
                yield "data: [DONE]\n\n"
            except ClientGone:
                return
            except ApiError as e:  # headers are sent: report in-band, as vLLM does
                yield sse({"error": {"message": e.message, "type": "ServiceUnavailableError", "code": e.status}})
                yield "data: [DONE]\n\n"

        return StreamingResponse(body_iter(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def parse(request: Request, model: type[BodyT]) -> BodyT:
        # Parsed here rather than by FastAPI's body injection so that a body sent without a JSON
        # content type (curl -d) is still read as JSON, and every failure is the same one-line 400.
        raw = await request.body()
        try:
            return model.model_validate_json(raw)
        except ValidationError as e:
            raise ApiError(400, validation_message(e.errors())) from None

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await parse(request, CompletionRequest)
        ids = list(body.prompt) if isinstance(body.prompt, list) else tokenizer.encode(body.prompt)
        if not ids:
            raise ApiError(400, "prompt has no tokens")
        if isinstance(body.prompt, list) and max(ids) >= info.vocab_size:
            raise ApiError(400, f"prompt token id {max(ids)} is outside the vocabulary (size {info.vocab_size})")
        return await run(request, body, ids, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await parse(request, ChatCompletionRequest)
        try:
            ids = tokenizer.apply_chat_template([m.model_dump(exclude_none=True) for m in body.messages],
                                                add_generation_prompt=True)
        except Exception as e:  # a template that refuses the roles given (e.g. no system role)
            raise ApiError(400, f"chat template: {e}") from None
        return await run(request, body, list(ids), body.limit, chat=True)

    return app
