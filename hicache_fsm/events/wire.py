"""A batch's msgpack bytes built from what the cache holds, never from Python ints.

Rendering an event as structs of ``list[int]`` made thousands of int objects
per request (a node's token ids, decoded) only for msgspec to encode them
again. These build the msgpack bytes of those lists straight from bytes, with
a few numpy copies and no Python loop: a page digest's first 8 bytes *are*
the big-endian int64 block hash (msgpack ``int 64``, ``0xd3``), and a node's
packed little-endian uint32 ids become ``uint 16`` or ``uint 32`` items
(``0xcd`` / ``0xce``, big-endian). Every msgpack decoder reads these as the
same integers as the shortest encoding.

The batch around them is the schema's array-like layout written as byte
pieces and joined once (:func:`batch_bytes`): ``[ts, [event, ...], rank]``,
``["BlockStored", hashes, parent, tokens, block_size, lora_id, medium,
lora_name]``, ``["BlockRemoved", hashes, medium]``, ``["AllBlocksCleared"]``.
A test holds it to decode as msgspec's encoding of the same ``KVEventBatch`` does.
"""

from __future__ import annotations

import struct
from functools import lru_cache
from typing import Hashable

import numpy as np

try:
    import msgspec
except ModuleNotFoundError as exc:  # an optional dependency: say which extra brings it
    from hicache_fsm.errors import MissingExtra

    raise MissingExtra("KV events", "msgspec", "events") from exc

DIGEST_BYTES = 32  # one page digest (SHA-256)
INT64 = 0xD3
UINT16 = 0xCD
UINT32 = 0xCE
_UINT16_ITEM = np.dtype([("code", "u1"), ("value", ">u2")])
_UINT32_ITEM = np.dtype([("code", "u1"), ("value", ">u4")])
_INT64_ITEM = np.dtype([("code", "u1"), ("value", "S8")])


def array_header(n: int) -> bytes:
    """The msgpack header of an array of ``n`` items."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def int64_array(digests: bytes) -> bytes:
    """The msgpack array of each 32-byte digest's first 8 bytes (``digests`` joined) as a big-endian int64."""
    n = len(digests) // DIGEST_BYTES
    items = np.empty(n, _INT64_ITEM)
    items["code"] = INT64
    items["value"] = np.frombuffer(digests, "S8", n * 4)[::4]
    return array_header(n) + items.tobytes()


def token_array(packed: bytes) -> bytes:
    """The msgpack array of the little-endian uint32 ids packed in ``packed``.

    Each id is a ``uint 16`` item (3 bytes) when every id of the list fits 16
    bits, else every id is a ``uint 32`` item (5 bytes).
    """
    n = len(packed) >> 2
    ids = np.frombuffer(packed, "<u4", n)
    wide = n > 0 and int(ids.max()) > 0xFFFF
    items = np.empty(n, _UINT32_ITEM if wide else _UINT16_ITEM)
    items["code"] = UINT32 if wide else UINT16
    items["value"] = ids
    return array_header(n) + items.tobytes()


def int64_list(digests: bytes) -> list[int]:
    """Each 32-byte digest's first 8 bytes (``digests`` joined) as a signed int64 (SGLang's block hash)."""
    return np.frombuffer(digests, ">i8", len(digests) // 8)[::4].tolist()


def uint32_list(packed: bytes) -> list[int]:
    """The little-endian uint32 ids packed in ``packed``."""
    return np.frombuffer(packed, "<u4", len(packed) >> 2).tolist()


_pack = msgspec.msgpack.Encoder().encode
_TS = struct.Struct(">d").pack
BATCH_HEAD = b"\x93\xcb"  # [ts as float 64, ...
STORED_HEAD = b"\x98" + _pack("BlockStored")
REMOVED_HEAD = b"\x93" + _pack("BlockRemoved")
CLEARED_EVENT = b"\x91" + _pack("AllBlocksCleared")
NIL = b"\xc0"


def int64_item(digest: bytes) -> bytes:
    """A digest's first 8 bytes as one msgpack int64 (a parent block hash)."""
    return b"\xd3" + digest[:8]


@lru_cache(maxsize=256, typed=True)
def plain(*values: Hashable) -> bytes:
    """The msgpack items of a few plain values (ints, strings, None), one after another; remembered."""
    return b"".join(_pack(v) for v in values)


def batch_bytes(ts: float, events: int, pieces: list[bytes], data_parallel_rank: int | None) -> bytes:
    """One batch: ``events`` events written as ``pieces`` (event heads, lists, fields), joined once."""
    return b"".join([BATCH_HEAD, _TS(ts), array_header(events), *pieces, plain(data_parallel_rank)])
