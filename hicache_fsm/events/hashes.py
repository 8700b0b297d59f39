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

import sys
from array import array
from typing import Hashable, Sequence

from hicache_fsm.errors import StorageKeyError
from hicache_fsm.events.wire import ID_CODE, int64_array, uint32_array
from hicache_fsm.radix import TreeNode
from hicache_fsm.storage.keys import page_digests, page_keys
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
    return page_digests(packed.tobytes(), page_size, prior)


def _int64(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "big", signed=True)


def request_hashes(tokens: Sequence[int], page_size: int, namespace: Hashable = None) -> list[int]:
    """The int64 block hashes of every full page of ``tokens`` from the start of a sequence."""
    return [_int64(d) for d in chained_digests(tokens, page_size, _seed(namespace))]


# A node's key without copying it: its packed ids (little-endian uint32 bytes, for trees
# that keep keys packed), or (token tuple, start, end).
KeySpan = bytes | tuple[tuple[int, ...], int, int]


def key_span(node: TreeNode) -> KeySpan:
    """``node``'s key as it is held, without slicing or decoding it.

    Reading ``node.key`` would decode thousands of ids on the serving thread,
    which measured as most of what events cost. The packed bytes are taken
    now, while they are the node's key (a split gives the node new bytes
    later), and decoded when the event is rendered.
    """
    return node.raw  # the tree keeps keys packed: immutable bytes, shared as they are


def span_tokens(span: KeySpan, recent: "RecentSlices | None" = None) -> tuple[int, ...] | list[int]:
    """The token ids of ``span``; ``recent`` hands back a slice it made for the same span."""
    if isinstance(span, bytes):
        ids = array("I")
        ids.frombytes(span)
        if sys.byteorder == "big":
            ids.byteswap()
        return ids.tolist()
    source, start, end = span
    if start == 0 and end == len(source):
        return source
    return source[start:end] if recent is None else recent.get(source, start, end)


def span_wire_tokens(span: KeySpan, recent: "RecentSlices | None" = None) -> bytes:
    """``span``'s token ids as a msgpack array; ``StorageKeyError`` if one does not fit 32 bits."""
    if isinstance(span, bytes):
        return uint32_array(span)
    try:
        packed = array(ID_CODE, span_tokens(span, recent))
    except (OverflowError, TypeError):
        raise StorageKeyError("a token id does not fit 32 bits: the event has no page key") from None
    if sys.byteorder == "big":
        packed.byteswap()
    return uint32_array(packed.tobytes())


def span_digests(span: KeySpan, page_size: int, prior: bytes, recent: "RecentSlices | None" = None) -> list[bytes]:
    """The chained page digests of ``span``: packed bytes are hashed in place."""
    if isinstance(span, bytes):
        return page_digests(span, page_size, prior)
    return chained_digests(span_tokens(span, recent), page_size, prior)


class RecentSlices:
    """The last few span slices made while rendering, so a node's tokens are copied once, not per use.

    A node's key is sliced for its page hashes and again for each ``BlockStored``
    (device, then host a few batches later); each slice reads thousands of
    scattered int objects. Used by one rendering thread at a time.
    """

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._slices: dict[tuple[int, int, int], tuple[tuple, tuple[int, ...]]] = {}
        self._wires: dict[int, tuple[bytes, bytes]] = {}

    def wire_tokens(self, span: KeySpan) -> bytes:
        """``span``'s token ids as a msgpack array, encoded once for a node's device and host events."""
        if not isinstance(span, bytes):
            return span_wire_tokens(span, self)
        hit = self._wires.get(id(span))
        if hit is not None and hit[0] is span:
            return hit[1]
        wire = uint32_array(span)
        if len(self._wires) >= self.size:
            del self._wires[next(iter(self._wires))]
        self._wires[id(span)] = (span, wire)  # holding ``span`` keeps its id from being reused
        return wire

    def get(self, source: tuple[int, ...], start: int, end: int) -> tuple[int, ...]:
        key = (id(source), start, end)
        hit = self._slices.get(key)
        if hit is not None and hit[0] is source:
            return hit[1]
        tokens = source[start:end]
        if len(self._slices) >= self.size:
            del self._slices[next(iter(self._slices))]
        self._slices[key] = (source, tokens)  # holding ``source`` keeps its id from being reused
        return tokens


