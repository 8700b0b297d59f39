"""The stored form of one page: a verified header, the full storage key, then the payload.

Every value a backend stores is ``encode_header(...)`` + key + payload: magic,
format version, checksum algorithm, key length, payload length, payload
checksum, the writer's page format (:mod:`hicache_fsm.storage.page_format`)
and a CRC-32 of the header itself. ``decode_blob`` / ``parse_header`` +
``verify_payload`` check a value before any byte of it is used; a failure is
``CorruptPage`` (``FormatMismatch`` for another writer's page format), which
backends report as a miss, never raise out. See :mod:`hicache_fsm.storage.base`
for the backends' contract.
"""

from __future__ import annotations

import struct
import zlib
from typing import Iterable, Sequence

import numpy as np

from hicache_fsm.errors import StorageKeyError
from hicache_fsm.storage.page_format import UNTYPED, describe

__all__ = ["CHECKSUMS", "FORMAT_VERSION", "HEADER", "MAGIC", "CorruptPage", "FormatMismatch", "checksum_id",
           "decode_blob", "encode_header", "parse_header", "payload_checksum", "verify_payload"]

MAGIC = b"HCKV"
FORMAT_VERSION = 2
# magic, version, checksum algorithm, key length, payload length, payload checksum, page format, header crc32
HEADER = struct.Struct("<4sBBHQQ64sI")
_HEADER_CRC_SPAN = HEADER.size - 4

# Payload checksum algorithms (the header records which one wrote a value; readers accept both).
# 1 was a one-lane wsum64 blind to a pair of top-bit flips: a page stored with it reads as corrupt (a miss)
CHECKSUMS = {"wsum64": 4, "crc32": 2, "none": 3}
_CHECKSUM_NAMES = {v: k for k, v in CHECKSUMS.items()}


class CorruptPage(Exception):
    """Internal: a stored value failed verification (reported as a miss, never raised out)."""


class FormatMismatch(CorruptPage):
    """Internal: a stored value is intact but was written in another page format or by another version (a miss)."""

    def __init__(self, stored: bytes, expected: bytes) -> None:
        super().__init__(f"written as {describe(stored)!r}, this reader expects {describe(expected)!r}")
        self.stored = stored
        self.expected = expected


