"""Same-run baselines for ``bench scale``: the same prefix-cache work done two other ways.

``PlainPrefixCache`` is the plainest correct way: a dict keyed by
``(parent entry id, page of token ids as a tuple)``, one entry per page, LRU
eviction by sorting every unlocked leaf. ``RadixLikeSGLang`` re-implements
the per-operation loop of SGLang's ``RadixCache``
(python/sglang/srt/mem_cache/radix_cache.py, Apache-2.0, by the SGLang team):
a node per run of pages with a ``children`` dict keyed by the first page as a
tuple, page-by-page key comparison, a split on a partial match, ``lock_ref``
walked up to the root, and eviction that collects every leaf, heapifies them
by last access and frees leaves until enough tokens are free. It is a minimal
re-implementation written for this benchmark (no copy of their code): slot
tensors, a monotonic clock per access and the same data shapes, without the
hierarchical, storage and metrics paths. Neither baseline checks token ids.

Both take token ids as a list (what an engine holds) and hand back a device
index tensor, as the cache does.
"""

from __future__ import annotations

import heapq
import itertools
import time

import torch

_EMPTY = torch.empty(0, dtype=torch.int64)


class _Page:
    __slots__ = ("id", "parent", "indices", "last_access", "lock_ref", "children")

    def __init__(self, entry_id: int, parent: "_Page | None", indices: torch.Tensor | None) -> None:
        self.id, self.parent, self.indices = entry_id, parent, indices
        self.last_access, self.lock_ref, self.children = 0, 0, 0


class PlainPrefixCache:
    """A dict of page tuples: ``{(parent id, page tuple): _Page}``; the plainest prefix cache."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.pages: dict[tuple, _Page] = {}
        self.root = _Page(0, None, None)
        self._ids = itertools.count(1)
        self.clock = 0

    def _walk(self, tokens: list) -> list[_Page]:
        ps, pages, path, parent = self.page_size, self.pages, [], self.root
        for start in range(0, len(tokens) - len(tokens) % ps, ps):
            page = pages.get((parent.id, tuple(tokens[start : start + ps])))
            if page is None:
                break
            path.append(page)
            parent = page
        return path

    def match_prefix(self, tokens: list) -> tuple[torch.Tensor, _Page]:
        self.clock += 1
        path = self._walk(tokens)
        for page in path:
            page.last_access = self.clock
        if not path:
            return _EMPTY, self.root
        return torch.cat([p.indices for p in path]), path[-1]

    def insert(self, tokens: list, indices: torch.Tensor) -> _Page:
        self.clock += 1
        ps = self.page_size
        path = self._walk(tokens)
        parent = path[-1] if path else self.root
        for page in path:
            page.last_access = self.clock
        for start in range(len(path) * ps, len(tokens) - len(tokens) % ps, ps):
            page = _Page(next(self._ids), parent, indices[start : start + ps])
            page.last_access = self.clock
            self.pages[(parent.id, tuple(tokens[start : start + ps]))] = page
            parent.children += 1
            parent = page
        return parent

    def lock(self, page: _Page, delta: int) -> None:
        while page is not self.root:
            page.lock_ref += delta
            page = page.parent

    def evict(self, num_tokens: int) -> int:
        """Free the least recently used unlocked leaves until ``num_tokens`` are freed (scans every page)."""
        by_key = {id(p): k for k, p in self.pages.items()}
        leaves = [(p.last_access, p.id, p) for p in self.pages.values() if not p.children and not p.lock_ref]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            _, _, page = heapq.heappop(leaves)
            del self.pages[by_key[id(page)]]
            freed += self.page_size
            parent = page.parent
            parent.children -= 1
            if parent is not self.root and not parent.children and not parent.lock_ref:
                heapq.heappush(leaves, (parent.last_access, parent.id, parent))
        return freed


class _RadixNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access_time", "hit_count", "id")

    _ids = itertools.count()

    def __init__(self) -> None:
        self.children: dict[tuple, _RadixNode] = {}
        self.parent: _RadixNode | None = None
        self.key: list = []
        self.value: torch.Tensor | None = None
        self.lock_ref = 0
        self.last_access_time = time.monotonic()
        self.hit_count = 0
        self.id = next(self._ids)

    def __lt__(self, other: "_RadixNode") -> bool:
        return self.last_access_time < other.last_access_time


class RadixLikeSGLang:
    """SGLang ``RadixCache``'s match / insert / lock / evict loop (see the module docstring)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.root = _RadixNode()
        self.root.lock_ref = 1
        self.evictable_size = 0
        self.protected_size = 0

    def _child_key(self, key: list) -> tuple:
        return tuple(key[: self.page_size])

    def _key_match(self, key0: list, key1: list) -> int:
        ps, i = self.page_size, 0
        limit = min(len(key0), len(key1))
        while i < limit and key0[i : i + ps] == key1[i : i + ps]:
            i += ps
        return i

    def match_prefix(self, key: list) -> tuple[torch.Tensor, _RadixNode]:
        key = key[: len(key) // self.page_size * self.page_size]
        value: list[torch.Tensor] = []
        node = self.root
        now = time.monotonic()
        node.last_access_time = now
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access_time = now
            prefix_len = self._key_match(child.key, key)
            if prefix_len < len(child.key):
                new_node = self._split(child, prefix_len)
                value.append(new_node.value)
                node = new_node
                break
            value.append(child.value)
            node = child
            key = key[prefix_len:]
        indices = torch.cat(value) if value else torch.empty((0,), dtype=torch.int64)
        return indices, node

    def _split(self, child: _RadixNode, at: int) -> _RadixNode:
        new = _RadixNode()
        new.children = {self._child_key(child.key[at:]): child}
        new.parent = child.parent
        new.lock_ref = child.lock_ref
        new.key = child.key[:at]
        new.value = child.value[:at]
        child.parent = new
        child.key = child.key[at:]
        child.value = child.value[at:]
        new.parent.children[self._child_key(new.key)] = new
        return new

    def insert(self, key: list, value: torch.Tensor) -> int:
        key = key[: len(key) // self.page_size * self.page_size]
        node = self.root
        now = time.monotonic()
        node.last_access_time = now
        total = 0
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            node = child
            node.last_access_time = now
            prefix_len = self._key_match(node.key, key)
            total += prefix_len
            key = key[prefix_len:]
            value = value[prefix_len:]
            if prefix_len < len(node.key):
                node = self._split(node, prefix_len)
        if key:
            new = _RadixNode()
            new.parent = node
            new.key = key
            new.value = value.clone()
            node.children[self._child_key(key)] = new
            self.evictable_size += len(key)
        return total

    def inc_lock_ref(self, node: _RadixNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: _RadixNode) -> None:
        while node is not self.root:
            if node.lock_ref == 1:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node.lock_ref -= 1
            node = node.parent

    def _collect_leaves(self) -> list[_RadixNode]:
        leaves, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if not node.children:
                leaves.append(node)
            else:
                stack.extend(node.children.values())
        return leaves

    def evict(self, num_tokens: int) -> int:
        leaves = self._collect_leaves()
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            node = heapq.heappop(leaves)
            if node is self.root or node.lock_ref > 0:
                continue
            freed += len(node.value)
            del node.parent.children[self._child_key(node.key)]
            self.evictable_size -= len(node.key)
            if not node.parent.children and node.parent.lock_ref == 0:
                heapq.heappush(leaves, node.parent)
        return freed
