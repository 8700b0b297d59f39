"""Eviction: the candidate sets of both tiers, kept current, and the passes that take victims.

Theory of operation. A node is a *device candidate* when it is unlocked,
device-evictable (on the device and not in flight) and no child is on (or
coming to) the device; a *host candidate* when it is host-only and settled,
its host copy unpinned, and it has no children. These are the only nodes an
eviction pass may take, in the configured policy order (LRU, LFU, priority).

The sets are maintained, not recomputed: the residency driver reports every
state change, split, new child and removal, and lock / pin changes that cross
zero are reported by the facade, so a pass takes ``k`` victims in
O(k log N). Each node counts its children on the device
(``TreeNode.resident_children``) so a state change costs O(1), never a scan
of a wide parent's children. Each tier is a ``CandidateSet``: membership by
node id plus a binary heap with lazy deletion. Policy keys only grow (clock,
hit counts and priorities never go back), so a popped entry whose key is
stale is pushed again with the current key and the first current entry
popped is the true minimum. ``violations`` recomputes both sets from scratch
and compares: the invariant that keeps the maintained sets honest.

Under ``write_behind`` a third set, ``unbacked``, holds the device-only nodes
(state ``device``) ordered by last access, kept by the same hooks: each poll
backs up the coldest of them without a scan. A node's last access and its
last poll are stamped together from two counters that only grow, so in
last-access order the cold nodes (idle for ``write_behind_idle_steps`` polls)
come first, and the first node that is not cold ends the pass.
"""

from __future__ import annotations

import heapq
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable

from hicache_fsm.bindings.residency import EVICTED, LOADING, ON_DEVICE, ON_HOST
from hicache_fsm.errors import GuardRejected, LockError
from hicache_fsm.jobs import D2H
from hicache_fsm.radix import RadixTree, TreeNode

if TYPE_CHECKING:
    from hicache_fsm.config import CacheConfig
    from hicache_fsm.interfaces import Allocator, Attached, Driver, Jobs

DEVICE_EVICTABLE = frozenset({"device", "device_host", "device_host_storing", "device_host_stored"})
HOST_EVICTABLE = frozenset({"host", "host_stored"})
RESIDENT = ON_DEVICE | LOADING  # device slots valid now or once the load's layer event fires
REVIVABLE = EVICTED - LOADING


def lru_key(node: TreeNode) -> tuple:
    return (node.last_access, node.id)


def lfu_key(node: TreeNode) -> tuple:
    return (node.hit_count, node.last_access, node.id)


def priority_key(node: TreeNode) -> tuple:
    return (node.priority, node.last_access, node.id)


POLICY_KEYS: dict[str, Callable[[TreeNode], tuple]] = {"lru": lru_key, "lfu": lfu_key, "priority": priority_key}


def executor_can_block(executor: Any) -> bool:
    """Whether waiting on ``executor`` ends (a manual executor waits for a test)."""
    manual = getattr(executor, "manual", None)
    if manual is None:
        from hicache_fsm.executors import ManualExecutor

        manual = isinstance(executor, ManualExecutor)
    return not manual


PENDING_LIMIT = 64  # joiners a candidate set holds before it gives them heap entries


