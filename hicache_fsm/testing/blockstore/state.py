"""Canonical state keys: any object graph as a hashable value, so the explorer can merge equal states.

Order is kept where Python keeps it (lists, dicts: an LRU's ``OrderedDict``
order is state); sets are unordered; objects are their type and attributes;
what has no value to compare (locks, threads, functions) is its type name.
"""

from __future__ import annotations

import copy
import enum
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

import attrs

PRIMITIVES = (type(None), bool, int, float, complex, str, bytes)
REPORTS = ("_evicted", "_touched")  # the adapter's pending reports, drained after every call

Key = tuple  # a block key: the chained prefix of page ids up to and including the block


class BlockKey(tuple):
    """A block key the explorer made (a plain tuple to every adapter): its type lets the symmetry reduction
    find and rename keys wherever an adapter keeps them, and tell them from other tuples of small ints."""

    __slots__ = ()


_KEY_LEAVES = frozenset(PRIMITIVES) | {BlockKey}  # values ``canonical`` keeps as they are


def canonical(obj: Any, ignore: tuple[str, ...] = ()) -> Hashable:
    """A hashable value equal for equal states of ``obj``; ``ignore`` names top-level attributes left out."""
    return _walk(obj, set(ignore) | set(REPORTS), set())


def _walk(obj: Any, ignore: set[str], path: set[int]) -> Hashable:
    if isinstance(obj, PRIMITIVES) or type(obj) is BlockKey:
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
    leaf = _KEY_LEAVES  # values that are their own key: no call needed (the walk is the explorer's hot path)
    if isinstance(obj, (list, tuple)):
        return tuple(x if type(x) in leaf else _walk(x, nothing, path) for x in obj)
    if isinstance(obj, dict):
        return ("dict", tuple((k if type(k) in leaf else _walk(k, nothing, path),
                               v if type(v) in leaf else _walk(v, nothing, path)) for k, v in obj.items()))
    if isinstance(obj, (set, frozenset)):
        return ("set", frozenset(_walk(x, nothing, path) for x in obj))
    tolist = getattr(obj, "tolist", None)  # numpy arrays, torch tensors
    if callable(tolist) and not isinstance(obj, type):
        return ("array", _walk(tolist(), nothing, path))
    fields = _fields(obj)
    if fields is None:
        return ("opaque", type(obj).__qualname__)
    return (type(obj).__qualname__,
            tuple((name, value if type(value) in leaf else _walk(value, nothing, path))
                  for name, value in sorted(fields.items()) if name not in ignore))


def _fields(obj: Any) -> dict[str, Any] | None:
    """An object's attributes (``__dict__`` and ``__slots__``), or None for what has none (locks, builtins)."""
    if callable(obj) and not hasattr(obj, "__dict__"):
        return None
    fields = dict(getattr(obj, "__dict__", None) or {})
    for name in _slots(type(obj)):
        if hasattr(obj, name):
            fields[name] = getattr(obj, name)
    if not fields and not hasattr(obj, "__dict__"):
        return None
    if callable(obj) and type(obj).__module__ == "builtins":
        return None
    return fields


_SLOTS: dict[type, tuple[str, ...]] = {}


def _slots(t: type) -> tuple[str, ...]:
    """The slot attributes of instances of ``t`` (all its classes')."""
    if t not in _SLOTS:
        _SLOTS[t] = tuple(name for cls in t.__mro__ for name in getattr(cls, "__slots__", ())
                          if name not in ("__dict__", "__weakref__"))
    return _SLOTS[t]


def clone(obj: Any, rename: dict | None = None) -> Any:
    """A deep copy, several times faster than ``copy.deepcopy`` on plain data (containers, attrs and plain
    objects); anything with its own copy or pickle hooks goes through ``copy.deepcopy``, whose errors
    (locks, C objects) propagate. ``rename`` maps ``BlockKey``s and ints (the values stores write) to their
    replacements in the copy, wherever they are held (a renamed copy for the symmetry reduction)."""
    if rename:
        return _clone(obj, {}, {k: v for k, v in rename.items() if type(k) is BlockKey},
                      {k: v for k, v in rename.items() if type(k) is int})
    return _clone(obj, {})


_HOOKS = ("__deepcopy__", "__reduce__", "__reduce_ex__", "__getstate__", "__setstate__")
_PLAIN: dict[type, bool] = {}
_ATOMS = frozenset(PRIMITIVES)
_LEAVES = _ATOMS | {BlockKey}
_NOTHING: frozenset = frozenset()


def _clone(obj: Any, memo: dict, keys: dict | None = None, ints: dict | None = None) -> Any:
    t = type(obj)
    if t is BlockKey:
        return obj if keys is None else keys.get(obj, obj)
    if t in _ATOMS or isinstance(obj, (enum.Enum, type)):
        return ints.get(obj, obj) if ints and t is int else obj
    leaf = _LEAVES if keys is None else _NOTHING  # copied as they are, without a call (the explorer's hot path)
    if t is tuple:
        if keys is None and all(type(x) in leaf for x in obj):  # block keys: nothing to copy
            return obj
        return tuple([x if type(x) in leaf else _clone(x, memo, keys, ints) for x in obj])
    found = memo.get(id(obj))
    if found is not None:
        return found
    if t is list:
        new = memo[id(obj)] = []
        new.extend([x if type(x) in leaf else _clone(x, memo, keys, ints) for x in obj])
    elif t is dict or t is OrderedDict:
        new = memo[id(obj)] = t()
        for k, v in obj.items():
            new[k if type(k) in leaf else _clone(k, memo, keys, ints)] = \
                v if type(v) in leaf else _clone(v, memo, keys, ints)
    elif t is set or t is frozenset:
        new = memo[id(obj)] = t(_clone(x, memo, keys, ints) for x in obj)
    elif _is_plain(t):
        new = memo[id(obj)] = object.__new__(t)
        if hasattr(obj, "__dict__"):
            new.__dict__.update({k: v if type(v) in leaf else _clone(v, memo, keys, ints)
                                 for k, v in obj.__dict__.items()})
        for name in _slots(t):
            if hasattr(obj, name):
                object.__setattr__(new, name, _clone(getattr(obj, name), memo, keys, ints))
    elif keys is not None:
        raise TypeError(f"cannot rename block keys inside a {t.__qualname__} (it has its own copy hooks)")
    else:
        new = copy.deepcopy(obj, memo)
        memo[id(obj)] = new
    return new  # ids in memo stay unique: every original is alive, held by the graph being copied


def _is_plain(t: type) -> bool:
    """Instances are only their attributes: built by ``object.__new__``, no copy or pickle hooks of their own."""
    if t not in _PLAIN:
        hooks = _HOOKS[:3] if attrs.has(t) else _HOOKS  # attrs' slot classes pickle their fields: plain too
        _PLAIN[t] = t.__new__ is object.__new__ and all(
            getattr(t, hook, None) is getattr(object, hook, None) for hook in hooks)
    return _PLAIN[t]
