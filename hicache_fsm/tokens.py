"""Token ids at the API boundary: checked and packed once, in one compact form everything shares.

A token id is an integer that storage keys can encode: every id is packed as a
4-byte little-endian unsigned integer, so ids live in ``0 <= id < 2**32``.
Python ints (int subclasses and ``__index__`` objects: numpy and torch integer
scalars, 0-d integer tensors), 1-D integer tensors/arrays and ``array.array``
of an integer typecode (SGLang's scheduler holds ids as ``array("q")``) are
accepted; bools, floats, None and strings are not, even where Python would
silently treat them as numbers. A padding id such as -1 must be stripped by
the engine before it reaches the cache.

The packed form, :class:`TokenIds`, is what the radix tree compares (one
``memcmp`` per node instead of one comparison per id), what its child dicts
hash (a page's 4·page_size bytes) and what storage page hashes read (the
byte layout of ``storage.keys``). Packing is the check: ``struct.pack``
converts every element in C and refuses non-integers and ids out of range at
once, and whatever an element was (an int subclass, a 0-d tensor, an
``__index__`` object) the key holds the integer it equals, so it is found
again. Only ids that pack as 0 or 1 (the values a bool can take, found by one
vectorised minimum) have their type looked at. A 1-D integer array or tensor
(or an integer ``array.array``, read through its buffer) is range-checked
and converted by numpy in one or two vectorised passes (8-byte ids: the
conversion itself checks them where numpy has ``casting="same_value"``,
else one maximum over the bits read as unsigned covers both ``< 0`` and
``>= 2**32``; int32: one minimum; uint32: none): no per-id Python work. A
bad sequence takes the element-by-element path that names the first bad
position. The check and the conversion are apart (:func:`id_array`,
:func:`check_id_array`, :func:`pack_id_array`; :func:`checked_id_bytes`
does both), so ``match_prefix`` checks and packs only what it reads: one
page on a miss (see ``HiCache.match_prefix``).

An engine packs a request's ids once, when the request arrives, keeps the
``TokenIds`` with the request, and grows it with :meth:`TokenIds.extended`
(which checks and packs only the new ids); every cache call then takes it as
it is (see docs/embedding.md, "Pack a request's ids once").
"""

from __future__ import annotations

import operator
import struct
import sys
from array import array
from functools import lru_cache
from typing import Any, Iterator, overload

import numpy as np
import torch

from hicache_fsm.errors import BadTokenIds, TokenIdTypeError

TOKEN_ID_LIMIT = 1 << 32  # exclusive: ids are packed as 4-byte unsigned ints
ID_BYTES = 4

__all__ = ["ID_BYTES", "TOKEN_ID_LIMIT", "TokenIds", "array_head_bytes", "as_token_ids", "check_id_array",
           "checked_id_array", "checked_id_bytes", "id_array", "id_array_head_bytes", "pack_id_array", "pack_token_ids",
           "token_id_bytes", "unpack_token_ids"]

_LE_UINT32 = np.dtype("<u4")
_CODE = next(c for c in "IL" if array(c).itemsize == ID_BYTES)  # 'I' on every platform CPython supports
_SWAP = sys.byteorder != "little"
_UINT64 = np.dtype(np.uint64)
_smallest = np.minimum.reduce  # ``ndarray.min`` less its Python wrapper
_largest = np.maximum.reduce
# array.array typecodes of integers, and the numpy dtype each reads as (numpy reads the same codes; a dtype object
# handed positionally to ``frombuffer`` costs half what a code string as a keyword does)
_ARRAY_DTYPES = {code: np.dtype(code) for code in "bBhHiIlLqQ"}
_ARRAY_INTEGER = frozenset(_ARRAY_DTYPES)
_WIDE_CODES = frozenset(code for code, dtype in _ARRAY_DTYPES.items() if dtype.itemsize == 8)
_ZERO_WORDS = bytes(ID_BYTES * 256)  # the high words of up to 256 in-range 8-byte ids


