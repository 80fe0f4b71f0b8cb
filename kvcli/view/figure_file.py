"""Plot files (--plot on profile and watch): which formats a path's suffix asks for, checked before a run starts,
and the write itself, one place for the three plots."""

from __future__ import annotations

import io
from pathlib import Path

from kvcli.inputs import InputError


def plot_format(path: Path | str) -> str:
    """The image format a --plot path names by its suffix (none: png), or an InputError naming the formats
    matplotlib writes: asked before a run, not after it."""
    fmt = Path(path).suffix.lstrip(".").lower() or "png"
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if fmt not in formats:
        raise InputError(f"{path}: a plot cannot be written as .{fmt} (formats: {', '.join(sorted(formats))})")
    return fmt


def check_plot(path: Path | str | None, fail) -> None:
    """plot_format's error for a --plot path (None: no plot asked for) through the command's `fail`."""
    if path is not None:
        try:
            plot_format(path)
        except InputError as e:
            fail(str(e))


def save_figure(fig, path: Path | str) -> None:
    """Draws `fig` into memory, then writes the file: matplotlib's PNG writer does not report a failed write (a
    full disk), so the bytes are written here, where an OSError reaches the caller. Closes the figure."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format=plot_format(path), dpi=110)
    plt.close(fig)
    Path(path).write_bytes(buf.getvalue())
