"""A page-aligned radix tree of token prefixes.

Each node owns a run of whole pages: its token ids packed as ``tokens.TokenIds``
packs them (``raw``; ``key`` decodes them), and, depending on
its residency state, device and host slot indices for them. The tree only
knows shape; where the KV lives is the residency machine's business, driven by
``HiCache``. Entries carry an optional namespace (LoRA id, cache salt, tenant)
so that two namespaces never match each other's prefixes.
"""

from __future__ import annotations

import itertools
import zlib
from typing import Callable, Hashable, Iterator, Mapping

import numpy as np
import torch

from hicache_fsm.allocator import PAGE_ID_DTYPE
from hicache_fsm.tokens import ID_BYTES, TokenIds, pack_token_ids, unpack_token_ids

ROOT_STATE = "root"

NO_JOBS: frozenset[int] = frozenset()  # the ``pending_jobs`` of a node no job covers (shared: no set per node)


class _NoChildren(dict):
    """The one empty, read-only ``children`` every leaf shares (a dict per leaf costs 64 bytes)."""

    __slots__ = ()

    def _refuse(self, *args, **kwargs):
        raise TypeError("a leaf's shared empty children mapping is read-only (RadixTree gives a node its own dict)")

    __setitem__ = __delitem__ = setdefault = update = pop = popitem = clear = __ior__ = _refuse

    def __copy__(self) -> "_NoChildren":
        return self

    def __deepcopy__(self, memo: dict) -> "_NoChildren":
        return self

    def __reduce__(self):
        return "NO_CHILDREN"  # the module global: a copy or a pickle is the same object


NO_CHILDREN: Mapping = _NoChildren()  # the ``children`` of a leaf (shared, read-only: no dict per leaf)

_ROWS: dict[int, np.ndarray] = {}  # page size -> the offsets 0..page_size-1 of a page's slots


def _page_row(page_size: int) -> np.ndarray:
    row = _ROWS.get(page_size)
    if row is None:
        row = _ROWS[page_size] = np.arange(page_size, dtype=np.int64)
    return row


def slots_of_pages(pages: bytes, page_size: int) -> torch.Tensor:
    """The slot indices (int64 tensor, a fresh copy) of page ids packed as native int64 ``bytes``."""
    p = np.frombuffer(pages, PAGE_ID_DTYPE)
    if page_size == 1:
        return torch.from_numpy(p.copy())
    return torch.from_numpy((p[:, None] * page_size + _page_row(page_size)).reshape(-1))


def slot_tensor(slots: "bytes | torch.Tensor | None", allocator) -> torch.Tensor | None:
    """A node's compact slots (``TreeNode.device_slots`` / ``host_slots``) as an index tensor of ``allocator``.

    Page ids are expanded by the allocator's slot table (one gather) where it
    has one; a tensor or None is returned as it is.
    """
    if type(slots) is not bytes:
        return slots
    expand = getattr(allocator, "slot_tensor", None)
    if expand is None:
        return slots_of_pages(slots, allocator.page_size)
    return expand(np.frombuffer(slots, PAGE_ID_DTYPE))  # the dtype positional: half the cost of a keyword