def _casts_same_value() -> bool:
    """Whether numpy's ``astype`` refuses a value that would change (``casting="same_value"``, numpy 2.4 on)."""
    try:
        np.array([1], dtype=np.int64).astype(_LE_UINT32, casting="same_value")
    except (TypeError, ValueError):  # an older numpy: no such casting rule
        return False
    try:
        np.array([-1], dtype=np.int64).astype(_LE_UINT32, casting="same_value")
    except ValueError:
        return True
    return False


SAME_VALUE_CASTS = _casts_same_value()  # numpy range-checks 8-byte ids as it converts them (checked_id_bytes)
_TORCH_INTEGER = frozenset({torch.int8, torch.int16, torch.int32, torch.int64,
                            torch.uint8, torch.uint16, torch.uint32, torch.uint64})


class TokenIds:
    """Checked token ids packed as little-endian uint32 bytes (``raw``); built by :func:`pack_token_ids`.

    Immutable and hashable. ``len`` counts ids, ``ids[i]`` is an int and a
    slice is a ``TokenIds`` again (``ids[:n]``: a prefix to insert, nothing
    checked twice); ``extended`` / ``+`` append ids, checking only the new ones.
    """

    __slots__ = ("raw",)

    def __init__(self, raw: bytes) -> None:
        if type(raw) is not bytes or len(raw) & 3:  # TokenIds([1, 2]) held a list and counted 0 ids
            raise TokenIdTypeError(f"TokenIds holds packed ids (bytes, 4 per id): build one with pack_token_ids, "
                                   f"got {type(raw).__name__}")
        self.raw = raw

    def __len__(self) -> int:
        return len(self.raw) >> 2

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> "TokenIds": ...
    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self.raw) >> 2)
            if step == 1:
                return TokenIds(self.raw[start << 2 : max(start, stop) << 2])
            return TokenIds(np.frombuffer(self.raw, dtype=_LE_UINT32)[index].tobytes())
        n = len(self.raw) >> 2
        i = operator.index(index)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("token id index out of range")
        return int.from_bytes(self.raw[i << 2 : (i + 1) << 2], "little")

    def __iter__(self) -> Iterator[int]:
        return iter(unpack_token_ids(self.raw))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TokenIds) and other.raw == self.raw

    def __hash__(self) -> int:
        return hash(self.raw)

    def __bytes__(self) -> bytes:
        return self.raw

    def extended(self, new_ids: Any) -> "TokenIds":
        """These ids followed by ``new_ids``; only the new ids are checked and packed.

        A bad new id raises ``BadTokenIds`` naming its position in the whole
        sequence (``len(self)`` + its index in ``new_ids``); ``self`` is never
        changed (a ``TokenIds`` is immutable), so a request keeps its good ids.
        """
        if type(new_ids) is TokenIds:
            return TokenIds(self.raw + new_ids.raw)
        return TokenIds(self.raw + _packed(new_ids, len(self.raw) >> 2))

    __add__ = extended

    def tolist(self) -> list[int]:
        return list(unpack_token_ids(self.raw))

    def __repr__(self) -> str:
        return f"TokenIds({len(self)} ids)"


def pack_token_ids(tokens: Any) -> TokenIds:
    """``tokens`` checked and packed (a ``TokenIds`` is returned as is), or a ``BadTokenIds`` naming the first bad one."""
    if type(tokens) is TokenIds:
        return tokens
    return TokenIds(_packed(tokens))


def as_token_ids(tokens: Any) -> tuple[int, ...]:
    """``tokens`` as a checked tuple of Python ints."""
    return unpack_token_ids(pack_token_ids(tokens).raw)


def token_id_bytes(tokens: Any) -> bytes:
    """The ids of ``tokens`` packed as little-endian 4-byte unsigned ints (what storage keys hash); checked."""
    return pack_token_ids(tokens).raw


