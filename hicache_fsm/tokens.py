"""Token ids at the API boundary: what the cache accepts, checked before anything changes.

A token id is an integer that storage keys can encode: they pack every id as a
4-byte unsigned integer (see ``storage.keys``), so ids live in
``0 <= id < 2**32``. Python ints, numpy and torch integer scalars and 1-D
integer tensors/arrays are accepted; bools, floats, None and strings are not,
even where Python would silently treat them as numbers. A padding id such as
-1 must be stripped by the engine before it reaches the cache.

Checking costs one pass over every id of a request, and in a loop serving
requests that pass is dominated by the first touch of each new int object (the
cache itself never reads the ids of a new suffix), so it is done once per
request: the cache remembers the last tuple it found good, and ``match_prefix``
then ``insert`` with the same tuple check once. (Checking only the ids the tree
did not match measured slower: skipping the matched part needs a slice, which
touches every new id just the same.)

The check stays in C. Packing a tuple into a little-endian ``struct`` of 4-byte
unsigned ints refuses every non-integer and every id out of range at once and
yields the bytes storage keys hash; only ids that pack as 0 or 1 (the values a
bool can take, found by one vectorised minimum over the packed ids) have their
type looked at. A 1-D integer array or tensor is
checked by a vectorised range test. A bad sequence takes the element-by-element
path that names the first bad position. A list of numpy or torch scalars (an
iterated array: its first or last element is not an int) is converted element
by element to the ints they equal, since a torch scalar hashes by identity and
could never match a tree key.
"""

from __future__ import annotations

import operator
import struct
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from hicache_fsm.errors import BadTokenIds, TokenIdTypeError

TOKEN_ID_LIMIT = 1 << 32  # exclusive: storage keys pack ids as 4-byte unsigned ints

__all__ = ["TOKEN_ID_LIMIT", "as_token_ids", "token_id_bytes"]

_LE_UINT32 = np.dtype("<u4")


def as_token_ids(tokens: Any) -> tuple[int, ...]:
    """``tokens`` as a tuple of integers, or a ``BadTokenIds`` naming the first bad one."""
    return _checked(tokens)[0]


def token_id_bytes(tokens: Any) -> bytes:
    """The ids of ``tokens`` packed as little-endian 4-byte unsigned ints (what storage keys hash); checked."""
    return _checked(tokens)[1]


def _checked(tokens: Any) -> tuple[tuple, bytes]:
    """The checked ids of ``tokens`` and their packed bytes."""
    if isinstance(tokens, (np.ndarray, torch.Tensor)):
        arr = _integer_array(tokens)
        if arr is not None:
            bad = (arr < 0) | (arr >= TOKEN_ID_LIMIT)
            if bad.any():
                first = int(bad.argmax())
                _check_one(first, int(arr[first]))  # raises, naming it
            return tuple(arr.tolist()), arr.astype(_LE_UINT32).tobytes()
    ids = _token_tuple(tokens)
    return ids, _packed(ids)


def _integer_array(tokens: np.ndarray | torch.Tensor) -> np.ndarray | None:
    """A 1-D integer array or tensor as a numpy array (checked by min and max); None for other dtypes."""
    if tokens.ndim != 1:
        raise BadTokenIds(f"token ids must be 1-D, got {tokens.dtype} with shape {tuple(tokens.shape)}")
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype == torch.bool or tokens.dtype.is_floating_point or tokens.dtype.is_complex:
            return None
        try:
            tokens = tokens.detach().cpu().numpy()
        except (TypeError, RuntimeError):  # an integer dtype numpy lacks: take the element path
            return None
    return tokens if tokens.dtype.kind in "iu" else None


def _token_tuple(tokens: Any) -> tuple:
    """``tokens`` as a tuple, its elements not yet checked; refuses what is not a 1-D sequence.

    Arrays that are not integer arrays become tuples of Python scalars
    (bools, floats: refused by the check); a sequence of integer scalars
    becomes ints.
    """
    if type(tokens) is tuple:
        ids = tokens
    elif type(tokens) is list:
        ids = tuple(tokens)
    elif isinstance(tokens, (np.ndarray, torch.Tensor)):
        return tuple(tokens.tolist())
    elif isinstance(tokens, (str, bytes, bytearray)):
        raise TokenIdTypeError(f"token ids must be a sequence of ints, got {type(tokens).__name__}")
    else:
        try:
            ids = tuple(tokens)
        except Exception:  # not iterable, or its iterator failed: not a token sequence
            raise TokenIdTypeError(f"token ids must be a sequence of ints, got {type(tokens).__name__}") from None
    if ids and (type(ids[0]) is not int or type(ids[-1]) is not int):
        return _converted(ids)
    return ids


def _packed(ids: tuple) -> bytes:
    """Check every id of ``ids``; returns them packed, or raises naming the first bad position."""
    n = len(ids)
    try:
        packed = _packer(n).pack(*ids)  # in C: refuses floats, None, str, nested lists and ids out of range
    except Exception:  # struct.error, or whatever an element's __index__ raised
        return _packer(n).pack(*_converted(ids))  # raises for the first bad id
    if n:
        words = np.frombuffer(packed, dtype=_LE_UINT32)
        if words.min() <= 1:  # a bool packs as 0 or 1: look at the type of those ids only
            for i in np.flatnonzero(words <= 1).tolist():
                _check_one(i, ids[i])
    return packed


@lru_cache(maxsize=64)
def _packer(n: int) -> struct.Struct:
    return struct.Struct(f"<{n}I")


def _converted(ids: tuple) -> tuple[int, ...]:
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
        except Exception:
            raise TokenIdTypeError(f"token id at position {position} must be an int, got "
                                   f"{type(value).__name__}: {value!r}", position, value) from None
    if not 0 <= value < TOKEN_ID_LIMIT:
        raise BadTokenIds(f"token id {value} at position {position} is outside 0..{TOKEN_ID_LIMIT - 1} "
                          "(storage keys encode 4-byte unsigned ids; strip padding ids before the cache)",
                          position, value)
    return value
