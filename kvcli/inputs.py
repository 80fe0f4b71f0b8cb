"""Reading user files with one-line errors for every way they can be wrong."""

from __future__ import annotations

import os
from pathlib import Path


class InputError(ValueError):
    pass


def read_text_file(path: Path) -> str:
    if not path.exists():
        raise InputError(f"{path}: no such file")
    if path.is_dir():
        raise InputError(f"{path}: is a directory, expected a text file")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None
    if not data:
        raise InputError(f"{path}: file is empty")
    if not data.strip():
        raise InputError(f"{path}: file holds only whitespace, no text")
    nul = data.find(b"\x00")  # anywhere: a NUL past the first page is as binary as one in it
    if nul >= 0:
        raise InputError(f"{path}: looks binary (a NUL byte at {nul:,}), expected UTF-8 text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not valid UTF-8 (byte {e.start}: {data[e.start]:#04x})") from None
    return text.removeprefix("\ufeff")


def check_writable(path: Path) -> None:
    """Fail before hours of generation, not after."""
    if path.is_dir():
        raise InputError(f"{path}: is a directory")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(f"{path}: folder {parent} does not exist")
    existed = path.exists()
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as e:
        raise InputError(f"{path}: cannot write ({e.strerror})") from None
    if not existed:  # the probe leaves nothing behind: a run that fails before writing creates no empty file
        path.unlink(missing_ok=True)


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file (links and relative spellings included), existing or not."""
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
        return a.resolve() == b.resolve()
    except (OSError, RuntimeError):  # unreadable, a link loop
        return False


def check_outputs(paths, fail, inputs=()) -> None:
    """check_writable for every output path given (None: not asked for), and none of them one of the command's
    input files (the result would replace the text it came from) or given twice (the second would overwrite the
    first): checked before anything is created. The first problem goes to `fail` as the one-line error."""
    given = [p for p in paths if p is not None]
    for i, p in enumerate(given):
        for src in inputs:
            if src is not None and same_file(p, src):
                fail(f"{p}: is the input file {src}; writing the result there would replace it")
        for q in given[:i]:
            if same_file(p, q):
                fail(f"{p}: given for two outputs; the second would overwrite the first")
    for p in given:
        try:
            check_writable(p)
        except InputError as e:
            fail(str(e))


def write_text_file(path: Path, text: str) -> None:
    """Write a result file; a full disk or a folder removed since `check_writable` is an InputError."""
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise InputError(f"{path}: cannot write ({e.strerror or e})") from None
