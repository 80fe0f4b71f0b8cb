"""The full dashboard while a chat reply streams (--live, /live), and where the reply's text goes.

Without the dashboard a reply's pieces go straight to stdout. Under it, with stdout on the same
terminal, they are printed above the panels a line at a time (LiveDashboard.print_above), so only
whole lines are written while it is up; the unfinished line is drawn above the panels instead and written out when
the dashboard closes. The dashboard goes away when the reply ends, leaving the reply as text.
"""

from __future__ import annotations

import os
import sys
import time

from rich.console import Console, Group, RenderableType
from rich.text import Text

from kvcli.metrics.memory import MemoryProbe
from kvcli.view.dashboard import LiveDashboard

REFRESH_S = 0.2  # a snapshot (with a block walk and a memory sample) at most this often
_PENDING_ROWS = 3  # rows of the unfinished line shown above the panels


def stdout_is_terminal() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


class ChatDashboard(LiveDashboard):
    """LiveDashboard with the reply's unfinished line above it; draws nothing once `closing` is set,
    so stopping the Live removes the panels."""

    def __init__(self, console: Console, *, redirect_stdout: bool) -> None:
        super().__init__(console, live=True, redirect_stdout=redirect_stdout)
        self.pending = ""
        self.closing = False

    def renderable(self) -> RenderableType:
        if self.closing:
            return Group()
        body = super().renderable()
        if not self.pending:
            return body
        tail = self.pending[-_PENDING_ROWS * max(1, self.console.width):]
        return Group(Text(tail, overflow="fold"), body)


class _NoEcho:
    """Terminal echo off on stdin while the dashboard is up: an echoed ^C or typed-ahead text would
    move the cursor under rich's Live, which then redraws (and erases) from the wrong row."""

    def __init__(self) -> None:
        self.saved: tuple[int, list] | None = None

    def __enter__(self) -> "_NoEcho":
        try:
            import termios
        except ImportError:  # not POSIX
            return self
        try:
            fd = sys.stdin.fileno()
            if os.isatty(fd):
                attrs = termios.tcgetattr(fd)
                self.saved = (fd, list(attrs))
                attrs[3] &= ~(termios.ECHO | getattr(termios, "ECHOCTL", 0))  # lflag
                termios.tcsetattr(fd, termios.TCSANOW, attrs)
        except (OSError, ValueError, AttributeError, termios.error):  # stdin replaced, closed, not a tty
            self.saved = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self.saved is not None:
            import termios

            fd, attrs = self.saved
            try:
                termios.tcsetattr(fd, termios.TCSANOW, attrs)
            except (OSError, termios.error):
                pass
            self.saved = None


class ReplyView:
    """One reply's output: `with view:` around the engine loop, `update()` after each step,
    `write()` for each piece of text, `finish()` once the loop has left the `with`."""

    def __init__(self, engine, console: Console, probe: MemoryProbe | None) -> None:
        self.engine = engine
        self.probe = probe
        self.whole_lines = probe is not None and stdout_is_terminal()
        self.dash = ChatDashboard(console, redirect_stdout=self.whole_lines) if probe is not None else None
        self.weights = sum(engine.weight_bytes().values()) if probe is not None else 0
        self.held = ""
        self.last = float("-inf")
        self.no_echo = _NoEcho()

    def __enter__(self) -> "ReplyView":
        if self.dash is not None:
            self.no_echo.__enter__()
            self.update(force=True)  # the first frame shows the pool before the prefill
            self.dash.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.dash is not None:
            self.dash.closing = True
            try:
                self.dash.__exit__(None, None, None)
            finally:
                self.no_echo.__exit__()

    def update(self, force: bool = False) -> None:
        if self.dash is None:
            return
        now = time.perf_counter()
        if force or now - self.last >= REFRESH_S:
            self.last = now
            e = self.engine
            self.dash.update(e.snapshot(self.probe.sample(e.kv_pool_bytes, self.weights), block_map=True))

    def write(self, piece: str) -> None:
        if not self.whole_lines:
            sys.stdout.write(piece)
            sys.stdout.flush()
            return
        text = self.held + piece
        cut = text.rfind("\n") + 1
        self.held = text[cut:]
        # Before printing: the print redraws the dashboard, which must not show the printed line a
        # second time as pending.
        self.dash.pending = self.held
        if cut:
            self.dash.print_above(text[:cut])

    def finish(self) -> None:
        """After the dashboard closed: the held unfinished line, and plain writes from now on."""
        self.whole_lines = False
        if self.held:
            sys.stdout.write(self.held)
            sys.stdout.flush()
            self.held = ""
