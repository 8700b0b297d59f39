"""A page-aligned radix tree of token prefixes.

Each node owns a run of whole pages: its token ids (``key``), and, depending on
its residency state, device and host slot indices for them. The tree only
knows shape; where the KV lives is the residency machine's business, driven by
``HiCache``. Entries carry an optional namespace (LoRA id, cache salt, tenant)
so that two namespaces never match each other's prefixes.
"""

from __future__ import annotations

import itertools
from typing import Callable, Hashable, Iterator

import torch

ROOT_STATE = "root"


class TreeNode:
    """One run of pages in the tree.

    ``lock_ref`` counts locks on this node or any descendant (a lock pins the
    whole path to the root on the device); ``host_ref`` pins this node's host
    copy only (prefetch anchors). ``pending_jobs`` holds ids of in-flight jobs
    that cover this node, so a node split mid-transfer can enrol its new half
    in the same jobs. ``resident_children`` is maintained by the cache
    (``hicache_fsm.eviction``) so that eviction never scans children.
    """

    __slots__ = (
        "id",
        "parent",
        "children",
        "_key",
        "_key_source",
        "_key_start",
        "namespace",
        "state",
        "device_indices",
        "host_indices",
        "lock_ref",
        "host_ref",
        "hit_count",
        "last_access",
        "priority",
        "storage_keys",
        "pending_jobs",
        "cp_meta",
        "last_poll",
        "page_memo",
        "resident_children",
    )

    def __init__(self, node_id: int, key: tuple[int, ...], namespace: Hashable, parent: "TreeNode | None",
                 key_start: int = 0) -> None:
        self.id = node_id
        self.parent = parent
        self.children: dict[tuple, TreeNode] = {}
        # The key is ``key[key_start:]``, sliced when first read: slicing a
        # request's tokens costs more than the rest of an insert, and the
        # unique tail of most requests is never walked again. Until then the
        # node keeps the whole (immutable) request tuple alive.
        if key_start:
            self._key, self._key_source, self._key_start = None, key, key_start
        else:
            self._key, self._key_source, self._key_start = key, None, 0
        self.namespace = namespace
        self.state = ROOT_STATE if parent is None else "absent"
        self.device_indices: torch.Tensor | None = None
        self.host_indices: torch.Tensor | None = None
        self.lock_ref = 0
        self.host_ref = 0
        self.hit_count = 0
        self.last_access = 0
        self.priority = 0
        self.storage_keys: tuple[str, ...] | None = None
        self.pending_jobs: set[int] = set()
        self.cp_meta: object | None = None
        self.last_poll = 0  # the cache's poll count at the last access (write_behind coldness)
        self.page_memo: tuple | None = None  # (device_indices tensor, its page ids): valid while that tensor is current
        self.resident_children = 0  # children on (or coming to) the device; kept by the cache's eviction part

    @property
    def key(self) -> tuple[int, ...]:
        """The node's token ids (a tuple of whole pages)."""
        key = self._key
        if key is None:
            key = self._key = self._key_source[self._key_start :]
            self._key_source = None
        return key

    @key.setter
    def key(self, value: tuple[int, ...]) -> None:
        self._key, self._key_source, self._key_start = value, None, 0

    @property
    def num_tokens(self) -> int:
        key = self._key
        return len(key) if key is not None else len(self._key_source) - self._key_start

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, tokens={self.num_tokens}, state={self.state})"


