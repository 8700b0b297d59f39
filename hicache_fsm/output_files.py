"""Opening the files a command writes: a FIFO that no process reads is an error, not a wait forever.

``open(path, "w")`` on a FIFO blocks until some process opens it for
reading; a mistyped ``--record`` or ``-o`` naming one would hang the
command before any work. Opening without blocking fails at once
(``ENXIO``) where no reader is there, and a FIFO or terminal that has one
(``-o /dev/stdout`` into a pipe) is written as before.
"""

from __future__ import annotations

import errno
import os
from typing import IO

__all__ = ["NO_READER", "open_output_text", "write_output_text"]

NO_READER = "a FIFO that no process reads (writing it would wait forever)"


def open_output_text(path: str | os.PathLike) -> IO[str]:
    """``open(path, "w", encoding="utf-8")``, except that a FIFO with no reader raises ``OSError`` (``ENXIO``)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise OSError(errno.ENXIO, NO_READER, os.fspath(path)) from None
        raise
    try:
        os.set_blocking(fd, True)  # a reader is there: writes wait for it as a plain open's would
        return os.fdopen(fd, "w", encoding="utf-8")
    except BaseException:
        os.close(fd)
        raise


def write_output_text(path: str | os.PathLike, text: str) -> None:
    """``Path(path).write_text(text, encoding="utf-8")`` through ``open_output_text``."""
    with open_output_text(path) as f:
        f.write(text)