class PageChain:
    """One node's run of pages in the key chain, hashed on first ask and then kept.

    Built on the serving thread from immutable facts only (the node's token
    tuple and its parent's chain, or a slice of a chain split in two), so the
    SHA-256 work can run later on any thread: the publisher's sender thread
    renders queued events while the tree goes on changing. Each page is
    hashed once in its chain's life; a split slices the digests.
    """

    __slots__ = ("page_size", "_todo", "_digests", "_ints", "_wire")

    def __init__(self, page_size: int, todo: tuple) -> None:
        self.page_size = page_size
        # ("tokens", key span, parent chain or None, namespace) or ("slice", chain, first page, end page)
        self._todo: tuple | None = todo
        self._digests: list[bytes] | None = None
        self._ints: list[int] | None = None
        self._wire: bytes | None = None

    @classmethod
    def of_span(cls, page_size: int, span: "KeySpan", parent: "PageChain | None", namespace: Hashable) -> "PageChain":
        return cls(page_size, ("tokens", span, parent, namespace))

    def sliced(self, first: int, end: int | None) -> "PageChain":
        """Pages ``first:end`` of this chain (the halves of a split node)."""
        return PageChain(self.page_size, ("slice", self, first, end))

    def digests(self, recent: RecentSlices | None = None) -> list[bytes]:
        """The 32-byte page digests; ``StorageKeyError`` if a token id does not fit 32 bits."""
        digests = self._digests
        if digests is None:
            todo = self._todo
            if todo is None:  # another thread finished it between the two reads
                return self._digests  # type: ignore[return-value]
            if todo[0] == "slice":
                digests = todo[1].digests(recent)[todo[2] : todo[3]]
            else:
                _, span, parent, namespace = todo
                prior = _seed(namespace) if parent is None else parent.digests(recent)[-1]
                digests = span_digests(span, self.page_size, prior, recent)
            self._digests = digests
            self._todo = None  # the tokens and the parent chain are no longer needed
        return digests

    def int_keys(self, recent: RecentSlices | None = None) -> list[int]:
        """The pages' int64 block hashes (SGLang's form)."""
        ints = self._ints
        if ints is None:
            from_bytes = int.from_bytes
            ints = self._ints = [from_bytes(d[:8], "big", signed=True) for d in self.digests(recent)]
        return ints

    def last_int_key(self, recent: RecentSlices | None = None) -> int:
        ints = self._ints
        return ints[-1] if ints is not None else _int64(self.digests(recent)[-1])

    def wire_keys(self, recent: RecentSlices | None = None) -> bytes:
        """The int64 block hashes as a msgpack array (encoded once, for every event of this chain)."""
        wire = self._wire
        if wire is None:
            wire = self._wire = int64_array(self.digests(recent))
        return wire


class NodeChains:
    """The :class:`PageChain` of each live node id; a split slices it, a removal forgets it.

    Only cheap bookkeeping runs here (the serving thread): no page is hashed.
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._chains: dict[int, PageChain] = {}

    def chain(self, node: TreeNode) -> PageChain | None:
        """``node``'s chain (``None`` for the root), made for it and any unchained ancestor on first ask."""
        chains = self._chains
        chain = chains.get(node.id)
        if chain is not None or node.is_root:
            return chain
        missing = []
        while chain is None and not node.is_root:
            missing.append(node)
            node = node.parent  # type: ignore[assignment]
            chain = chains.get(node.id)
        for n in reversed(missing):
            chain = chains[n.id] = PageChain.of_span(self.page_size, key_span(n), chain, n.namespace)
        return chain

    def split(self, node: TreeNode, upper: TreeNode) -> None:
        chain = self._chains.pop(node.id, None)
        if chain is not None:
            pages = upper.num_tokens // self.page_size
            self._chains[upper.id] = chain.sliced(0, pages)
            self._chains[node.id] = chain.sliced(pages, None)

    def forget(self, node: TreeNode) -> None:
        self._chains.pop(node.id, None)

    def clear(self) -> None:
        self._chains.clear()