def unpack_token_ids(raw: bytes) -> tuple[int, ...]:
    """The ids packed in ``raw`` (trusted bytes of a ``TokenIds`` or a tree key)."""
    ids = array(_CODE)
    ids.frombytes(raw)
    if _SWAP:
        ids.byteswap()
    return tuple(ids)


def id_array(tokens: Any) -> np.ndarray | None:
    """``tokens`` as a numpy array, not yet checked, when it is a vectorised form; else None.

    The vectorised forms are a 1-D integer numpy array or tensor and an integer
    ``array.array`` (a CPU tensor's or an array's own memory, no copy). Every
    other form (a list, a tuple, a ``TokenIds``, a float array) gives None:
    :func:`pack_token_ids` takes it. Check what is read with
    :func:`check_id_array` (a slice at a time if need be: ``match_prefix``
    checks the first page alone on a miss), then pack it with
    :func:`pack_id_array`.
    """
    if isinstance(tokens, array):
        dtype = _ARRAY_DTYPES.get(tokens.typecode)
        return None if dtype is None else np.frombuffer(tokens, dtype)
    if isinstance(tokens, (np.ndarray, torch.Tensor)):
        return _integer_array(tokens)
    return None


def array_head_bytes(tokens: array, n: int) -> bytes | None:
    """The first ``n`` ids of an integer ``array.array``, checked and packed by C calls; else None.

    A ``match_prefix`` miss reads one page. 8-byte ids (SGLang's
    ``array("q")``) are read as 4-byte words: every high word zero is the
    range check, the low words are the packing (about 1.7 us for a page of 64,
    against 2.9 us for ``struct`` to take the page's ints); narrower codes are
    range-checked and packed by ``struct`` from the array's own ints. None
    for an array of another type or an id out of range: :func:`id_array` and
    :func:`check_id_array` take those (and name the bad id).
    """
    code = tokens.typecode
    if code in _WIDE_CODES and not _SWAP:
        size = min(n, len(tokens))
        if size <= 256:
            words = array(_CODE)
            words.frombytes(memoryview(tokens).cast("B")[: size << 3])  # low word, high word, low word, ...
            return words[::2].tobytes() if words[1::2].tobytes() == _ZERO_WORDS[: size << 2] else None
    if code not in _ARRAY_INTEGER:
        return None
    head = tokens[:n]
    try:
        return _packer(len(head)).pack(*head)
    except struct.error:
        return None


def id_array_head_bytes(ids: np.ndarray, n: int) -> bytes | None:
    """The first ``n`` ids of an array from :func:`id_array`, checked and packed by byte operations; else None.

    A ``match_prefix`` miss of a tensor reads one page: for native 4- and
    8-byte ids the range check is a test on the page's raw bytes (int32: no
    sign byte has its top bit set, a tenth of a vectorised minimum over 64
    ids; 8-byte ids: every high word is zero). None for other dtypes, a
    byte-swapped or big-endian array, and a page with an id out of range:
    :func:`check_id_array` takes those (and names the bad id).
    """
    dtype = ids.dtype
    if _SWAP or not dtype.isnative:
        return None
    size = dtype.itemsize
    if size == 4:
        raw = ids[:n].tobytes()
        return raw if dtype.kind == "u" or raw[3::4].isascii() else None  # byte 3 of 4 holds an int32's sign
    if size == 8:
        words = memoryview(ids[:n].tobytes()).cast("I")  # low word, high word, low word, ...
        return None if words[1::2].tobytes().strip(b"\0") else words[::2].tobytes()
    return None


def check_id_array(ids: np.ndarray) -> None:
    """Range-check an array from :func:`id_array` (or a slice of it from its start), in vectorised passes.

    ``BadTokenIds`` names the first id out of ``0..2**32-1`` by its position.
    """
    _check_array(ids, 0)


def checked_id_array(tokens: Any) -> np.ndarray | None:
    """:func:`id_array` with every id checked (:func:`check_id_array`); None for the forms it does not take."""
    return _checked_array(tokens, 0)


