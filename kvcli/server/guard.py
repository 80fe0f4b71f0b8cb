"""What every request passes before a route sees it (a plain ASGI middleware: no per-chunk cost on
streams). In order:

1. Host allow-list (DNS rebinding: a web page whose name resolves to 127.0.0.1 sends its own name as
   Host). Bound to loopback, only localhost, 127.0.0.1 and [::1] (any port) are accepted, plus
   `--allowed-hosts`; elsewhere only `--allowed-hosts` when given. Otherwise 421.
2. The API key (`--api-key` / KVCLI_API_KEY): `Authorization: Bearer KEY` on every /v1 route (and on
   /metrics with `--metrics-need-key`), compared in constant time. /health is always open. Otherwise 401.
3. POST bodies of the routes that take one (`body_paths`; a POST elsewhere goes on to the router's 404 / 405):
   `Content-Type: application/json` (a cross-site `text/plain` POST needs no CORS
   preflight, so a web page could send one) else 415; at most `max_body_bytes` (a declared
   Content-Length over it is refused before a byte is read, a chunked body as soon as it passes) else
   413. The body is read here and handed on whole.

CORS headers are added only with `--allowed-origins` (starlette's CORSMiddleware, outside this one but
inside the Host check).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, Iterable

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


def error_body(status: int, message: str, code: str, type_: str = "invalid_request_error",
               param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()


async def send_error(send: Send, status: int, message: str, code: str, type_: str = "invalid_request_error",
                     extra_headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    body = error_body(status, message, code, type_)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *extra_headers]})
    await send({"type": "http.response.body", "body": body})


def host_name(host: str) -> str:
    """The Host header without its port, lowercased, without a trailing dot."""
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        name = host[:end + 1] if end >= 0 else host
    else:
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    return name.rstrip(".")


class HostCheck:
    def __init__(self, app: ASGIApp, allowed: Iterable[str] | None) -> None:
        self.app = app
        self.allowed = None if allowed is None else {host_name(h) for h in allowed}
        self.any = self.allowed is not None and "*" in self.allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.allowed is not None and not self.any:
            host = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"host"), None)
            if host is not None and host_name(host) not in self.allowed:
                await send_error(send, 421, f"Host {host!r} is not served here (kvcli serve --allowed-hosts "
                                            "adds names)", "misdirected_request")
                return
        await self.app(scope, receive, send)


class Guard:
    def __init__(self, app: ASGIApp, *, api_key: str | None, metrics_need_key: bool, max_body_bytes: int,
                 body_paths: Iterable[str]) -> None:
        self.app = app
        self.body_paths = frozenset(body_paths)
        self.key = None if not api_key else api_key.encode()
        self.metrics_need_key = metrics_need_key
        self.max_body = max_body_bytes

    def _needs_key(self, path: str) -> bool:
        if self.key is None:
            return False
        return path.startswith("/v1") or (self.metrics_need_key and path.startswith("/metrics"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: dict[bytes, bytes] = {}
        for k, v in scope.get("headers", ()):
            headers.setdefault(k, v)
        if self._needs_key(scope["path"]) and scope["method"] != "OPTIONS":
            auth = headers.get(b"authorization", b"")
            scheme, _, given = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.key):
                why = "missing" if not auth else "incorrect"
                await send_error(send, 401, f"API key {why}: send the server's key as 'Authorization: Bearer KEY'",
                                 "invalid_api_key", extra_headers=[(b"www-authenticate", b"Bearer")])
                return
        if scope["method"] != "POST" or scope["path"] not in self.body_paths:
            await self.app(scope, receive, send)
            return
        ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if ctype != b"application/json":
            shown = ctype.decode("latin-1") or "none"
            await send_error(send, 415, f"Content-Type must be application/json (got {shown})",
                             "unsupported_media_type")
            return
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            await self._too_large(send)
            return
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            part = msg.get("body", b"")
            size += len(part)
            if size > self.max_body:
                await self._too_large(send)
                return
            chunks.append(part)
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        first = True

        async def replay() -> dict:
            nonlocal first
            if first:
                first = False
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send) -> None:
        await send_error(send, 413, f"request body larger than this server's limit of {self.max_body:,} bytes "
                                    "(kvcli serve --max-request-bytes)", "request_too_large",
                         extra_headers=[(b"connection", b"close")])
