"""msgpack arrays of block hashes and token ids built from bytes, never from Python ints.

Rendering an event as structs of ``list[int]`` made thousands of int objects
per request (a node's token ids, decoded) only for msgspec to encode them
again. These build the msgpack bytes of those lists straight from what the
cache already holds, with a few numpy copies and no Python loop: a page
digest's first 8 bytes *are* the big-endian int64 block hash (msgpack
``int 64``, ``0xd3``), and a node's packed little-endian uint32 ids become
``uint 32`` items (``0xce``, big-endian). Every msgpack decoder reads these
as the same integers as the shortest encoding; they go into the batch as
``msgspec.Raw``.
"""

from __future__ import annotations

import numpy as np

DIGEST_BYTES = 32  # one page digest (SHA-256)
INT64 = 0xD3
UINT32 = 0xCE
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


def uint32_array(packed: bytes) -> bytes:
    """The msgpack array of the little-endian uint32 ids packed in ``packed``."""
    n = len(packed) >> 2
    items = np.empty(n, _UINT32_ITEM)
    items["code"] = UINT32
    items["value"] = np.frombuffer(packed, "<u4", n)
    return array_header(n) + items.tobytes()


def int64_list(digests: bytes) -> list[int]:
    """Each 32-byte digest's first 8 bytes (``digests`` joined) as a signed int64 (SGLang's block hash)."""
    return np.frombuffer(digests, ">i8", len(digests) // 8)[::4].tolist()


def uint32_list(packed: bytes) -> list[int]:
    """The little-endian uint32 ids packed in ``packed``."""
    return np.frombuffer(packed, "<u4", len(packed) >> 2).tolist()
