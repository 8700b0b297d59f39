"""Token ids at the API boundary: what the cache accepts, checked before anything changes.

A token id is an integer that storage keys can encode: they pack every id as a
4-byte unsigned integer (see ``storage.keys``), so ids live in
``0 <= id < 2**32``. Python ints, numpy and torch integer scalars and 1-D
integer tensors/arrays are accepted; bools, floats, None and strings are not,
even where Python would silently treat them as numbers. A padding id such as
-1 must be stripped by the engine before it reaches the cache.

The common case (a tuple or list of plain ints) is checked with two C-speed
passes; only a bad or unusual sequence takes the element-by-element path that
finds the first bad position. Those passes still cost more than a cached tree
walk, and an engine passes the same tuple to ``match_prefix`` and then
``insert``: tuples are immutable, so the last tuple found good is remembered
(by identity, one entry) and not checked again.
"""

from __future__ import annotations

import operator
from array import array
from typing import Any

from hicache_fsm.errors import BadTokenIds, TokenIdTypeError

TOKEN_ID_LIMIT = 1 << 32  # exclusive: storage keys pack ids as 4-byte unsigned ints

__all__ = ["TOKEN_ID_LIMIT", "as_token_ids"]

_last_good: tuple[int, ...] = ()  # the last tuple found good (a stale entry only costs a re-check)


def as_token_ids(tokens: Any) -> tuple[int, ...]:
    """``tokens`` as a tuple of Python ints, or a ``BadTokenIds`` naming the first bad one."""
    global _last_good
    if tokens is _last_good:
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
    if set(map(type, ids)) <= {int}:
        try:
            array("I", ids)  # range check in C
        except OverflowError:
            pass
        else:
            _last_good = ids
            return ids
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
