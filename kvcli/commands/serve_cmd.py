"""`kvcli serve`: build the engine once, run it in its worker thread, and serve the HTTP API with
uvicorn until Ctrl-C / SIGTERM (uvicorn's own handlers: open requests get a few seconds, then are
cancelled, which aborts them in the engine)."""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvcli.commands.common import Fail, build_engine
from kvcli.options import EngineOptions


@dataclass(frozen=True)
class ServeArgs:
    model: str | None
    quant: str
    options: EngineOptions
    host: str
    port: int
    served_model_name: str | None
    log_level: str
    api_key: str | None = None
    metrics_need_key: bool = False
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    max_request_bytes: int = 8 * 2**20
    max_tokens_default: int | None = None
    max_waiting_requests: int = 256
    request_timeout: float | None = None


def bind(host: str, port: int, fail: Fail) -> socket.socket:
    """The listening socket, bound here so a taken port or a bad host is one line before the model
    loads, and so port 0 (any free port) can be announced."""
    if not 0 <= port <= 65535:
        fail(f"--port must be in 0..65535 (got {port})")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        fail(f"--host {host}: cannot resolve ({e.strerror})")
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        why = "address already in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
        fail(f"cannot listen on {host}:{port}: {why}")
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that Ctrl-C / SIGTERM only stop it: uvicorn re-raises the signal
        after its graceful shutdown, which would kill the process before the engine thread stops."""

        signal_received: int | None = None
        on_exit: "Callable[[], None] | None" = None

        def handle_exit(self, sig: int, frame) -> None:
            self.signal_received = sig
            if self.on_exit is not None:
                self.on_exit()  # open requests end now (in-band error), so the graceful shutdown is quick
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)

    return Server


def _window_note(engine) -> str:
    """The bounded cache on the start line: each request keeps its sinks and its last W tokens."""
    r = engine.retention
    if r is None:
        return ""
    return (f" · bounded KV: {r.sink_slots:,} sink + {r.window:,} window tokens per request (dropped tokens in "
            f"/metrics: kvcli:kv_tokens_dropped_total)")


def check_origins(origins: tuple[str, ...], fail: Fail) -> None:
    """--allowed-origins: '*' or what a browser sends as Origin (scheme://host[:port], http or https, no path);
    anything else would never match a request, so CORS would stay off without a word."""
    from urllib.parse import urlsplit

    for o in origins:
        if o == "*":
            continue
        try:
            u = urlsplit(o)
            ok = u.scheme in ("http", "https") and bool(u.hostname) and u.path == "" and not (u.query or u.fragment)
            u.port  # noqa: B018  (raises on a port that is not a number)
        except ValueError:
            ok = False
        if not ok:
            fail(f"--allowed-origins {o}: an origin is scheme://host[:port] (e.g. https://app.example), or '*'")


def run_serve(a: ServeArgs, fail: Fail) -> int:
    import uvicorn

    from kvcli.model.tokenizer import NO_CHAT_TEMPLATE, has_chat_template
    from kvcli.server.app import Security, ServeLimits, ServerInfo, build_app
    from kvcli.server.guard import LOOPBACK_NAMES
    from kvcli.server.metrics import ServerMetrics
    from kvcli.server.worker import EngineWorker

    check_origins(a.allowed_origins, fail)
    sock = bind(a.host, a.port, fail)
    engine = build_engine(a.model, a.quant, a.options, fail)
    if engine.tokenizer is None:
        fail("kvcli serve needs a model with a tokenizer")
    name = a.served_model_name or (Path(engine.source).name if engine.source else engine.config.name)
    cache_info = {"block_size": str(engine.options.block_size), "cache_dtype": str(engine.kv_dtype).removeprefix("torch."),
                  "num_gpu_blocks": str(engine.num_blocks), "enable_prefix_caching": str(engine.options.prefix_caching),
                  "kv_layout": engine.options.kv_layout}
    worker_ref: list[EngineWorker] = []
    metrics = ServerMetrics(name, engine.max_model_len, lambda: worker_ref[0].latest(), cache_info)
    worker = EngineWorker(engine, metrics)
    worker_ref.append(worker)
    capacity = engine.request_capacity
    info = ServerInfo(name, engine.max_model_len, int(time.time()), engine.config.vocab_size,
                      engine.options.block_size, bool(engine.options.prefix_caching and engine.kv.supports_sharing),
                      capacity if capacity < engine.max_model_len else None)
    host, port = sock.getsockname()[:2]
    loopback = is_loopback(host)
    hosts = ((*LOOPBACK_NAMES, *a.allowed_hosts) if loopback else (a.allowed_hosts or None))
    limits = ServeLimits(max_request_bytes=a.max_request_bytes, max_tokens_default=a.max_tokens_default,
                         max_waiting_requests=a.max_waiting_requests, max_num_seqs=engine.options.max_num_seqs,
                         request_timeout_s=a.request_timeout)
    security = Security(api_key=a.api_key, metrics_need_key=a.metrics_need_key, allowed_hosts=hosts,
                        allowed_origins=a.allowed_origins)
    app = build_app(worker, engine.tokenizer, info, metrics, limits, security)
    shown = f"[{host}]" if ":" in host else host
    print(f"kvcli serve: {name} · {engine.num_blocks:,} KV blocks x {engine.options.block_size} tokens "
          f"({engine.kv_pool_bytes / 2**20:,.1f} MiB, {str(engine.kv_dtype).removeprefix('torch.')}) · "
          f"max_model_len {engine.max_model_len:,}" + _window_note(engine), file=sys.stderr)
    if capacity < engine.max_model_len:
        print(f"kvcli: note: the KV pool holds {capacity:,} tokens of one request, fewer than max_model_len "
              f"{engine.max_model_len:,}: a longer prompt plus max_tokens is refused (raise --kv-budget or lower "
              "--max-model-len)", file=sys.stderr)
    if not has_chat_template(engine.tokenizer):
        print("kvcli: note: " + NO_CHAT_TEMPLATE.format(what="/v1/chat/completions conversations"), file=sys.stderr)
    if not loopback and not a.api_key:
        print("kvcli: note: listening beyond loopback without --api-key: anyone who reaches this port can use "
              "the API", file=sys.stderr)
    print(f"kvcli serve: listening on http://{shown}:{port} (Ctrl-C stops)", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, log_level=a.log_level, access_log=a.log_level == "debug",
                            timeout_graceful_shutdown=3, lifespan="off")
    server = _server_class()(config)
    server.on_exit = worker.request_stop
    worker.start()
    try:
        server.run(sockets=[sock])
    finally:
        worker.stop()
        sock.close()
    print("kvcli serve: stopped", file=sys.stderr)
    return 130 if server.signal_received == signal.SIGINT else 0
