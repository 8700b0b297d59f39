"""Nodes whose host copy is not in storage yet: the storage tier's backup retries, kept current.

A node is *unstored* when its state says it has a host copy that storage does
not hold and no backup of it is running (``UNSTORED``): its backup failed or
was skipped (storage down or detached), or the copy was made before storage
was attached. The tier's sweep fires ``store`` on such nodes again, a budget of
tokens at a time.

``BackupRetries`` is a residency listener: the driver reports every state
change, split and removal, so the set is never recomputed from the tree.
``ready`` holds the nodes that may be retried now, in the order they became
unstored; a node whose backup failed while storage answered backs off
(``back_off``: ``retry_interval`` doubling per failure, at most 60 s) in
``waiting``, with its due time in a heap. So does a node whose stored pages
the backend evicted for room (``evicted``): its delay doubles with each such
eviction and a successful store does not reset it, so that a store whose cap
is below what the host holds settles instead of evicting one node's pages to
store another's at every poll. A sweep costs O(k log N) for the k
nodes it starts or brings back from ``waiting``. ``violations`` compares the
maintained sets with a recomputation (an invariant the tests check).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable, Iterable

if TYPE_CHECKING:  # pragma: no cover
    from hicache_fsm.radix import RadixTree, TreeNode

# states with a host copy that is not (yet) in storage and no backup running
UNSTORED = frozenset({"device_host", "host", "loading"})
MAX_BACKOFF_S = 60.0


class BackupRetries:
    """Unstored nodes, ready or backing off (see the module docstring)."""

    def __init__(self) -> None:
        self.ready: OrderedDict[int, TreeNode] = OrderedDict()
        self.waiting: dict[int, TreeNode] = {}
        self._due: list[tuple[float, int]] = []  # (not before, node id) of waiting nodes; stale entries skipped
        self.failures: dict[int, tuple[float, int]] = {}  # node id -> (not before, failures so far)
        self.evictions: dict[int, int] = {}  # node id -> times the backend evicted its stored pages for room

    def __len__(self) -> int:
        return len(self.ready) + len(self.waiting)

    # ------------------------------------------------------------------ residency listener

    def state_changed(self, node: TreeNode, old: str) -> None:
        now_unstored = node.state in UNSTORED
        if now_unstored != (old in UNSTORED):
            if now_unstored:
                self.ready[node.id] = node
            else:
                self._leave(node.id)

    def split(self, node: TreeNode, upper: TreeNode) -> None:
        if upper.state in UNSTORED:  # a new node, no failures of its own yet
            self.ready[upper.id] = upper

    def removed(self, node: TreeNode, parent: TreeNode) -> None:
        self._leave(node.id)
        self.failures.pop(node.id, None)
        self.evictions.pop(node.id, None)

    def _leave(self, node_id: int) -> None:
        self.ready.pop(node_id, None)
        self.waiting.pop(node_id, None)

    # ------------------------------------------------------------------ outcomes of backups

    def stored(self, node_ids: Iterable[int]) -> None:
        """These nodes' backups landed: forget their failures."""
        for node_id in node_ids:
            self.failures.pop(node_id, None)

    def back_off(self, node_ids: Iterable[int], interval: float, now: float) -> None:
        """These nodes' backups failed while storage answered: each waits longer than the last time."""
        for node_id in node_ids:
            failures = self.failures.get(node_id, (0.0, 0))[1] + 1
            self.failures[node_id] = (now + _delay(interval, failures), failures)

    def evicted(self, node_ids: Iterable[int], interval: float, now: float) -> None:
        """The backend evicted these nodes' stored pages for room: each is stored again later than the last
        time it was evicted (kept across successful stores: a full store would evict another node for it)."""
        for node_id in node_ids:
            count = self.evictions.get(node_id, 0) + 1
            self.evictions[node_id] = count
            failures = self.failures.get(node_id, (0.0, 0))[1]
            self.failures[node_id] = (now + _delay(interval, count), failures)

    def forgive(self) -> None:
        """Storage answers again: every unstored node may be retried at once."""
        self.failures.clear()
        self._due.clear()
        self.ready.update(self.waiting)
        self.waiting.clear()

    def cleared(self) -> None:
        self.ready.clear()
        self.waiting.clear()
        self._due.clear()
        self.failures.clear()
        self.evictions.clear()

    # ------------------------------------------------------------------ the sweep

    def sweep(self, start: Callable[[TreeNode], bool], budget: int, now: float) -> tuple[int, bool]:
        """Start backups of ready nodes, oldest first, within ``budget`` tokens; (started, more to do later).

        ``start(node)`` fires ``store`` (the node leaves the set through the
        driver's report) or returns False when it cannot start now.
        """
        due, waiting, ready, failures = self._due, self.waiting, self.ready, self.failures
        while due and due[0][0] <= now:
            _, node_id = heapq.heappop(due)
            node = waiting.get(node_id)
            if node is None:
                continue  # left the set meanwhile
            not_before = failures.get(node_id, (0.0, 0))[0]
            if not_before <= now:
                del waiting[node_id]
                ready[node_id] = node
            else:  # failed again meanwhile: due later
                heapq.heappush(due, (not_before, node_id))
        started = 0
        more = False
        while ready:
            node_id, node = next(iter(ready.items()))
            not_before = failures.get(node_id, (0.0, 0))[0]
            if not_before > now:  # failed again since it became unstored: back off first
                del ready[node_id]
                waiting[node_id] = node
                heapq.heappush(due, (not_before, node_id))
                continue
            if node.num_tokens > budget or not start(node):
                more = True
                break
            ready.pop(node_id, None)  # the driver's report removed it already; a no-op then
            budget -= node.num_tokens
            started += 1
        return started, more or bool(waiting)

    # ------------------------------------------------------------------ invariant and forks

    def violations(self, tree: RadixTree) -> list[str]:
        """The maintained sets against a recomputation from the tree (O(N): for tests)."""
        want = {n.id for n in tree.nodes() if n.parent is not None and n.state in UNSTORED}
        have = set(self.ready) | set(self.waiting)
        problems = []
        if want != have or set(self.ready) & set(self.waiting):
            problems.append(f"unstored nodes {sorted(have)[:8]} != recomputed {sorted(want)[:8]} "
                            f"(missing {sorted(want - have)[:8]}, extra {sorted(have - want)[:8]})")
        for node_id, node in (*self.ready.items(), *self.waiting.items()):
            if tree.get(node_id) is not node:
                problems.append(f"unstored node {node_id} is not the tree's node of that id")
        due = {node_id for _, node_id in self._due}
        problems += [f"backing-off node {node_id} has no due time" for node_id in self.waiting if node_id not in due]
        return problems

    def fork(self, node_of: Callable[[TreeNode], TreeNode]) -> "BackupRetries":
        """A copy over a forked tree (``node_of`` maps a node to its copy), order and back-offs kept."""
        new = BackupRetries()
        new.ready = OrderedDict((k, node_of(n)) for k, n in self.ready.items())
        new.waiting = {k: node_of(n) for k, n in self.waiting.items()}
        new._due = list(self._due)
        new.failures = dict(self.failures)
        new.evictions = dict(self.evictions)
        return new


def _delay(interval: float, times: int) -> float:
    """``interval`` doubled per time after the first, at most ``MAX_BACKOFF_S``."""
    return min(interval * 2 ** min(times - 1, 16), MAX_BACKOFF_S)


__all__ = ["MAX_BACKOFF_S", "UNSTORED", "BackupRetries"]
