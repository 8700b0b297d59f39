"""Pages a storage backend evicted on its own, traced to the tree nodes whose "stored" state they break.

A backend with a size cap (``memory://`` or ``file://`` with ``max_bytes``,
``keys://``) drops least recently used pages and reports their keys
(``StorageBackend.add_eviction_listener``), from its own thread. A node whose
state says its pages are in storage is then wrong about one of them: the
tier fires the residency trigger ``storage_lost`` on it (its spec entry
publishes ``removed:storage`` to KV event subscribers), and the node is backed
up again at the next sweep.

:class:`EvictionTracker` is both listeners: the backend's (it queues the keys,
nothing else, on the evicting thread) and the residency driver's, keeping a
map from page key to the node holding it in storage (states ``*_storing`` and
``*_stored``) as states change, nodes split and leave, so matching a report
costs O(evicted keys), not a scan of the tree. A key whose node is still
storing waits until the backup lands (an eviction and its backup's ack can
come in one poll). A key no node holds any more (its node left the tree while
its L3 copy stayed) moves nobody: no residency transition covers it.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from hicache_fsm.radix import TreeNode
    from hicache_fsm.storage.base import StorageBackend

STORED_SUFFIX, STORING_SUFFIX = "_stored", "_storing"


def _tracked(state: str) -> bool:
    return state.endswith(STORED_SUFFIX) or state.endswith(STORING_SUFFIX)


class EvictionTracker:
    """Evicted page keys reported by a backend, mapped to the nodes they were stored for (see module docstring)."""

    def __init__(self, keys_for: Callable[["TreeNode"], Sequence[str]]) -> None:
        self._keys_for = keys_for
        self._backend: StorageBackend | None = None
        self._reports: deque[list[str]] = deque()  # appended by the backend's threads
        self._listener = self._reports.append  # one bound method, so that it can be removed again
        self._by_key: dict[str, TreeNode] = {}
        self._keys_of: dict[int, Sequence[str]] = {}  # node id -> the keys it is indexed under
        self._waiting: set[str] = set()  # evicted keys of nodes whose backup has not landed yet
        self.reported = 0  # evicted keys reported by the backend
        self.unmatched = 0  # of those, keys no node in the tree held in storage

    @property
    def active(self) -> bool:
        return self._backend is not None

    def watch(self, backend: "StorageBackend", nodes: Iterable["TreeNode"]) -> None:
        """Listen to ``backend``'s evictions (if it reports any); ``nodes``: the tree now, to index."""
        self.unwatch()
        if not getattr(backend, "reports_evictions", False):
            return
        backend.add_eviction_listener(self._listener)
        self._backend = backend
        for node in nodes:
            if node.parent is not None and _tracked(node.state):
                self._index(node)

    def unwatch(self) -> None:
        """Stop listening and forget every key (the next backend's pages are not these)."""
        if self._backend is not None:
            self._backend.remove_eviction_listener(self._listener)
        self._backend = None
        self.cleared()

    def take_lost(self) -> list["TreeNode"]:
        """The stored nodes whose pages were evicted since the last call, each once."""
        if not self._reports and not self._waiting:
            return []
        keys = self._waiting
        while self._reports:
            batch = self._reports.popleft()
            self.reported += len(batch)
            keys.update(batch)
        lost: dict[int, TreeNode] = {}
        waiting: set[str] = set()
        for key in keys:
            node = self._by_key.get(key)
            if node is None:
                self.unmatched += 1
            elif node.state.endswith(STORED_SUFFIX):
                lost[node.id] = node
            else:
                waiting.add(key)
        self._waiting = waiting
        return list(lost.values())

    def fork(self, keys_for: Callable[["TreeNode"], Sequence[str]], backend: "StorageBackend | None",
             node_of: Callable[["TreeNode"], "TreeNode"]) -> "EvictionTracker":
        """A copy for a forked tier: listening to its ``backend``, over its tree (``node_of`` maps a node)."""
        new = EvictionTracker(keys_for)
        if self._backend is not None and backend is not None:
            backend.add_eviction_listener(new._listener)
            new._backend = backend
        new._reports.extend(list(batch) for batch in self._reports)
        new._by_key = {key: node_of(node) for key, node in self._by_key.items()}
        new._keys_of = dict(self._keys_of)
        new._waiting = set(self._waiting)
        new.reported, new.unmatched = self.reported, self.unmatched
        return new

    # ------------------------------------------------------------------ residency listener

    def state_changed(self, node: "TreeNode", old: str) -> None:
        if self._backend is None:
            return
        tracked = _tracked(node.state)
        if tracked != _tracked(old):
            if tracked:
                self._index(node)
            else:
                self._unindex(node)

    def split(self, node: "TreeNode", upper: "TreeNode") -> None:
        if self._backend is not None and node.id in self._keys_of:
            self._unindex(node)
            self._index(upper)
            self._index(node)

    def removed(self, node: "TreeNode", parent: "TreeNode") -> None:
        if self._backend is not None:
            self._unindex(node)

    def cleared(self) -> None:
        """The tree was cleared (ids start again): forget every node and the reports about them; keep listening."""
        self._reports.clear()
        self._by_key.clear()
        self._keys_of.clear()
        self._waiting.clear()

    def _index(self, node: "TreeNode") -> None:
        keys = self._keys_for(node)
        self._keys_of[node.id] = keys
        by_key = self._by_key
        for key in keys:
            by_key[key] = node

    def _unindex(self, node: "TreeNode") -> None:
        keys = self._keys_of.pop(node.id, ())
        by_key = self._by_key
        for key in keys:
            if by_key.get(key) is node:
                del by_key[key]
