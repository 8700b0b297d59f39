"""Page keys of tree nodes as int64 block hashes, each page hashed once in its node's life.

A node's pages are keyed by the same chained SHA-256 the storage tier uses
(:func:`hicache_fsm.storage.keys.page_digests`: the previous page's 32-byte
digest, then each token as 4 bytes little-endian; the first page seeded per
namespace by :func:`hicache_fsm.storage.tier.namespace_seed`), so one prefix
has one hash in every instance and in L3. Events carry each key's first 64
bits as a signed int64, SGLang's ``hash_str_to_int64``. A router computes the
same hashes from a request's tokens with :func:`request_hashes`.

The tree keeps every node's key packed (little-endian uint32 bytes), so a
node's pages are hashed from those bytes in place. A chain keeps its digests
joined in one ``bytes`` (32 a page): its removal events, its second tier's
``BlockStored`` and the halves of a split reuse them; with an L3 attached the
storage tier's keys for the node, once it has them, are read instead of
hashing (:meth:`PageChain.digests`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Sequence

from hicache_fsm.events.wire import DIGEST_BYTES, int64_array, int64_list, token_array, uint32_list
from hicache_fsm.radix import TreeNode
from hicache_fsm.storage.keys import check_page_size, key_token_bytes, page_digests
from hicache_fsm.storage.tier import namespace_seed


def int64_hash(hex_key: str) -> int:
    """SGLang's event form of a page key: its first 16 hex digits as a signed 64-bit integer."""
    value = int(hex_key[:16], 16)
    return value - (1 << 64) if value >= 1 << 63 else value


def seed_digest(namespace: Hashable) -> bytes:
    """The prior of a sequence's first page in ``namespace`` (empty: none)."""
    seed = namespace_seed(namespace)
    return b"" if seed is None else bytes.fromhex(seed)


def chained_digests(tokens: Sequence[int], page_size: int, prior: bytes) -> list[bytes]:
    """SHA-256 digests of every full page of ``tokens`` chained onto ``prior`` (``page_keys`` as bytes).

    ``tokens`` are checked and packed once (a ``TokenIds`` is used as it is).
    """
    return page_digests(key_token_bytes(tokens), check_page_size(page_size), prior)


def request_hashes(tokens: Sequence[int], page_size: int, namespace: Hashable = None) -> list[int]:
    """The int64 block hashes of every full page of ``tokens`` from the start of a sequence."""
    return int64_list(b"".join(chained_digests(tokens, page_size, seed_digest(namespace))))