def checked_id_bytes(ids: np.ndarray) -> bytes:
    """:func:`check_id_array`, then the ids packed (the bytes a ``TokenIds`` holds), in one pass where numpy can.

    8-byte ids (SGLang's ``array("q")``, int64 tensors) are range-checked by
    the conversion itself where numpy has ``casting="same_value"`` (2.4 and
    later): one pass over the ids instead of a maximum and a conversion.
    ``BadTokenIds`` names the first id out of range, as the check does.
    """
    return _checked_raw(ids, 0)


def pack_id_array(ids: np.ndarray) -> TokenIds:
    """The ids of an array from :func:`id_array` (or a slice of it) packed, checking nothing.

    Ids out of range wrap silently: check them (:func:`check_id_array`) before the bytes are kept anywhere.
    """
    return TokenIds(_array_raw(ids))


def _packed(tokens: Any, offset: int = 0) -> bytes:
    """Check every id of ``tokens``; returns them packed, or raises naming the first bad position (+ ``offset``)."""
    if type(tokens) is not tuple and type(tokens) is not list:  # a tuple or a list goes straight to the packer
        arr = id_array(tokens)
        if arr is not None:  # SGLang's scheduler holds ids as array("q"): numpy reads its buffer, no id objects
            return _checked_raw(arr, offset)
        if isinstance(tokens, array):
            tokens = tokens.tolist()  # floats, characters: refused by the element check below
        elif isinstance(tokens, (np.ndarray, torch.Tensor)):
            try:
                tokens = tokens.tolist()  # bools, floats: refused by the element check below
            except Exception:  # a tensor whose values cannot be read here (e.g. on the meta device)
                raise TokenIdTypeError(f"token ids could not be read from {type(tokens).__name__} "
                                       f"of {tokens.dtype}") from None
        elif isinstance(tokens, (str, bytes, bytearray, memoryview)):
            raise TokenIdTypeError(f"token ids must be a sequence of ints, got {type(tokens).__name__}")
        elif isinstance(tokens, (set, frozenset, dict)):  # no order: the prefix would be whatever it iterates
            raise TokenIdTypeError(f"token ids must be in order (a sequence), got a {type(tokens).__name__}")
        else:
            try:
                tokens = tuple(tokens)
            except Exception:  # not iterable, or its iterator failed: not a token sequence
                raise TokenIdTypeError(f"token ids must be a sequence of ints, got {type(tokens).__name__}") from None
    n = len(tokens)
    try:
        packed = _packer(n).pack(*tokens)  # in C: refuses floats, None, str, nested lists and ids out of range
    except Exception:  # struct.error, TypeError, or whatever an element's __index__ raised
        for i, t in enumerate(tokens):
            _check_one(i + offset, t)  # raises for the first bad id
        raise BadTokenIds("token ids could not be packed") from None  # pragma: no cover - _check_one raised
    if n:
        words = np.frombuffer(packed, dtype=_LE_UINT32)
        if words.item(words.argmin()) <= 1:  # a bool packs as 0 or 1: look at the type of those ids only
            for i in np.flatnonzero(words <= 1).tolist():
                _check_one(i + offset, tokens[i])
    return packed


def _checked_array(tokens: Any, offset: int) -> np.ndarray | None:
    """``checked_id_array``, naming a bad id's position plus ``offset``."""
    arr = id_array(tokens)
    if arr is not None:
        _check_array(arr, offset)
    return arr