_MASK64 = (1 << 64) - 1
_WSUM_MULT = 0x9E3779B97F4A7C15  # odd: chains chunk sums so chunk order matters
_WSUM_CHUNK = 1 << 16  # words per chunk
_WSUM_WEIGHTS = np.arange(_WSUM_CHUNK, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
_HIGH_HALF = np.uint64(32)


class _WSum64:
    """Position-weighted 64-bit checksum of a byte stream, fed in arbitrary pieces.

    The payload is read as little-endian 64-bit words (the last one zero-padded).
    Within each chunk of 65536 words, word k is multiplied by the odd weight 2k+1
    and the products summed mod 2**64, in two lanes: the words, and their high
    halves shifted down (in the first lane a flip of bit 47 or above in two
    words can cancel, 2**i times the sum of two weights being 0 mod 2**64; in
    the second those bits sit below bit 32, where no pair cancels). Each lane
    chains its chunk sums as ``h = h * M + chunk_sum`` (M odd), and the digest
    is the first lane's XOR the second's rotated. A flip of one or two bits
    within a chunk, or any change confined to one word, always changes a lane
    (and so, but for a 2**-64 coincidence of both lanes, the digest); word
    swaps and zeroed blocks almost surely change it. With numpy it runs a
    little faster than zlib.crc32 (the second lane costs a shifted copy of
    each chunk: 2.5x the one-lane sum's time). Not a cryptographic hash.
    """

    __slots__ = ("h", "acc", "h_high", "acc_high", "pos", "carry")

    def __init__(self) -> None:
        self.h = self.acc = self.h_high = self.acc_high = 0
        self.pos = 0
        self.carry = b""

    def update(self, buf: memoryview | bytes) -> None:
        view = memoryview(buf)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        if self.carry:
            take = view[: 8 - len(self.carry)]
            self.carry += bytes(take)
            view = view[len(take) :]
            if len(self.carry) < 8:
                return
            self._words(np.frombuffer(self.carry, dtype="<u8"))
            self.carry = b""
        n = len(view) // 8
        if n:
            self._words(np.frombuffer(view, dtype="<u8", count=n))
        if len(view) > 8 * n:
            self.carry = bytes(view[8 * n :])

    def _words(self, words: np.ndarray) -> None:
        i, n = 0, words.size
        while i < n:
            take = min(_WSUM_CHUNK - self.pos, n - i)
            chunk, weights = words[i : i + take], _WSUM_WEIGHTS[self.pos : self.pos + take]
            self.acc = (self.acc + int(np.dot(chunk, weights))) & _MASK64
            self.acc_high = (self.acc_high + int(np.dot(chunk >> _HIGH_HALF, weights))) & _MASK64
            self.pos += take
            i += take
            if self.pos == _WSUM_CHUNK:
                self.h = (self.h * _WSUM_MULT + self.acc) & _MASK64
                self.h_high = (self.h_high * _WSUM_MULT + self.acc_high) & _MASK64
                self.acc = self.acc_high = 0
                self.pos = 0

    def digest(self) -> int:
        if self.carry:
            self._words(np.frombuffer(self.carry.ljust(8, b"\0"), dtype="<u8"))
            self.carry = b""
        h, high = self.h, self.h_high
        if self.pos:
            h = (h * _WSUM_MULT + self.acc) & _MASK64
            high = (high * _WSUM_MULT + self.acc_high) & _MASK64
        return h ^ ((high << 1 | high >> 63) & _MASK64)


def payload_checksum(parts: Iterable[memoryview | bytes], algo: int) -> int:
    """Checksum of the concatenation of ``parts`` with algorithm id ``algo`` (see CHECKSUMS)."""
    if algo == CHECKSUMS["wsum64"]:
        state = _WSum64()
        for part in parts:
            state.update(part)
        return state.digest()
    if algo == CHECKSUMS["none"]:
        return 0
    if algo == CHECKSUMS["crc32"]:
        crc = 0
        for part in parts:
            crc = zlib.crc32(part, crc)
        return crc
    raise CorruptPage(f"unknown checksum algorithm {algo}")


def checksum_id(name: str) -> int:
    try:
        return CHECKSUMS[name]
    except KeyError:
        raise StorageKeyError(f"checksum must be one of {sorted(CHECKSUMS)}, got {name!r}") from None


def encode_header(key: bytes, parts: Sequence[memoryview | bytes], algo: int = CHECKSUMS["wsum64"],
                  fmt: bytes = UNTYPED) -> bytes:
    """Header + key bytes that precede the payload ``parts`` in every stored value (``fmt``: page format field)."""
    payload_len = sum(len(p) for p in parts)
    check = payload_checksum(parts, algo)
    head = HEADER.pack(MAGIC, FORMAT_VERSION, algo, len(key), payload_len, check, fmt, 0)[:_HEADER_CRC_SPAN]
    header_crc = zlib.crc32(key, zlib.crc32(head))
    return head + struct.pack("<I", header_crc) + key


def parse_header(buf: bytes | bytearray | memoryview, key: bytes, fmt: bytes = UNTYPED) -> tuple[int, int, int]:
    """Check the header + key at the start of ``buf``; returns (payload_len, algo, checksum).

    Raises :class:`CorruptPage` when anything does not match (:class:`FormatMismatch`
    when only the page format differs from ``fmt``).
    """
    if len(buf) < HEADER.size + len(key):
        raise CorruptPage(f"short header ({len(buf)} bytes)")
    magic, version, algo, key_len, payload_len, check, stored_fmt, header_crc = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptPage("bad magic")
    if version != FORMAT_VERSION:  # another version of this library wrote it: foreign, left for its readers
        raise FormatMismatch(b"format version %d" % version, fmt)
    if key_len != len(key):
        raise CorruptPage("key length mismatch")
    stored_key = bytes(buf[HEADER.size : HEADER.size + key_len])
    if zlib.crc32(stored_key, zlib.crc32(bytes(buf[:_HEADER_CRC_SPAN]))) != header_crc:
        raise CorruptPage("header checksum mismatch")
    if stored_key != key:
        raise CorruptPage("stored under a different key")
    if algo not in _CHECKSUM_NAMES:  # as above: a checksum this version does not know
        raise FormatMismatch(b"checksum algorithm %d" % algo, fmt)
    if stored_fmt != fmt:
        raise FormatMismatch(stored_fmt, fmt)
    return payload_len, algo, check


def verify_payload(parts: Sequence[memoryview | bytes], algo: int, check: int) -> None:
    """Raise :class:`CorruptPage` unless ``parts`` hash to ``check``."""
    if payload_checksum(parts, algo) != check:
        raise CorruptPage(f"payload {_CHECKSUM_NAMES.get(algo, algo)} checksum mismatch")


def decode_blob(blob: bytes | memoryview, key: bytes, fmt: bytes = UNTYPED) -> memoryview:
    """Verify a whole stored value and return a view of its payload (raises CorruptPage)."""
    view = memoryview(blob)
    payload_len, algo, check = parse_header(view, key, fmt)
    start = HEADER.size + len(key)
    if len(view) - start != payload_len:
        raise CorruptPage(f"payload is {len(view) - start} bytes, header says {payload_len}")
    payload = view[start:]
    verify_payload([payload], algo, check)
    return payload
