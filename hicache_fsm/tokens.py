"""Token ids at the API boundary: what the cache accepts, checked before anything changes.

A token id is an integer that storage keys can encode: they pack every id as a
4-byte unsigned integer (see ``storage.keys``), so ids live in
``0 <= id < 2**32``. Python ints, numpy and torch integer scalars and 1-D
integer tensors/arrays are accepted; bools, floats, None and strings are not,
even where Python would silently treat them as numbers. A padding id such as
-1 must be stripped by the engine before it reaches the cache.

Checking costs a pass over every token of every request, next to a tree walk
that touches one dict entry per page, so the common case stays in C: packing
into ``array("I")`` refuses every non-integer and every id out of range at
once, and only when some id is 0 or 1 (the values a bool can take) is the type
of each element looked at. An integer scalar from numpy or torch passes as the
int it equals (tree keys and storage keys treat it as that int). A bad
sequence takes the element-by-element path that names the first bad position.
An engine passes the same tuple to ``match_prefix`` and then ``insert``:
tuples are immutable, so the last tuple found good is remembered (by
identity, one entry) and not checked again.
"""

from __future__ import annotations

import operator
from array import array
from typing import Any

import numpy as np

from hicache_fsm.errors import BadTokenIds, TokenIdTypeError

TOKEN_ID_LIMIT = 1 << 32  # exclusive: storage keys pack ids as 4-byte unsigned ints

__all__ = ["TOKEN_ID_LIMIT", "as_token_ids"]

# the last few tuples found good: an engine (or a replay of several configurations) passes the
# same request tuple to match_prefix, prefetch and insert, often through several caches
_recent_good: list[tuple[int, ...]] = []
_RECENT = 4


def as_token_ids(tokens: Any) -> tuple[int, ...]:
    """``tokens`` as a tuple of integers, or a ``BadTokenIds`` naming the first bad one."""
    for good in _recent_good:
        if tokens is good:
            return tokens
    if hasattr(tokens, "tolist") and hasattr(tokens, "dtype"):  # torch tensors, numpy arrays
        ndim = tokens.dim() if callable(getattr(tokens, "dim", None)) else getattr(tokens, "ndim", None)
        if ndim != 1:
            raise BadTokenIds(f"token ids must be 1-D, got {tokens.dtype} with shape {tuple(tokens.shape)}")
        tokens = tokens.tolist()  # bool/float elements come back as Python bools/floats: refused below
    if isinstance(tokens, (str, bytes)):
        raise TokenIdTypeError(f"token ids must be a sequence of ints, got {type(tokens).__name__}")
    try:
        ids = tuple(tokens)
    except TypeError:
        raise TokenIdTypeError(f"token ids must be a sequence of ints, got {type(tokens).__name__}") from None
    try:
        packed = array("I", ids)  # in C: refuses floats, None, str and ids out of range
    except (TypeError, OverflowError):
        return _checked(ids)
    if _may_hold_bools(packed) and not set(map(type, ids)) <= {int}:
        return _checked(ids)
    _recent_good.insert(0, ids)
    del _recent_good[_RECENT:]
    return ids


def _may_hold_bools(packed: array) -> bool:
    """Whether some id is 0 or 1, in one vector op over the packed ids."""
    return len(packed) > 0 and int(np.frombuffer(packed, dtype=np.uint32).min()) <= 1


def _checked(ids: tuple) -> tuple[int, ...]:
    """Element by element: raises for the first bad id; integer scalars become Python ints."""
    return tuple(_check_one(i, t) for i, t in enumerate(ids))


def _check_one(position: int, value: object) -> int:
    if type(value) is not int:
        dtype = str(getattr(value, "dtype", ""))
        if isinstance(value, bool) or dtype in ("bool", "torch.bool"):
            raise TokenIdTypeError(f"token id at position {position} is a bool ({value!r}), not an int",
                                   position, value)
        try:
            value = operator.index(value)  # numpy / torch integer scalars
        except TypeError:
            raise TokenIdTypeError(f"token id at position {position} must be an int, got "
                                   f"{type(value).__name__}: {value!r}", position, value) from None
    if not 0 <= value < TOKEN_ID_LIMIT:
        raise BadTokenIds(f"token id {value} at position {position} is outside 0..{TOKEN_ID_LIMIT - 1} "
                          "(storage keys encode 4-byte unsigned ids; strip padding ids before the cache)",
                          position, value)
    return value