class PageChain:
    """One node's run of pages in the key chain, hashed on first ask and then kept.

    Built on the serving thread from immutable facts only (the node's packed
    key and its parent's chain, or a slice of a chain split in two), so the
    SHA-256 work can run later on any thread: the publisher's sender thread
    renders queued events while the tree goes on changing. Each page is
    hashed once in its chain's life; a split slices the digests.

    ``node`` (kept until hashed) lets the chain take the storage tier's keys
    for the same pages when the tier computed them first: a node's
    ``storage_keys`` are set once, as a whole tuple, and read here only when
    they cover exactly this chain's pages (the node was not split since).
    """

    __slots__ = ("page_size", "pages", "_todo", "_digests", "_wire")

    def __init__(self, page_size: int, pages: int, todo: tuple) -> None:
        self.page_size = page_size
        self.pages = pages
        # ("tokens", packed key, parent chain or None, namespace, node) or ("slice", chain, first page, end page)
        self._todo: tuple | None = todo
        self._digests: bytes | None = None
        self._wire: bytes | None = None

    @classmethod
    def of_node(cls, page_size: int, node: TreeNode, parent: "PageChain | None") -> "PageChain":
        raw = node.raw
        return cls(page_size, len(raw) // (4 * page_size), ("tokens", raw, parent, node.namespace, node))

    def sliced(self, first: int, end: int) -> "PageChain":
        """Pages ``first:end`` of this chain (the halves of a split node)."""
        return PageChain(self.page_size, end - first, ("slice", self, first, end))

    def digests(self) -> bytes:
        """The 32-byte page digests, joined."""
        digests = self._digests
        if digests is None:
            todo = self._todo
            if todo is None:  # another thread finished it between the two reads
                return self._digests  # type: ignore[return-value]
            if todo[0] == "slice":
                digests = todo[1].digests()[todo[2] * DIGEST_BYTES : todo[3] * DIGEST_BYTES]
            else:
                _, raw, parent, namespace, node = todo
                digests = _storage_digests(node, self.pages)
                if digests is None:
                    prior = seed_digest(namespace) if parent is None else parent.last_digest()
                    digests = b"".join(page_digests(raw, self.page_size, prior))
            self._digests = digests
            self._todo = None  # the key, the node and the parent chain are no longer needed
        return digests

    def last_digest(self) -> bytes:
        return self.digests()[-DIGEST_BYTES:]

    def int_keys(self) -> list[int]:
        """The pages' int64 block hashes (SGLang's form)."""
        return int64_list(self.digests())

    def last_int_key(self) -> int:
        return int.from_bytes(self.digests()[-DIGEST_BYTES : 8 - DIGEST_BYTES], "big", signed=True)

    def wire_keys(self) -> bytes:
        """The int64 block hashes as a msgpack array (encoded once, for every event of this chain)."""
        wire = self._wire
        if wire is None:
            wire = self._wire = int64_array(self.digests())
        return wire


def _storage_digests(node: TreeNode, pages: int) -> bytes | None:
    """The storage tier's keys of ``node`` as joined digests, when it has them for exactly ``pages`` pages."""
    keys = node.storage_keys
    if keys is None or len(keys) != pages or not pages:
        return None
    try:
        digests = bytes.fromhex("".join(keys))
    except (TypeError, ValueError):  # not hex digests: keys of another form
        return None
    return digests if len(digests) == pages * DIGEST_BYTES else None


class RecentTokens:
    """The last few token lists made while rendering, so a node's device and host events make them once.

    Each ``BlockStored`` carries its node's token ids, as msgpack bytes (ZMQ)
    or a list of ints (in-process); a node's second event reuses the first's.
    Used by one rendering thread at a time; holding the packed key keeps its
    id from being reused.
    """

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._made: OrderedDict[tuple[int, bool], tuple[bytes, bytes | list[int]]] = OrderedDict()

    def wire(self, raw: bytes) -> bytes:
        """``raw`` (packed little-endian uint32 ids) as a msgpack array."""
        return self._get(raw, True)  # type: ignore[return-value]

    def ids(self, raw: bytes) -> list[int]:
        """``raw`` as a list of ints (the same list for a node's events: read it, do not change it)."""
        return self._get(raw, False)  # type: ignore[return-value]

    def _get(self, raw: bytes, wire: bool) -> bytes | list[int]:
        key = (id(raw), wire)
        hit = self._made.get(key)
        if hit is not None and hit[0] is raw:
            return hit[1]
        made = token_array(raw) if wire else uint32_list(raw)
        if len(self._made) >= self.size:
            self._made.popitem(last=False)  # the oldest (O(1), unlike a plain dict's first key)
        self._made[key] = (raw, made)
        return made


class NodeChains:
    """The :class:`PageChain` of each live node id; a split slices it, a removal forgets it.

    Only cheap bookkeeping runs here (the serving thread): no page is hashed.
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.by_id: dict[int, PageChain] = {}

    def chain(self, node: TreeNode) -> PageChain | None:
        """``node``'s chain (``None`` for the root), made for it and any unchained ancestor on first ask."""
        chains = self.by_id
        chain = chains.get(node.id)
        if chain is not None or node.is_root:
            return chain
        missing = []
        while chain is None and not node.is_root:
            missing.append(node)
            node = node.parent  # type: ignore[assignment]
            chain = chains.get(node.id)
        for n in reversed(missing):
            chain = chains[n.id] = PageChain.of_node(self.page_size, n, chain)
        return chain

    def split(self, node: TreeNode, upper: TreeNode) -> None:
        chain = self.by_id.pop(node.id, None)
        if chain is not None:
            pages = upper.num_tokens // self.page_size
            self.by_id[upper.id] = chain.sliced(0, pages)
            self.by_id[node.id] = chain.sliced(pages, chain.pages)

    def forget(self, node: TreeNode) -> None:
        self.by_id.pop(node.id, None)

    def clear(self) -> None:
        self.by_id.clear()