def _check_array(arr: np.ndarray, offset: int) -> None:
    """Range-check a 1-D integer array in as few vectorised passes as its dtype allows."""
    if not arr.size:
        return
    dtype = arr.dtype
    if dtype.isnative:
        size = dtype.itemsize
        if size == 8:  # read as uint64, a negative id is >= 2**63: the largest covers both ends of the range
            wide = arr.view(_UINT64)
            if wide.item(wide.argmax()) >= TOKEN_ID_LIMIT:  # ``argmax``: a third less than a ufunc reduction
                _refuse_first(arr, wide >= TOKEN_ID_LIMIT, offset)
            return
        if size == 4:  # int32 ids are below 2**31: only the sign is checked; uint32 holds exactly the range
            if dtype.kind == "i" and arr.item(arr.argmin()) < 0:
                _refuse_first(arr, arr < 0, offset)
            return
    # narrower ints (always below 2**32) and byte-swapped arrays: the plain two-sided check
    if (dtype.kind == "i" and _smallest(arr) < 0) or (dtype.itemsize >= 8 and _largest(arr) >= TOKEN_ID_LIMIT):
        _refuse_first(arr, (arr < 0) | (arr >= TOKEN_ID_LIMIT), offset)


def _checked_raw(arr: np.ndarray, offset: int) -> bytes:
    """``checked_id_bytes``, naming a bad id's position plus ``offset``."""
    dtype = arr.dtype
    if SAME_VALUE_CASTS and dtype.itemsize == 8 and dtype.isnative and arr.size:
        try:
            return arr.astype(_LE_UINT32, casting="same_value").tobytes()
        except ValueError:  # an id that does not fit: the check names the first
            _check_array(arr, offset)
            raise BadTokenIds("token ids could not be packed") from None  # pragma: no cover - the check raised
    _check_array(arr, offset)
    return _array_raw(arr)


def _array_raw(arr: np.ndarray) -> bytes:
    """A checked integer array's ids as packed bytes (little-endian uint32)."""
    dtype = arr.dtype
    if dtype.itemsize == 4 and dtype.isnative and not _SWAP:  # int32 ids are >= 0: the same bytes as uint32
        return arr.tobytes()
    return arr.astype(_LE_UINT32).tobytes()


def _refuse_first(arr: np.ndarray, bad: np.ndarray, offset: int) -> None:
    """Raise for the first id ``bad`` marks, naming its position."""
    first = int(bad.argmax())
    _check_one(first + offset, int(arr[first]))  # raises, naming it
    raise BadTokenIds("token ids could not be packed")  # pragma: no cover - _check_one raised


@lru_cache(maxsize=256)
def _packer(n: int) -> struct.Struct:
    """Packs ``n`` ids as little-endian uint32 (struct.pack measured faster than ``array('I', ids)``)."""
    return struct.Struct(f"<{n}I")


def _integer_array(tokens: np.ndarray | torch.Tensor) -> np.ndarray | None:
    """A 1-D integer array or tensor as a numpy array (a CPU tensor's own memory, no copy); None for other dtypes."""
    if tokens.ndim != 1:
        raise BadTokenIds(f"token ids must be 1-D, got {tokens.dtype} with shape {tuple(tokens.shape)}")
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype not in _TORCH_INTEGER:
            return None
        try:
            return (tokens if tokens.is_cpu else tokens.cpu()).numpy()  # integer tensors never require grad
        except (TypeError, RuntimeError, NotImplementedError):  # a tensor numpy cannot view: take the element path
            return None
    return tokens if tokens.dtype.kind in "iu" else None


def _check_one(position: int, value: object) -> int:
    if type(value) is not int:
        dtype = str(getattr(value, "dtype", ""))
        if isinstance(value, bool) or dtype in ("bool", "torch.bool"):
            raise TokenIdTypeError(f"token id at position {position} is a bool ({value!r}), not an int",
                                   position, value)
        try:
            value = operator.index(value)  # int subclasses, numpy / torch integer scalars
        except Exception:
            raise TokenIdTypeError(f"token id at position {position} must be an int, got "
                                   f"{type(value).__name__}: {value!r}", position, value) from None
    if not 0 <= value < TOKEN_ID_LIMIT:
        raise BadTokenIds(f"token id {value} at position {position} is outside 0..{TOKEN_ID_LIMIT - 1} "
                          "(storage keys encode 4-byte unsigned ids; strip padding ids before the cache)",
                          position, value)
    return value
