"""`kvcli watch URL`: poll a server's /metrics and show the dashboard panels its metrics allow.

A server unreachable at the start is a one-line error; once watching, a failed or garbled scrape is
shown in the view, which keeps the last good sample, and polling goes on."""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.live import Live

from kvcli.inputs import InputError, check_outputs, write_text_file
from kvcli.remote.auth import auth_headers, refused_key
from kvcli.remote.scrape import ScrapeError, ServerSample, parse
from kvcli.remote.timeline import Timeline, plot_timeline
from kvcli.view.figure_file import check_plot

if TYPE_CHECKING:  # common imports the engine (torch): watch needs neither
    from kvcli.commands.common import Fail


@dataclass(frozen=True)
class WatchArgs:
    url: str
    interval: float
    duration: float | None
    once: bool
    record: Path | None
    plot: Path | None
    live: bool
    api_key: str | None = None  # sent as a Bearer token (a server whose /metrics needs its key)


def metrics_url(url: str, fail: "Fail") -> str:
    """URL as given, or its /metrics when only the server's root is given."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        if "://" in url:
            fail(f"{url}: only http:// and https:// URLs can be watched")
        url = "http://" + url
    import httpx

    try:
        host = httpx.URL(url).host
    except httpx.InvalidURL as e:
        fail(f"{url}: not a URL that can be watched ({e})")
    if not host:
        fail(f"{url}: no host to watch")
    return url if url.endswith("/metrics") else url + "/metrics"


class Scraper:
    def __init__(self, url: str, timeout: float, api_key: str | None = None) -> None:
        import httpx

        self.url = url
        self.api_key = api_key
        self.client = httpx.Client(timeout=timeout, follow_redirects=False, trust_env=False,
                                   headers=auth_headers(api_key))
        self.t0 = time.monotonic()

    def scrape(self) -> ServerSample:
        """One sample; any failure is a ScrapeError with a short reason."""
        import httpx

        t = time.monotonic() - self.t0
        try:
            r = self.client.get(self.url)
        except httpx.TimeoutException:
            raise ScrapeError(f"{self.url}: no answer within {self.client.timeout.read}s") from None
        except httpx.HTTPError as e:
            raise ScrapeError(f"{self.url}: {type(e).__name__} ({e})") from None
        if r.status_code != 200:
            raise ScrapeError(f"{self.url}: HTTP {r.status_code}{refused_key(r.status_code, self.api_key)}")
        try:
            return parse(r.text, t)
        except ScrapeError as e:
            raise ScrapeError(f"{self.url}: {e}") from None

    def close(self) -> None:
        self.client.close()


def run_watch(a: WatchArgs, fail: "Fail") -> int:
    from kvcli.view.server_view import log_line, render_server

    if not a.interval > 0:
        fail(f"--interval must be > 0 seconds (got {a.interval})")
    if a.duration is not None and not a.duration > 0:
        fail(f"--duration must be > 0 seconds (got {a.duration})")
    check_plot(a.plot, fail)
    check_outputs((a.record, a.plot), fail)
    url = metrics_url(a.url, fail)
    scraper = Scraper(url, timeout=max(1.0, min(5.0, 4 * a.interval)), api_key=a.api_key)
    tl = Timeline(url)
    try:
        tl.add(scraper.scrape())
    except ScrapeError as e:
        scraper.close()
        fail(f"cannot watch: {e}")

    out = Console()
    if not out.is_terminal:
        out = Console(width=max(out.width, 120))  # a pipe or a file: the full layout, not 80 columns
    status = ""
    use_live = a.live and out.is_terminal and not a.once
    deadline = None if a.duration is None else time.monotonic() + a.duration
    stopped = 0

    term = [False]

    def on_term(signum, frame) -> None:  # SIGTERM ends a watch as Ctrl-C does: record and plot still written
        term[0] = True
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, on_term)
    live = Live(get_renderable=lambda: render_server(tl, status, out.width), console=out,
                refresh_per_second=max(1.0, 1 / a.interval), transient=False) if use_live else None
    try:
        if live is not None:
            live.start()
        elif not a.once:
            print(log_line(tl), flush=True)
        next_t = time.monotonic() + a.interval
        while not a.once and (deadline is None or time.monotonic() < deadline):
            if deadline is not None and next_t > deadline:  # --duration ends inside this interval: no more samples
                time.sleep(max(0.0, deadline - time.monotonic()))
                break
            time.sleep(max(0.0, next_t - time.monotonic()))
            next_t += a.interval
            if next_t < time.monotonic():  # a slow scrape: skip ticks instead of bursting
                next_t = time.monotonic() + a.interval
            try:
                tl.add(scraper.scrape())
                status = ""
            except ScrapeError as e:
                status = f"{e} · showing the last good sample"
                tl.error(time.monotonic() - scraper.t0, str(e))
            if live is None:
                print(log_line(tl, status), flush=True)
    except KeyboardInterrupt:
        stopped = 143 if term[0] else 130  # 128 + the signal, as a shell reports it
    finally:
        signal.signal(signal.SIGTERM, old_term)
        if live is not None:
            live.stop()
        scraper.close()
    if live is None:
        out.print(render_server(tl, status, out.width))
    if a.record is not None:
        try:
            write_text_file(a.record, tl.to_json())
        except InputError as e:
            fail(str(e))
    if a.plot is not None:
        try:
            plot_timeline(tl, str(a.plot))
        except OSError as e:
            fail(f"{a.plot}: cannot write ({e.strerror or e})")
    return stopped
