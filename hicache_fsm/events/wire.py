"""msgpack arrays of block hashes and token ids built from bytes, never from Python ints.

Rendering an event as structs of ``list[int]`` made thousands of int objects
per request (a node's token ids, decoded) only for msgspec to encode them
again. These build the msgpack bytes of those lists straight from what the
cache already holds: a page digest's first 8 bytes *are* the big-endian
int64 block hash (msgpack ``int 64``, ``0xd3``), and a node's packed
little-endian uint32 ids become ``uint 32`` items (``0xce``) by reversing
each id's 4 bytes. Every msgpack decoder reads these as the same integers
as the shortest encoding; they go into the batch as ``msgspec.Raw``.
"""

from __future__ import annotations

import sys
from array import array
from typing import Sequence

ID_CODE = "I" if array("I").itemsize == 4 else "L"  # the 4-byte unsigned array code, as the tree packs ids
INT64 = b"\xd3"
UINT32 = b"\xce"


def array_header(n: int) -> bytes:
    """The msgpack header of an array of ``n`` items."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def int64_array(digests: Sequence[bytes]) -> bytes:
    """The msgpack array of each digest's first 8 bytes read as a big-endian signed int64."""
    return array_header(len(digests)) + b"".join([INT64 + d[:8] for d in digests])


def uint32_array(packed: bytes) -> bytes:
    """The msgpack array of the little-endian uint32 ids packed in ``packed``."""
    n = len(packed) >> 2
    ids = array(ID_CODE)
    ids.frombytes(packed)
    if sys.byteorder == "little":
        ids.byteswap()
    big = ids.tobytes()
    header = array_header(n)
    h = len(header)
    out = bytearray(h + 5 * n)
    out[:h] = header
    out[h::5] = UINT32 * n
    for i in range(4):  # byte i of every id, C loops over extended slices
        out[h + 1 + i :: 5] = big[i::4]
    return bytes(out)