class CandidateSet:
    """Nodes one tier may evict now, popped in key order in O(log N) each.

    ``add`` / ``discard`` keep membership; ``pop`` returns the member with the
    smallest current key (it stays a member: the caller evicts it, or hands
    it back with ``restore`` when it skips it). Stale heap entries (left
    members, outdated keys) are skipped or re-pushed when popped, and the heap
    is rebuilt when they outnumber the members. An entry is one flat tuple,
    the key's fields then a push counter and the node (a nested key tuple
    would cost 64 bytes more a node).

    A node that joins (or is handed back) waits in ``_pending`` and enters the
    heap, with its key as it is then, when the next ``pop`` begins or when
    ``PENDING_LIMIT`` joiners wait (no call pays for more): a joiner that
    leaves before then needs no entry at all (a node inserted under
    ``write_through`` leaves the device set when its backup starts, in the
    same call), and a dict store costs a fraction of building an entry and
    sifting it into the heap.

    ``blocked`` (optional) excludes members lazily: a member for which it is
    true does not count (``len``, ``in``, ``ids``, ``nodes``) and is dropped
    when popped. The device set uses it for locks, so that a lock and its
    unlock need not leave and re-enter the set (the hot path of a request).
    """

    __slots__ = ("key", "blocked", "_members", "_heap", "_pending", "_seq")

    def __init__(self, key: Callable[[TreeNode], tuple], blocked: Callable[[TreeNode], bool] | None = None) -> None:
        self.key = key
        self.blocked = blocked
        self._members: dict[int, TreeNode] = {}
        self._heap: list[tuple] = []
        self._pending: dict[int, TreeNode] = {}  # joined since the last pop: no heap entry yet
        self._seq = 0

    def __len__(self) -> int:
        if self.blocked is None:
            return len(self._members)
        return len(self.nodes())

    def __contains__(self, node: TreeNode) -> bool:
        return self._members.get(node.id) is node and not (self.blocked is not None and self.blocked(node))

    @property
    def heap_size(self) -> int:
        """Heap entries and pending joiners, stale ones included (at most ``2 * len(self) + 64`` entries, plus
        fewer than ``PENDING_LIMIT`` joiners)."""
        return len(self._heap) + len(self._pending)

    def ids(self) -> set[int]:
        return {n.id for n in self.nodes()}

    def nodes(self) -> list[TreeNode]:
        blocked = self.blocked
        if blocked is None:
            return list(self._members.values())
        return [n for n in self._members.values() if not blocked(n)]

    def add(self, node: TreeNode) -> None:
        if self._members.get(node.id) is not node:
            self._members[node.id] = node
            self._join(node)

    def discard(self, node: TreeNode) -> None:
        if self._members.get(node.id) is node:
            del self._members[node.id]

    def restore(self, node: TreeNode) -> None:
        """Give back a popped node that was not evicted (it keeps its place in the order)."""
        if self._members.get(node.id) is node:
            self._join(node)

    def pop(self) -> TreeNode | None:
        """The member with the smallest key, or None when there is none."""
        if self._pending:
            self._enter_pending()
        members, key, blocked, heap = self._members, self.key, self.blocked, self._heap
        while heap:
            entry = heapq.heappop(heap)
            node = entry[-1]
            if members.get(node.id) is not node:
                continue  # left the set since it was pushed
            if blocked is not None and blocked(node):
                del members[node.id]  # blocked now: out until re-added (an unlock adds it back)
                continue
            if key(node) != entry[:-2]:  # its key grew: put it back where it belongs now (a pop takes one
                self._enter(node)  # entry for each it puts back: the heap does not grow)
                continue
            return node
        return None

    def clear(self) -> None:
        self._members.clear()
        self._heap.clear()
        self._pending.clear()

    def _join(self, node: TreeNode) -> None:
        """``node`` (a member) is due a heap entry: it waits for the next ``pop``, or for ``PENDING_LIMIT`` joiners."""
        pending = self._pending
        pending[node.id] = node
        if len(pending) >= PENDING_LIMIT:
            self._enter_pending()

    def _enter(self, node: TreeNode) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (*self.key(node), self._seq, node))

    def _enter_pending(self) -> None:
        """Give each pending node that is still a member its heap entry, keyed as it is now."""
        members = self._members
        for nid, node in self._pending.items():
            if members.get(nid) is node:
                self._enter(node)
        self._pending.clear()
        if len(self._heap) > 2 * len(members) + 64:  # stale entries outnumber the members: rebuild
            self._compact()

    def _compact(self) -> None:
        key = self.key
        self._heap = [(*key(n), i, n) for i, n in enumerate(self._members.values())]
        self._seq = len(self._heap)
        heapq.heapify(self._heap)
        self._pending.clear()

    def order_violations(self, name: str) -> list[str]:
        """Members neither pending nor with a heap entry at or below their current key (the lazy heap's invariant)."""
        best: dict[int, tuple] = {}
        for entry in self._heap:
            k, node = entry[:-2], entry[-1]
            if self._members.get(node.id) is node and (node.id not in best or k < best[node.id]):
                best[node.id] = k
        pending = self._pending
        return [f"{name} candidate {nid} has no heap entry at or below its key"
                for nid, node in self._members.items()
                if pending.get(nid) is not node and (nid not in best or best[nid] > self.key(node))]


