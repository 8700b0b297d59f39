"""Page keys of tree nodes as int64 block hashes, memoised per node.

A node's pages are keyed by the same chained SHA-256 the storage tier uses
(:func:`hicache_fsm.storage.keys.page_keys`: the previous page's 32-byte
digest, then each token as 4 bytes little-endian; the first page seeded per
namespace by :func:`hicache_fsm.storage.tier.namespace_seed`), so one prefix
has one hash in every instance and in L3. Events carry each key's first 64
bits as a signed int64, SGLang's ``hash_str_to_int64``. A router computes the
same hashes from a request's tokens with :func:`request_hashes`.

The digests are computed here with the tokens packed by ``array`` (the
cache already checked them), which is what keeps events cheap next to the
controller; a token that does not fit 32 bits falls back to ``page_keys``.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from typing import Hashable, Sequence

from hicache_fsm.radix import TreeNode
from hicache_fsm.storage.keys import page_keys
from hicache_fsm.storage.tier import namespace_seed


def int64_hash(hex_key: str) -> int:
    """SGLang's event form of a page key: its first 16 hex digits as a signed 64-bit integer."""
    value = int(hex_key[:16], 16)
    return value - (1 << 64) if value >= 1 << 63 else value


def _seed(namespace: Hashable) -> bytes:
    seed = namespace_seed(namespace)
    return b"" if seed is None else bytes.fromhex(seed)


def chained_digests(tokens: Sequence[int], page_size: int, prior: bytes) -> list[bytes]:
    """SHA-256 digests of every full page of ``tokens`` chained onto ``prior`` (``page_keys`` as bytes)."""
    try:
        packed = array("I", tokens)
        if packed.itemsize != 4:  # a platform whose unsigned int is not 4 bytes
            raise TypeError
    except (OverflowError, TypeError):
        return [bytes.fromhex(k) for k in page_keys(tokens, page_size, prior.hex() or None)]
    if sys.byteorder == "big":
        packed.byteswap()
    raw = memoryview(packed).cast("B")  # pages are hashed in place, never copied
    stride = 4 * page_size
    sha = hashlib.sha256
    out = []
    for start in range(0, len(raw) - stride + 1, stride):
        h = sha(prior)
        h.update(raw[start : start + stride])
        prior = h.digest()
        out.append(prior)
    return out


def _int64(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "big", signed=True)


def request_hashes(tokens: Sequence[int], page_size: int, namespace: Hashable = None) -> list[int]:
    """The int64 block hashes of every full page of ``tokens`` from the start of a sequence."""
    return [_int64(d) for d in chained_digests(tokens, page_size, _seed(namespace))]


class NodeKeys:
    """Page digests and int64 hashes per live node id; a split slices them, a removal forgets them."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._keys: dict[int, tuple[list[bytes], list[int]]] = {}

    def _entry(self, node: TreeNode) -> tuple[list[bytes], list[int]]:
        entry = self._keys.get(node.id)
        if entry is None:
            parent = node.parent
            prior = _seed(node.namespace) if parent is None or parent.is_root else self._entry(parent)[0][-1]
            digests = chained_digests(node.key, self.page_size, prior)
            from_bytes = int.from_bytes
            entry = self._keys[node.id] = (digests, [from_bytes(d[:8], "big", signed=True) for d in digests])
        return entry

    def int_keys(self, node: TreeNode) -> list[int]:
        return self._entry(node)[1]

    def parent_hash(self, node: TreeNode) -> int | None:
        parent = node.parent
        return None if parent is None or parent.is_root else self._entry(parent)[1][-1]

    def split(self, node: TreeNode, upper: TreeNode) -> None:
        entry = self._keys.pop(node.id, None)
        if entry is not None:
            pages = upper.num_tokens // self.page_size
            digests, ints = entry
            self._keys[upper.id] = (digests[:pages], ints[:pages])
            self._keys[node.id] = (digests[pages:], ints[pages:])

    def forget(self, node: TreeNode) -> None:
        self._keys.pop(node.id, None)

    def clear(self) -> None:
        self._keys.clear()