def pack_slots(indices: "torch.Tensor | None", page_size: int) -> "bytes | torch.Tensor | None":
    """The compact form a node keeps of slot indices: page ids as int64 ``bytes`` where they are whole pages.

    A tensor that is not whole pages in order (a CP layout, a test's odd
    tensor) is kept as it is, so reading it back always gives what was set.
    """
    if (indices is None or type(indices) is not torch.Tensor or indices.dtype != torch.int64
            or indices.dim() != 1 or not indices.is_cpu or indices.requires_grad):
        return indices
    a = indices.numpy()
    n = a.size
    if n % page_size:
        return indices
    if n == 0:
        return b""
    first = a[::page_size]
    if first.min() < 0 or (first % page_size).any():
        return indices
    if page_size > 1 and not np.array_equal(a.reshape(-1, page_size), first[:, None] + _page_row(page_size)):
        return indices
    return (first // page_size).tobytes()


class TreeNode:
    """One run of pages in the tree.

    ``raw`` holds the node's token ids packed as ``tokens.TokenIds`` packs
    them (4 bytes an id, whole pages); ``key`` decodes them for readers that
    want ints. ``lock_ref`` counts locks on this node or any descendant (a
    lock pins the whole path to the root on the device), ``own_locks`` those
    taken on this node itself (only they may be unlocked here); ``host_ref`` pins
    this node's host copy only (prefetch anchors). ``pending_jobs`` holds ids
    of in-flight jobs that cover this node, so a node split mid-transfer can
    enrol its new half in the same jobs (``NO_JOBS`` when none: change it
    through ``add_job`` / ``drop_job``). ``resident_children`` is maintained
    by the cache (``hicache_fsm.eviction``) so that eviction never scans
    children.

    A node is small because a cache holds millions: slots are kept as
    ``device_slots`` / ``host_slots``, page ids packed as int64 ``bytes``
    (see ``pack_slots``); ``device_indices`` / ``host_indices`` build the
    slot-index tensor on each read and accept a tensor on write. A leaf
    shares ``NO_CHILDREN`` and a node without jobs ``NO_JOBS``.
    """

    __slots__ = (
        "id",
        "parent",
        "children",
        "raw",
        "namespace",
        "state",
        "page_size",
        "device_slots",
        "host_slots",
        "lock_ref",
        "own_locks",
        "host_ref",
        "hit_count",
        "last_access",
        "priority",
        "storage_keys",
        "pending_jobs",
        "cp_meta",
        "last_poll",
        "resident_children",
    )

    def __init__(self, node_id: int, raw: bytes, namespace: Hashable, parent: "TreeNode | None",
                 page_size: int = 1) -> None:
        self.id = node_id
        self.parent = parent
        self.children: Mapping[tuple, TreeNode] = NO_CHILDREN
        self.raw = raw
        self.namespace = namespace
        self.state = ROOT_STATE if parent is None else "absent"
        self.page_size = page_size
        self.device_slots: bytes | torch.Tensor | None = None
        self.host_slots: bytes | torch.Tensor | None = None
        self.lock_ref = 0
        self.own_locks = 0
        self.host_ref = 0
        self.hit_count = 0
        self.last_access = 0
        self.priority = 0
        self.storage_keys: tuple[str, ...] | None = None
        self.pending_jobs: set[int] | frozenset[int] = NO_JOBS
        self.cp_meta: object | None = None
        self.last_poll = 0  # the cache's poll count at the last access (write_behind coldness)
        self.resident_children = 0  # children on (or coming to) the device; kept by the cache's eviction part

    @property
    def device_indices(self) -> torch.Tensor | None:
        """The node's device slot indices (a fresh int64 tensor on each read), or None."""
        s = self.device_slots
        return slots_of_pages(s, self.page_size) if type(s) is bytes else s

    @device_indices.setter
    def device_indices(self, indices: torch.Tensor | None) -> None:
        self.device_slots = pack_slots(indices, self.page_size)

    @property
    def host_indices(self) -> torch.Tensor | None:
        """The node's host slot indices (a fresh int64 tensor on each read), or None."""
        s = self.host_slots
        return slots_of_pages(s, self.page_size) if type(s) is bytes else s

    @host_indices.setter
    def host_indices(self, indices: torch.Tensor | None) -> None:
        self.host_slots = pack_slots(indices, self.page_size)

    def add_job(self, job_id: int) -> None:
        jobs = self.pending_jobs
        if not jobs:  # ``NO_JOBS``, or an empty frozenset a deep copy made of it
            self.pending_jobs = {job_id}
        else:
            jobs.add(job_id)

    def drop_job(self, job_id: int) -> None:
        jobs = self.pending_jobs
        if jobs:
            jobs.discard(job_id)
            if not jobs:
                self.pending_jobs = NO_JOBS

    @property
    def key(self) -> tuple[int, ...]:
        """The node's token ids as ints (decoded from ``raw`` on every read: the tree itself never reads this)."""
        return unpack_token_ids(self.raw)

    @key.setter
    def key(self, value) -> None:
        self.raw = pack_token_ids(value).raw

    @property
    def token_ids(self) -> TokenIds:
        """The node's token ids, packed (what storage page hashes read)."""
        return TokenIds(self.raw)

    @property
    def num_tokens(self) -> int:
        return len(self.raw) >> 2

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, tokens={self.num_tokens}, state={self.state})"