def node_locked(node: TreeNode) -> bool:
    """Whether ``node`` is locked (the device set skips such members: see ``CandidateSet``)."""
    return node.lock_ref != 0


class Eviction:
    """Candidate sets of both tiers, eviction passes and backups.

    Interface: ``evict``, ``evict_host``, ``evict_node``, ``try_backup``,
    ``write_behind``; ``sort_key``; ``add_locks`` / ``add_pins`` (the only
    way refs change); hooks the driver calls when a node changes:
    ``state_changed``, ``child_added``, ``split``, ``removed``, ``refresh``;
    ``rebuild`` (after reset or a fork); ``is_device_candidate`` /
    ``is_host_candidate`` / ``is_unbacked`` (the from-scratch definitions)
    and ``violations`` (maintained sets == recomputation).

    Built with what it reads and moves: the config, the tree, the driver
    (every transition) and the outbox (backups waited for), the executor
    (waited on when it can block), the host allocator, the counters and the attached runtimes (a CP runtime backs up by itself).
    """

    def __init__(self, config: "CacheConfig", tree: RadixTree, driver: "Driver", outbox: "Jobs", executor: Any,
                 host_allocator: "Allocator", counters: Counter[str], attached: "Attached") -> None:
        self.config = config
        self.tree = tree
        self.driver = driver
        self.outbox = outbox
        self.executor = executor
        self.host_allocator = host_allocator
        self.counters = counters
        self.attached = attached
        self.sort_key = POLICY_KEYS[config.eviction_policy]
        self.device = CandidateSet(self.sort_key, lambda n: node_locked(n))  # a locked member is skipped, not removed
        self.host = CandidateSet(self.sort_key)
        # device-only nodes by last access, kept only where write_behind reads them
        self.unbacked = CandidateSet(lru_key) if config.write_policy == "write_behind" else None

    # ------------------------------------------------------------------ the definitions (from scratch)

    @staticmethod
    def is_device_candidate(node: TreeNode) -> bool:
        """Unlocked, device-evictable, and no child on (or coming to) the device."""
        if node.parent is None or node.state not in DEVICE_EVICTABLE or node.lock_ref != 0:
            return False
        return not any(c.state in RESIDENT for c in node.children.values())

    @staticmethod
    def is_host_candidate(node: TreeNode) -> bool:
        """Host-only and settled, host copy unpinned, and a leaf (a host-only inner node would orphan its subtree)."""
        return node.parent is not None and node.state in HOST_EVICTABLE and node.host_ref == 0 and not node.children

    @staticmethod
    def is_unbacked(node: TreeNode) -> bool:
        """Device-only: no host copy yet, none being made (write_behind backs these up once cold)."""
        return node.parent is not None and node.state == "device"

    # ------------------------------------------------------------------ maintenance hooks

    def refresh(self, node: TreeNode) -> None:
        """Re-decide ``node``'s membership in both sets from its fields (O(1))."""
        if node.parent is None:
            return
        state = node.state
        nid = node.id
        device, host = self.device, self.host
        members = device._members  # membership tested and kept inline (``add`` / ``discard``): most nodes are in neither set
        if state in DEVICE_EVICTABLE and node.lock_ref == 0 and node.resident_children == 0:
            if members.get(nid) is not node:
                members[nid] = node
                device._join(node)
        elif members.get(nid) is node:
            del members[nid]
        members = host._members
        if state in HOST_EVICTABLE and node.host_ref == 0 and not node.children:
            if members.get(nid) is not node:
                members[nid] = node
                host._join(node)
        elif members.get(nid) is node:
            del members[nid]
        unbacked = self.unbacked
        if unbacked is not None:
            if node.state == "device":
                unbacked.add(node)
            else:
                unbacked.discard(node)

    def state_changed(self, node: TreeNode, old: str) -> None:
        """The driver moved ``node`` out of state ``old``: its parent may gain or lose a device child."""
        now = node.state in RESIDENT
        if (old in RESIDENT) != now:
            parent = node.parent
            if parent is not None:
                count = parent.resident_children + (1 if now else -1)
                parent.resident_children = count
                if count == (1 if now else 0):  # none to one, or one to none: only then can its candidacy change
                    self.refresh(parent)
        self.refresh(node)

    def add_locks(self, nodes, delta: int) -> None:
        """Add ``delta`` to the lock refs of ``nodes`` (a chain); membership changes where a ref crosses zero."""
        for n in nodes:
            n.lock_ref += delta
            if n.lock_ref == 0 or n.lock_ref == delta:  # was or is now zero
                self.refresh(n)

    def lock_path(self, node: TreeNode) -> None:
        """Lock ``node`` and its ancestors (``HiCache.lock``); ``LockError``, nothing changed, if one is off the device.

        The device set keeps a node it holds when it is locked (``pop`` skips
        it), so a lock costs one increment a node.
        """
        n = node
        while n.parent is not None:
            if n.state not in RESIDENT:
                self._undo(node, n, -1)
                off = [m.id for m in self.tree.path_to_root(node) if m.state not in RESIDENT]
                raise LockError(f"cannot lock node {node.id}: nodes {off} are not on the device")
            n.lock_ref += 1
            n = n.parent
        if node.parent is not None:
            node.own_locks += 1

    def unlock_path(self, node: TreeNode) -> None:
        """Undo one ``lock_path`` of ``node``; ``LockError``, nothing changed, if ``node`` holds no lock of its own
        (its ``lock_ref`` may count a descendant's lock, which only that descendant's unlock releases) or a ref
        would go below zero."""
        if node.parent is None:
            return
        if node.own_locks <= 0:
            raise LockError(f"unlock of node {node.id}, which was not locked itself"
                            + (f" (its {node.lock_ref} lock ref(s) are its descendants' locks: unlock the node "
                               f"that was locked)" if node.lock_ref > 0 else ""))
        n = node
        device = self.device
        members = device._members
        while n.parent is not None:
            ref = n.lock_ref
            if ref <= 0:
                self._undo(node, n, 1)
                below = [m.id for m in self.tree.path_to_root(node) if m.lock_ref <= 0]
                raise LockError(f"unlock of node {node.id} would take lock refs below zero on nodes {below}")
            n.lock_ref = ref - 1
            if ref == 1 and n.resident_children == 0 and n.state in DEVICE_EVICTABLE and members.get(n.id) is not n:
                device.add(n)  # it left the set while locked (a pass popped it)
            n = n.parent
        node.own_locks -= 1

    @staticmethod
    def _undo(node: TreeNode, stop: TreeNode, delta: int) -> None:
        """Add ``delta`` to the lock refs from ``node`` up to ``stop`` (excluded): a refused lock or unlock."""
        while node is not stop:
            node.lock_ref += delta
            node = node.parent

    def add_pins(self, nodes, delta: int) -> None:
        """Add ``delta`` to the host pins of ``nodes``; membership changes where a pin crosses zero."""
        for n in nodes:
            n.host_ref += delta
            if n.host_ref == 0 or n.host_ref == delta:  # was or is now zero
                self.refresh(n)

    def child_added(self, node: TreeNode) -> None:
        """A new child (not on the device): only a parent that was a leaf can change sets (it leaves the host's)."""
        node.resident_children = 0
        parent = node.parent
        if len(parent.children) == 1:
            self.refresh(parent)

    def split(self, node: TreeNode, upper: TreeNode) -> None:
        """``upper`` took ``node``'s place under its parent, same state: only ``upper`` is new."""
        upper.resident_children = 1 if node.state in RESIDENT else 0
        self.refresh(upper)

    def removed(self, node: TreeNode, parent: TreeNode) -> None:
        self.device.discard(node)
        self.host.discard(node)
        if self.unbacked is not None:
            self.unbacked.discard(node)
        if node.state in RESIDENT:
            parent.resident_children -= 1
        self.refresh(parent)

    def rebuild(self) -> None:
        """Recompute both sets and the device-child counts from the tree (reset, forks)."""
        self.device.clear()
        self.host.clear()
        if self.unbacked is not None:
            self.unbacked.clear()
        nodes = list(self.tree.nodes())
        for n in nodes:
            n.resident_children = sum(1 for c in n.children.values() if c.state in RESIDENT)
        for n in nodes:
            self.refresh(n)

    def violations(self) -> list[str]:
        """The maintained sets and counts against a recomputation from scratch (an invariant)."""
        problems = []
        nodes = list(self.tree.nodes())
        for n in nodes:
            count = sum(1 for c in n.children.values() if c.state in RESIDENT)
            if n.resident_children != count:
                problems.append(f"node {n.id} counts {n.resident_children} children on the device, has {count}")
        sets = [("device", self.device, self.is_device_candidate), ("host", self.host, self.is_host_candidate)]
        if self.unbacked is not None:
            sets.append(("unbacked", self.unbacked, self.is_unbacked))
        for name, cset, pred in sets:
            want = {n.id for n in nodes if pred(n)}
            have = cset.ids()
            if want != have:
                problems.append(f"{name} nodes {sorted(have)[:8]} != recomputed {sorted(want)[:8]} "
                                f"(missing {sorted(want - have)[:8]}, extra {sorted(have - want)[:8]})")
            problems += cset.order_violations(name)
        return problems

    # ------------------------------------------------------------------ backups

    def back_up_hot(self, path: list[TreeNode], threshold: int) -> None:
        """Back up the matched nodes of ``path`` that reached ``threshold`` hits (``write_through_selective``).

        A backup may evict host KV to make room; the host copies of the match
        being returned are pinned meanwhile so it cannot evict its own result.
        """
        due = [n for n in path if n.state == "device" and n.hit_count >= threshold]
        if not due:
            return
        pinned = [n for n in path if n.state in ON_HOST]
        self.add_pins(pinned, 1)
        try:
            for node in due:
                self.try_backup(node)
        finally:
            self.add_pins(pinned, -1)

    def try_backup(self, node: TreeNode) -> bool:
        """Back a device-only node up to host, evicting host KV for room; False if the host stays full."""
        cp = self.attached.cp
        if cp is not None:  # CP: owned pages only, copied layer by layer (hicache_fsm.layer_write)
            return cp.backup(node)
        host = self.host_allocator
        if host.available_tokens < node.num_tokens:
            self.evict_host(node.num_tokens - host.available_tokens)
        try:
            self.driver.fire(node, "backup")
        except GuardRejected:  # host still full after host eviction
            self.counters["backup_host_full"] += 1
            return False
        return True

    def write_behind(self) -> None:
        """``write_behind``: back up device-only nodes that went cold, coldest first, within the batch budget.

        Pops ``unbacked`` in last-access order (O(log N) a node): the first
        node still warm, over the remaining budget, or whose backup cannot
        start (host full even after host eviction) ends the pass. The first
        node of a pass goes even when it is larger than the whole budget:
        otherwise a node bigger than ``write_behind_batch_tokens`` would never
        be backed up.
        """
        unbacked = self.unbacked
        if unbacked is None:
            return
        idle = self.config.write_behind_idle_steps
        batch = budget = self.config.write_behind_batch_tokens
        polls = self.driver.polls
        counters = self.counters
        while True:
            node = unbacked.pop()
            if node is None:
                return
            over_budget = node.num_tokens > budget and budget < batch  # the pass's first node goes whatever its size
            if polls - node.last_poll < idle or over_budget or not self.try_backup(node):
                unbacked.restore(node)  # warm, too big, or the host stays full: next poll
                return
            budget -= node.num_tokens
            counters["write_behind_tokens"] += node.num_tokens

    # ------------------------------------------------------------------ device eviction

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device tokens if possible (see ``HiCache.evict``); returns tokens freed."""
        tried: set[int] = set()
        freed, _ = self.device_pass(num_tokens, tried)
        outbox = self.outbox
        executor = self.executor
        while freed < num_tokens and executor_can_block(executor) and outbox.has_pending(D2H):
            outbox.flush()
            executor.synchronize()
            outbox.defer(outbox.apply_agreed(list(executor.poll()))[1])  # failures: reported by the next poll
            more, started = self.device_pass(num_tokens - freed, tried)
            freed += more
            if not more and not started:
                break
        return freed

    def device_pass(self, num_tokens: int, tried: set[int]) -> tuple[int, int]:
        """Take device candidates in policy order until ``num_tokens`` are freed; (freed, backups started).

        A device-only candidate under write_back / write_behind (or with
        host-only children) is backed up instead, once per ``tried``; it is
        evicted by a later pass once the copy lands. When ``evict`` waits for
        that copy (an executor that can block), its tokens count toward
        ``num_tokens`` meanwhile (as the reference's write_back evict does), so
        candidates later in policy order are not evicted in its place; when it
        cannot wait, what can go at once goes now.
        """
        driver = self.driver
        counters = self.counters
        candidates = self.device
        freed = started = backing_up = 0
        waits = executor_can_block(self.executor)  # ``evict`` then evicts the backed-up candidates next pass
        keep_unbacked = self.config.keeps_unbacked
        skipped: list[TreeNode] = []
        try:
            while freed + backing_up < num_tokens:
                node = candidates.pop()
                if node is None:
                    break
                if node.state == "device":
                    if keep_unbacked or node.children:
                        skipped.append(node)
                        if node.id in tried:
                            continue
                        tried.add(node.id)
                        if self.try_backup(node):
                            started += 1
                            if waits:
                                backing_up += node.num_tokens
                            continue
                        if node.children:
                            continue  # dropping it would orphan its host-only children
                        skipped.pop()
                        counters["dropped_unbacked_tokens"] += node.num_tokens
                    freed += node.num_tokens
                    driver.fire(node, "drop")
                    driver.remove(node)
                else:
                    freed += node.num_tokens
                    driver.fire(node, "evict_device")
                counters["evicted_device_tokens"] += node.num_tokens
        finally:
            for node in skipped:
                candidates.restore(node)
        return freed, started

    def evict_node(self, node: TreeNode) -> int:
        """Take one live node's KV off the device now (see ``HiCache.evict_node``); returns tokens freed."""
        driver = self.driver
        if node.lock_ref:
            raise LockError(f"node {node.id} is locked ({node.lock_ref} lock(s)); unlock it before evicting")
        if node.state not in DEVICE_EVICTABLE:
            raise GuardRejected("residency", node.state, "evict_device", f"node {node.id} is not evictable now")
        resident = [c.id for c in node.children.values() if c.state in RESIDENT]
        if resident:
            raise GuardRejected("residency", node.state, "evict_device", f"node {node.id} has children {resident} on the device")
        if node.state == "device":
            if node.children:
                raise GuardRejected("residency", node.state, "drop", f"node {node.id} has host-only children; back it up first")
            if self.config.keeps_unbacked:
                raise GuardRejected("residency", node.state, "drop", f"node {node.id} is not backed up under "
                                    f"{self.config.write_policy}; back it up first")
            driver.fire(node, "drop")
            driver.remove(node)
        else:
            driver.fire(node, "evict_device")
        self.counters["evicted_device_tokens"] += node.num_tokens
        return node.num_tokens

    # ------------------------------------------------------------------ host eviction

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host tokens of host candidates, in policy order; returns tokens freed."""
        driver = self.driver
        candidates = self.host
        freed = 0
        while freed < num_tokens:
            node = candidates.pop()
            if node is None:
                break
            freed += node.num_tokens
            driver.fire(node, "evict_host")
            driver.remove(node)
        self.counters["evicted_host_tokens"] += freed
        return freed
