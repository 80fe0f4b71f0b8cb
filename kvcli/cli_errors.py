"""How the command line ends on errors it does not raise itself: usage errors from the parser and
output that cannot be written. Both become one `kvcli: error:` line on stderr, like every error the
commands report, instead of a usage box or a traceback."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import typer
from typer.core import TyperGroup

try:  # typer 0.2x parses with its own copy of click
    from typer._click.exceptions import NoArgsIsHelpError, UsageError
except ImportError:  # older typer: click itself
    from click.exceptions import NoArgsIsHelpError, UsageError


@contextmanager
def _one_line_errors() -> Iterator[None]:
    """Usage errors (a value of the wrong type, an unknown flag or command) and output that cannot
    be written (full disk, a folder that vanished, stdout closed or full) end like every other
    error: one `kvcli: error:` line, no usage box, no traceback."""
    try:
        yield
    except NoArgsIsHelpError:
        raise  # `kvcli` alone prints the help
    except UsageError as e:
        print(f"kvcli: error: {e.format_message()}", file=sys.stderr)
        raise typer.Exit(e.exit_code) from None
    except OSError as e:
        print(f"kvcli: error: {_os_error_message(e)}", file=sys.stderr)
        raise typer.Exit(1) from None


def _os_error_message(e: OSError) -> str:
    reason = e.strerror or str(e)
    if isinstance(e, StdoutError):
        _silence_stdout()
        return f"cannot write to standard output ({reason})"
    if e.filename:
        return f"{e.filename}: {reason}"
    return f"cannot write output ({reason})"


class StdoutError(OSError):
    """A write to standard output failed (a full disk, a reader that closed the pipe)."""


class _GuardedStdout:
    """sys.stdout while a command runs: the same stream, but a failed write says it was stdout."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            raise StdoutError(e.errno, e.strerror) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            raise StdoutError(e.errno, e.strerror) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _silence_stdout() -> None:
    """Point a failed stdout at /dev/null, so the interpreter's flush at exit does not complain."""
    try:
        fd = sys.stdout.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
    except (OSError, ValueError, AttributeError):
        pass  # not a real file (a test runner's buffer): nothing will flush it at exit


class OneLineErrorGroup(TyperGroup):
    """kvcli's command group: every command runs under `_one_line_errors`."""

    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        with _one_line_errors():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: Any) -> Any:
        stdout = sys.stdout
        sys.stdout = _GuardedStdout(stdout)
        try:
            with _one_line_errors():
                return super().invoke(ctx)
        finally:
            sys.stdout = stdout
