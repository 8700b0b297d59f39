"""Canonical state keys: any object graph as a hashable value, so the explorer can merge equal states.

Order is kept where Python keeps it (lists, dicts: an LRU's ``OrderedDict``
order is state); sets are unordered; objects are their type and attributes;
what has no value to compare (locks, threads, functions) is its type name.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from typing import Any

PRIMITIVES = (type(None), bool, int, float, complex, str, bytes)
REPORTS = ("_evicted", "_touched")  # the adapter's pending reports, drained after every call


def canonical(obj: Any, ignore: tuple[str, ...] = ()) -> Hashable:
    """A hashable value equal for equal states of ``obj``; ``ignore`` names top-level attributes left out."""
    return _walk(obj, set(ignore) | set(REPORTS), set())


def _walk(obj: Any, ignore: set[str], path: set[int]) -> Hashable:
    if isinstance(obj, PRIMITIVES):
        return obj
    if isinstance(obj, enum.Enum):
        return (type(obj).__qualname__, obj.name)
    if id(obj) in path:
        return ("cycle", type(obj).__qualname__)
    path.add(id(obj))
    try:
        return _compound(obj, ignore, path)
    finally:
        path.discard(id(obj))


def _compound(obj: Any, ignore: set[str], path: set[int]) -> Hashable:
    nothing: set[str] = set()
    if isinstance(obj, (list, tuple)):
        return tuple(_walk(x, nothing, path) for x in obj)
    if isinstance(obj, dict):
        return ("dict", tuple((_walk(k, nothing, path), _walk(v, nothing, path)) for k, v in obj.items()))
    if isinstance(obj, (set, frozenset)):
        return ("set", frozenset(_walk(x, nothing, path) for x in obj))
    tolist = getattr(obj, "tolist", None)  # numpy arrays, torch tensors
    if callable(tolist) and not isinstance(obj, type):
        return ("array", _walk(tolist(), nothing, path))
    fields = _fields(obj)
    if fields is None:
        return ("opaque", type(obj).__qualname__)
    return (type(obj).__qualname__,
            tuple((name, _walk(value, nothing, path)) for name, value in sorted(fields.items()) if name not in ignore))


def _fields(obj: Any) -> dict[str, Any] | None:
    """An object's attributes (``__dict__`` and ``__slots__``), or None for what has none (locks, builtins)."""
    if callable(obj) and not hasattr(obj, "__dict__"):
        return None
    fields = dict(getattr(obj, "__dict__", None) or {})
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                fields[name] = getattr(obj, name)
    if not fields and not hasattr(obj, "__dict__"):
        return None
    if callable(obj) and type(obj).__module__ == "builtins":
        return None
    return fields