def _split_slots(slots, at: int, pages: int) -> tuple:
    """``slots`` (compact page ids, a tensor, or None) cut after ``at`` tokens (``pages`` pages)."""
    if slots is None:
        return None, None
    if type(slots) is bytes:
        cut = pages * 8
        return slots[:cut], slots[cut:]
    return slots[:at], slots[at:]


def page_key(namespace: Hashable, first_page: bytes) -> "bytes | tuple":
    """A child's key in its parent's ``children``: the first page's packed ids, with the namespace unless None.

    The two forms never collide (bytes never equal a tuple); a namespace that
    cannot be hashed raises ``TypeError`` here, as in any lookup.
    """
    return first_page if namespace is None else (namespace, first_page)


def content_mark(node: TreeNode, page_bytes: int) -> int:
    """A node's share of ``RadixTree.content_mark``: its first page, namespace and length, the same on every rank
    (``zlib.crc32``: ``hash`` of a str is salted per process)."""
    ns = b"" if node.namespace is None else repr(node.namespace).encode("utf-8", "backslashreplace")
    return zlib.crc32(node.raw[:page_bytes], zlib.crc32(ns)) | (len(node.raw) << 32)


class RadixTree:
    """Prefix match, insert and split over page-aligned runs of packed token ids.

    Methods take token ids as a ``TokenIds`` (what the cache passes: packed
    once at its boundary) or as any sequence ``pack_token_ids`` accepts
    (packed, and so checked, on the way in). A child is found in its parent's
    ``children`` under ``child_key``: its packed first page, paired with its
    namespace when that is not None (a pair costs 72 bytes a node, and most
    caches use no namespace).
    """

    def __init__(self, page_size: int) -> None:
        if page_size <= 0:
            raise ValueError("page_size must be positive")
        self.page_size = page_size
        self.page_bytes = page_size * ID_BYTES
        self._ids = itertools.count(1)
        self.root = TreeNode(0, b"", None, None, page_size)
        self._nodes: dict[int, TreeNode] = {0: self.root}
        self.by_id = self._nodes  # every live node by id, the root included: read it, never change it
        self.version = 0  # bumped by every change of shape (split, add, remove)
        # with ``marking`` on (a rank group compares it at every poll): the XOR of every node's ``content_mark``,
        # so ranks whose trees hold other tokens in the same shape differ (node counts and pages alone do not)
        self.marking = False
        self.content_mark = 0

    def clear(self) -> None:
        """Drop every node, in place: the parts holding this tree see it empty (a cache ``reset``).

        Ids start again from 1 as in a new tree; ``version`` keeps growing, so
        no walk remembered before the clear is taken for one after it.
        """
        self._ids = itertools.count(1)
        self.root = TreeNode(0, b"", None, None, self.page_size)
        self._nodes = self.by_id = {0: self.root}
        self.version += 1
        self.content_mark = 0

    # ------------------------------------------------------------------ lookup

    def get(self, node_id: int) -> TreeNode | None:
        return self._nodes.get(node_id)

    def owns(self, node: TreeNode) -> bool:
        return self._nodes.get(node.id) is node

    def nodes(self) -> Iterator[TreeNode]:
        """Every live node, the root included."""
        return iter(list(self._nodes.values()))

    def __len__(self) -> int:
        return len(self._nodes) - 1

    def child_key(self, namespace: Hashable, tokens, start: int) -> "bytes | tuple":
        """The key of the child holding ``tokens[start:]`` in its parent's ``children`` (see ``page_key``)."""
        raw = pack_token_ids(tokens).raw
        return page_key(namespace, raw[start * ID_BYTES : start * ID_BYTES + self.page_bytes])

    def starts_a_prefix(self, namespace: Hashable, first_page: bytes) -> bool:
        """Whether a cached prefix in ``namespace`` begins with ``first_page`` (a page of packed ids)."""
        return page_key(namespace, first_page) in self.root.children

    def aligned(self, tokens):
        """``tokens`` cut to whole pages (same type as given)."""
        n = len(tokens) - len(tokens) % self.page_size
        if type(tokens) is TokenIds:
            return TokenIds(tokens.raw[: n * ID_BYTES])
        return tokens[:n]

    def walk(self, tokens, namespace: Hashable = None) -> tuple[list[TreeNode], int, int]:
        """Follow ``tokens`` down the tree without changing it.

        Returns the fully matched nodes (top-down), the matched token count, and
        how many tokens of the next node also match (0 when none, else a page
        multiple shorter than that node: the caller splits it to use them).
        A node is compared with one ``startswith`` on the packed bytes (no copy).
        """
        raw = tokens.raw if type(tokens) is TokenIds else pack_token_ids(tokens).raw
        pb = self.page_bytes
        n = len(raw) - len(raw) % pb
        children = self.root.children
        path: list[TreeNode] = []
        pos = 0
        while pos < n:
            page = raw[pos : pos + pb]
            child = children.get(page if namespace is None else (namespace, page))  # ``page_key``, inline: per node
            if child is None:
                break
            key = child.raw
            end = pos + len(key)
            if end <= n and raw.startswith(key, pos):  # fast path: the whole node matches
                path.append(child)
                children = child.children
                pos = end
                continue
            shared = pb
            limit = min(len(key), n - pos)
            while shared < limit and raw.startswith(key[shared : shared + pb], pos + shared):
                shared += pb
            return path, pos // ID_BYTES, shared // ID_BYTES  # shared < len(key): the node matches in part
        return path, pos // ID_BYTES, 0

    # ------------------------------------------------------------------ change

    def split(self, node: TreeNode, at: int) -> TreeNode:
        """Split ``node`` after ``at`` tokens; the new upper half is returned.

        The upper half takes the first ``at`` tokens and slots, the node keeps
        the rest (and its identity, so handles the engine holds stay valid).
        Both halves keep the residency state, hit count, recency, priority and
        in-flight job ids (a job on the whole run covers both halves). The
        upper half gets the node's ``lock_ref``: it counts locks at or below a
        node, and the upper half is now an ancestor of every such lock. The
        host pin stays on the node only: ``host_ref`` is not propagated to
        ancestors, so copying it would leave the upper half pinned forever
        after the pin holder unpins the node; the upper half's host copy is
        still safe, since host eviction never takes a node with children.
        """
        if at <= 0 or at >= node.num_tokens or at % self.page_size:
            raise ValueError(f"cannot split node of {node.num_tokens} tokens at {at}")
        parent = node.parent
        if self.marking:
            self.content_mark ^= content_mark(node, self.page_bytes)  # the node as it was; both halves below
        cut = at * ID_BYTES
        upper = TreeNode(next(self._ids), node.raw[:cut], node.namespace, parent, self.page_size)
        upper.state = node.state
        upper.lock_ref = node.lock_ref
        upper.hit_count, upper.last_access, upper.priority = node.hit_count, node.last_access, node.priority
        upper.last_poll = node.last_poll
        if node.pending_jobs:
            upper.pending_jobs = set(node.pending_jobs)
        pages = at // self.page_size
        upper.device_slots, node.device_slots = _split_slots(node.device_slots, at, pages)
        upper.host_slots, node.host_slots = _split_slots(node.host_slots, at, pages)
        if node.storage_keys is not None:
            upper.storage_keys, node.storage_keys = node.storage_keys[:pages], node.storage_keys[pages:]
        pb = self.page_bytes
        parent.children[page_key(node.namespace, node.raw[:pb])] = upper
        node.raw = node.raw[cut:]
        node.parent = upper
        upper.children = {page_key(node.namespace, node.raw[:pb]): node}
        self._nodes[upper.id] = upper
        self.version += 1
        if self.marking:
            self.content_mark ^= content_mark(upper, pb) ^ content_mark(node, pb)
        return upper

    def add_child(self, parent: TreeNode, tokens, namespace: Hashable, start: int = 0) -> TreeNode:
        """Attach a new node (state ``absent``) holding ``tokens[start:]`` under ``parent``."""
        raw = tokens.raw if type(tokens) is TokenIds else pack_token_ids(tokens).raw
        length = len(raw) // ID_BYTES - start
        if start < 0 or length <= 0 or length % self.page_size:
            raise ValueError("a node holds a positive whole number of pages")
        key = raw[start * ID_BYTES :] if start else raw
        child = TreeNode(next(self._ids), key, namespace, parent, self.page_size)
        children = parent.children
        if children is NO_CHILDREN:
            children = parent.children = {}
        # one hash of the first page, not two (a lookup, then a store)
        if children.setdefault(page_key(namespace, key[: self.page_bytes]), child) is not child:
            raise ValueError("a child with that first page already exists")
        self._nodes[child.id] = child
        self.version += 1
        if self.marking:
            self.content_mark ^= content_mark(child, self.page_bytes)
        return child

    def remove_leaf(self, node: TreeNode) -> None:
        if node.children:
            raise ValueError(f"node {node.id} has children; only leaves leave the tree")
        parent = node.parent
        del parent.children[page_key(node.namespace, node.raw[: self.page_bytes])]
        if not parent.children:
            parent.children = NO_CHILDREN
        del self._nodes[node.id]
        self.version += 1
        if self.marking:
            self.content_mark ^= content_mark(node, self.page_bytes)

    def fork(self, copy_node: Callable[[TreeNode], TreeNode], memo: dict) -> "RadixTree":
        """An independent copy: ``copy_node`` copies one node's fields, links are re-made here.

        ``memo`` maps ``id(old node)`` to its copy (for callers that re-point
        their own references). Both trees go on numbering new nodes from the
        same id, so ids stay comparable between a tree and its fork.
        """
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        nxt = next(self._ids)
        self._ids = itertools.count(nxt)
        new._ids = itertools.count(nxt)
        nodes: dict[int, TreeNode] = {}
        pairs = []
        for nid, node in self._nodes.items():
            m = copy_node(node)
            memo[id(node)] = m
            nodes[nid] = m
            pairs.append((node, m))
        for node, m in pairs:
            if node.parent is not None:
                m.parent = memo[id(node.parent)]
            if node.children:
                m.children = {k: memo[id(c)] for k, c in node.children.items()}
        new._nodes = new.by_id = nodes
        new.root = memo[id(self.root)]
        memo[id(self)] = new
        return new

    def path_to_root(self, node: TreeNode) -> Iterator[TreeNode]:
        """``node`` and its ancestors, bottom-up, the root excluded."""
        while node.parent is not None:
            yield node
            node = node.parent

    def prefix_ids(self, node: TreeNode) -> TokenIds:
        """All token ids from the root down to and including ``node``, packed."""
        parts = [n.raw for n in self.path_to_root(node)]
        parts.reverse()
        return TokenIds(b"".join(parts))

    def prefix_tokens(self, node: TreeNode) -> tuple[int, ...]:
        """All tokens from the root down to and including ``node``, as ints."""
        return unpack_token_ids(self.prefix_ids(node).raw)
