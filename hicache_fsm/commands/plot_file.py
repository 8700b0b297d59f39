"""Where ``simulate --plot`` writes, checked before the run, and written exactly there.

Left to itself matplotlib appends ``.png`` to a name without a suffix (the
report would name a file that is not there) and refuses an unknown suffix
only after the whole replay has run; both are settled up front here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hicache_fsm.commands.args import UsageError

DEFAULT_FORMAT = "png"  # for a name without a suffix


def plot_format(path: str) -> str:
    """The image format ``path`` asks for (its suffix; png without one)."""
    return Path(path).suffix[1:].lower() or DEFAULT_FORMAT


def check_plot_path(path: str) -> None:
    """``UsageError`` unless matplotlib can write ``path``'s format into an existing directory."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    fmt = plot_format(path)
    if fmt not in formats:
        raise UsageError(f"--plot {path}: matplotlib cannot write .{fmt} files (it writes {', '.join(sorted(formats))})")
    if os.path.isdir(path):
        raise UsageError(f"--plot {path}: is a directory")
    parent = Path(path).parent
    if not parent.is_dir():
        raise UsageError(f"--plot {path}: no directory {parent}")


def save_plot(fig: Any, path: str) -> None:
    """Write ``fig`` to exactly ``path``, in the format its suffix names."""
    fig.savefig(path, dpi=120, format=plot_format(path))


__all__ = ["check_plot_path", "plot_format", "save_plot"]
