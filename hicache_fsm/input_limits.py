"""Bounds on untrusted input, checked before any work: file kinds, JSON depth, what memory could hold.

A command reading a file it was pointed at must not hang on a FIFO, read
/dev/zero forever, recurse through ``[[[[...`` or size a buffer from a number
in the file: these helpers let it refuse all of that first, each with a
message naming the limit.
"""

from __future__ import annotations

import os
import re
import stat
from typing import IO

import numpy as np

MAX_JSON_DEPTH = 32  # nested arrays/objects in one JSON document; the formats we read need 2 or 3
MEMORY_SHARE = 2  # plan for at most 1/2 of the memory available now
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_OPEN = np.frombuffer(b"[{", dtype=np.uint8)
_CLOSE = np.frombuffer(b"]}", dtype=np.uint8)


class InputRefused(ValueError):
    """An input crosses a bound; callers turn it into their own typed error (it names the limit)."""


def available_memory_bytes() -> int:
    """Memory the machine could give this process now (MemAvailable, else physical memory)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return 1 << 34  # unknown: assume 16 GiB


def memory_budget_bytes() -> int:
    """What one input may make us allocate: a share of the memory available now."""
    return available_memory_bytes() // MEMORY_SHARE


def max_items(bytes_each: int) -> int:
    """How many items of ``bytes_each`` bytes the memory budget holds."""
    return max(1, memory_budget_bytes() // bytes_each)


def check_count(value: int, bytes_each: int, what: str) -> int:
    """``value`` itself, or InputRefused when ``value`` items of ``bytes_each`` bytes exceed the budget (so does
    one item larger than the whole budget)."""
    limit = memory_budget_bytes() // bytes_each
    if value > limit:
        raise InputRefused(f"{what} {value} is more than this machine could hold (limit {limit}: "
                           f"{bytes_each} bytes each within half of the {available_memory_bytes() >> 20} MiB "
                           "available)")
    return value


def json_depth(text: str) -> int:
    """Deepest nesting of arrays and objects in a JSON text (strings skipped), without parsing it."""
    data = np.frombuffer(_STRING.sub('""', text).encode("utf-8", "surrogatepass"), dtype=np.uint8)
    if not data.size:
        return 0
    steps = np.isin(data, _OPEN).astype(np.int32) - np.isin(data, _CLOSE).astype(np.int32)
    return int(np.cumsum(steps).max(initial=0))


def check_json_depth(text: str, limit: int = MAX_JSON_DEPTH) -> str:
    """``text`` itself, or InputRefused when it nests deeper than ``limit`` (json.loads would recurse)."""
    depth = json_depth(text)
    if depth > limit:
        raise InputRefused(f"JSON nested {depth} levels deep (limit {limit})")
    return text


def _refuse_special(mode: int) -> None:
    if stat.S_ISDIR(mode):
        raise InputRefused("is a directory, not a regular file")
    if not stat.S_ISREG(mode):
        raise InputRefused("not a regular file (a FIFO, socket or device is never read)")


def open_regular_text(path: str | os.PathLike, max_bytes: int | None = None) -> IO[str]:
    """Open a regular file for reading text (UTF-8), refusing anything else before it could block.

    A leading byte-order mark, as some editors and Windows tools write, is skipped.

    ``stat`` first, so a FIFO is never opened; then open without blocking and
    check the opened file again (it may have been swapped in between).
    ``max_bytes``: refuse larger files. OSError as ``open`` raises it.
    """
    if "\0" in os.fspath(path):  # os.stat would raise ValueError
        raise InputRefused("a path cannot contain a NUL character")
    _refuse_special(os.stat(path).st_mode)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        _refuse_special(info.st_mode)
        if max_bytes is not None and info.st_size > max_bytes:
            raise InputRefused(f"file is {info.st_size} bytes (limit {max_bytes})")
        os.set_blocking(fd, True)
        return os.fdopen(fd, encoding="utf-8-sig")
    except BaseException:
        os.close(fd)
        raise


def undecodable_line(path: str | os.PathLike) -> tuple[int, int] | None:
    """The first line (1-based) of ``path`` that is not UTF-8, and its first bad byte; None if none is.

    Text mode decodes ahead in chunks, so its ``UnicodeDecodeError`` cannot say
    which line is bad: a reader that met one asks this, reading the bytes again.
    A line ends at a newline, never inside a UTF-8 sequence, so lines decode alone.
    """
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                return n, raw[exc.start]
    return None


__all__ = [
    "InputRefused", "MAX_JSON_DEPTH", "available_memory_bytes", "check_count",
    "check_json_depth", "json_depth", "max_items", "memory_budget_bytes", "open_regular_text", "undecodable_line",
]
