"""A real terminal for tests: a detached tmux pane driven by send-keys and read by capture-pane."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
import uuid


class Tmux:
    """A detached tmux session on a private server socket, driven by send-keys and read by capture-pane."""

    def __init__(self, command: str, width: int = 120, height: int = 40, history: int = 400) -> None:
        self.history = history  # scrollback rows read back (tmux keeps 2,000)
        self.sock = f"kvcli-test-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.name = "chat"
        # COLUMNS/LINES from the test's environment would override the pane's size for rich.
        self._tmux("new-session", "-d", "-s", self.name, "-x", str(width), "-y", str(height),
                   "-c", tempfile.gettempdir(), f"unset COLUMNS LINES; {command}")

    def _tmux(self, *args: str) -> str:
        # -u: UTF-8 whatever the locale (the status line uses "·").
        return subprocess.run(["tmux", "-u", "-f", "/dev/null", "-L", self.sock, *args], capture_output=True,
                              text=True, encoding="utf-8", errors="replace", timeout=30, check=True).stdout

    def send(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", self.name, *keys)

    def type_line(self, text: str) -> None:
        self._tmux("send-keys", "-t", self.name, "-l", text)
        self.send("Enter")

    def paste(self, text: str) -> None:
        """`text` as a terminal paste delivers it (tmux's paste-buffer: newlines arrive as carriage returns)."""
        self._tmux("set-buffer", "-b", "kvcli-paste", text)
        self._tmux("paste-buffer", "-d", "-b", "kvcli-paste", "-t", self.name)

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-J", "-t", self.name, "-S", f"-{self.history}")

    def wait(self, pred, what: str, timeout: float = 90.0) -> str:
        deadline = time.monotonic() + timeout
        text = ""
        while time.monotonic() < deadline:
            text = self.screen()
            if pred(text):
                return text
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; screen:\n{text}")

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.sock, "kill-server"], capture_output=True, timeout=30)


def at_prompt(text: str) -> bool:
    lines = [line for line in text.splitlines() if line.strip()]
    return bool(lines) and lines[-1].rstrip() == "you>"


def after(text: str, marker: str) -> list[str]:
    """The screen lines after the last line containing `marker`."""
    lines = text.splitlines()
    idx = max((i for i, line in enumerate(lines) if marker in line), default=None)
    return [] if idx is None else lines[idx + 1:]