class RadixTree:
    """Prefix match, insert and split over page-aligned token runs."""

    def __init__(self, page_size: int) -> None:
        if page_size <= 0:
            raise ValueError("page_size must be positive")
        self.page_size = page_size
        self._ids = itertools.count(1)
        self.root = TreeNode(0, (), None, None)
        self._nodes: dict[int, TreeNode] = {0: self.root}
        self.version = 0  # bumped by every change of shape (split, add, remove)

    def clear(self) -> None:
        """Drop every node, in place: the parts holding this tree see it empty (a cache ``reset``).

        Ids start again from 1 as in a new tree; ``version`` keeps growing, so
        no walk remembered before the clear is taken for one after it.
        """
        self._ids = itertools.count(1)
        self.root = TreeNode(0, (), None, None)
        self._nodes = {0: self.root}
        self.version += 1

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

    def child_key(self, namespace: Hashable, tokens: tuple[int, ...], start: int) -> tuple:
        """The key of the child holding ``tokens[start:]`` in its parent's ``children`` (namespace, first page)."""
        return (namespace, tokens[start : start + self.page_size])

    def aligned(self, tokens: tuple[int, ...]) -> tuple[int, ...]:
        return tokens[: len(tokens) - len(tokens) % self.page_size]

    def walk(self, tokens: tuple[int, ...], namespace: Hashable = None) -> tuple[list[TreeNode], int, int]:
        """Follow ``tokens`` down the tree without changing it.

        Returns the fully matched nodes (top-down), the matched token count, and
        how many tokens of the next node also match (0 when none, else a page
        multiple shorter than that node: the caller splits it to use them).
        """
        tokens = self.aligned(tokens)
        path: list[TreeNode] = []
        node, pos, ps = self.root, 0, self.page_size
        n = len(tokens)
        while pos < n:
            child = node.children.get((namespace, tokens[pos : pos + ps]))
            if child is None:
                break
            key = child.key
            end = pos + len(key)
            if end <= n and tokens[pos:end] == key:  # fast path: the whole node matches
                path.append(child)
                node = child
                pos = end
                continue
            shared = ps
            limit = min(len(key), len(tokens) - pos)
            while shared < limit and key[shared : shared + ps] == tokens[pos + shared : pos + shared + ps]:
                shared += ps
            if shared < len(key):
                return path, pos, shared
            path.append(child)
            node = child
            pos += shared
        return path, pos, 0

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
        upper = TreeNode(next(self._ids), node.key[:at], node.namespace, parent)
        upper.state = node.state
        upper.lock_ref = node.lock_ref
        upper.hit_count, upper.last_access, upper.priority = node.hit_count, node.last_access, node.priority
        upper.last_poll = node.last_poll
        upper.pending_jobs = set(node.pending_jobs)
        if node.device_indices is not None:
            upper.device_indices, node.device_indices = node.device_indices[:at], node.device_indices[at:]
        if node.host_indices is not None:
            upper.host_indices, node.host_indices = node.host_indices[:at], node.host_indices[at:]
        if node.storage_keys is not None:
            pages = at // self.page_size
            upper.storage_keys, node.storage_keys = node.storage_keys[:pages], node.storage_keys[pages:]
        parent.children[self.child_key(node.namespace, node.key, 0)] = upper
        node.key = node.key[at:]
        node.parent = upper
        upper.children[self.child_key(node.namespace, node.key, 0)] = node
        self._nodes[upper.id] = upper
        self.version += 1
        return upper

    def add_child(self, parent: TreeNode, tokens: tuple[int, ...], namespace: Hashable, start: int = 0) -> TreeNode:
        """Attach a new node (state ``absent``) holding ``tokens[start:]`` under ``parent``.

        Pass the request's whole token tuple and where the new part starts,
        rather than a slice: the node slices it only if it is ever read.
        """
        length = len(tokens) - start
        if start < 0 or length <= 0 or length % self.page_size:
            raise ValueError("a node holds a positive whole number of pages")
        child = TreeNode(next(self._ids), tokens, namespace, parent, start)
        # one hash of the first page, not two (a lookup, then a store)
        if parent.children.setdefault(self.child_key(namespace, tokens, start), child) is not child:
            raise ValueError("a child with that first page already exists")
        self._nodes[child.id] = child
        self.version += 1
        return child

    def remove_leaf(self, node: TreeNode) -> None:
        if node.children:
            raise ValueError(f"node {node.id} has children; only leaves leave the tree")
        del node.parent.children[self.child_key(node.namespace, node.key, 0)]
        del self._nodes[node.id]
        self.version += 1

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
            m.children = {k: memo[id(c)] for k, c in node.children.items()}
        new._nodes = nodes
        new.root = memo[id(self.root)]
        memo[id(self)] = new
        return new

    def path_to_root(self, node: TreeNode) -> Iterator[TreeNode]:
        """``node`` and its ancestors, bottom-up, the root excluded."""
        while node.parent is not None:
            yield node
            node = node.parent

    def prefix_tokens(self, node: TreeNode) -> tuple[int, ...]:
        """All tokens from the root down to and including ``node``."""
        parts = [n.key for n in self.path_to_root(node)]
        parts.reverse()
        return tuple(itertools.chain.from_iterable(parts))  # in C: a prefetch checks a 10k-token prefix
