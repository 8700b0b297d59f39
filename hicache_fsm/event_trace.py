"""Reading a recorded JSONL event trace for ``diagram --counts``, checked and bounded before use.

The file is untrusted input: it must be a regular file no larger than
``MAX_TRACE_BYTES`` (a FIFO or a device is refused, never opened), UTF-8
text, one JSON object with an ``event`` per line, nested at most
``MAX_JSON_DEPTH`` deep, and the fields that name something (machine, trigger,
states, objects) must be names. Every problem is one ``TraceError`` naming the
file and line. Needs neither torch nor hypothesis (unlike
``hicache_fsm.testing.trace``, which writes these traces).
"""

from __future__ import annotations

import json
import os
import stat

from hicache_fsm.errors import TraceError

MAX_TRACE_BYTES = 1 << 30  # 1 GiB: far above any recorded run (simulate's default writes about 2 MB)
MAX_JSON_DEPTH = 32  # recorded events nest two levels; deeper is not a trace
NAME_FIELDS = ("event", "machine", "source", "trigger", "dest")  # strings when present
OBJECT_FIELDS = ("node", "object", "upper")  # str or int ids when present (None: unnamed)
REQUIRED_FIELDS = {"transition": ("source", "trigger", "dest"), "split": ("node", "upper"), "removed": ("node",)}


def _depth_ok(text: str) -> bool:
    """Whether brackets outside strings nest at most ``MAX_JSON_DEPTH`` deep (checked before parsing)."""
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def _check_event(ev: object, path: str, n: int) -> dict:
    if not isinstance(ev, dict) or "event" not in ev:
        raise TraceError(path, n, "not an event object (a JSON object with an \"event\" field)")
    for key in NAME_FIELDS:
        if key in ev and not isinstance(ev[key], str):
            raise TraceError(path, n, f"field {key!r} must be a name (a string), got {type(ev[key]).__name__}")
    missing = [key for key in REQUIRED_FIELDS.get(ev["event"], ()) if ev.get(key) is None]
    if missing:
        raise TraceError(path, n, f"a {ev['event']} event without {' or '.join(map(repr, missing))}")
    for key in OBJECT_FIELDS:
        value = ev.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (str, int))):
            raise TraceError(path, n, f"field {key!r} must be an object id (a string or an int), "
                                      f"got {type(value).__name__}")
    return ev


def read_events(path: str | os.PathLike) -> list[dict]:
    """The events of the JSONL trace at ``path``, each with its ``_line``; ``TraceError`` when it is not one."""
    name = os.fspath(path)
    try:
        info = os.stat(name)
    except FileNotFoundError:
        raise TraceError(name, None, "no such trace file") from None
    except OSError as exc:  # a symlink loop, no permission, a path through a file
        raise TraceError(name, None, f"cannot read it: {exc.strerror or exc}") from None
    if not stat.S_ISREG(info.st_mode):
        raise TraceError(name, None, "not a regular file (a trace is a JSONL file)")
    if info.st_size > MAX_TRACE_BYTES:
        raise TraceError(name, None, f"{info.st_size} bytes is larger than a trace may be ({MAX_TRACE_BYTES} bytes)")
    events = []
    try:
        f = open(name, "rb")
    except OSError as exc:
        raise TraceError(name, None, f"cannot read it: {exc.strerror or exc}") from None
    with f:
        for n, raw in enumerate(f, 1):
            try:
                # a leading byte-order mark (some editors and Windows tools write one) is skipped
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8").strip()
            except UnicodeDecodeError:
                raise TraceError(name, n, "not a JSONL trace: the file is not UTF-8 text (an image or binary file?)") from None
            if not line:
                continue
            if not _depth_ok(line):
                raise TraceError(name, n, f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
            try:
                ev = json.loads(line)
            except ValueError as exc:
                raise TraceError(name, n, f"not JSON: {exc}") from None
            ev = _check_event(ev, name, n)
            ev["_line"] = n
            events.append(ev)
    return events


__all__ = ["MAX_JSON_DEPTH", "MAX_TRACE_BYTES", "read_events"]
