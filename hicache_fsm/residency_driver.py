"""The residency driver: the one place that moves nodes through the residency machine.

Every residency transition goes through ``ResidencyDriver.fire``: it fires the
trigger on the compiled machine, builds the jobs the transition emits and
hands them to the outbox, tells eviction that a node's state changed (so the
candidate sets stay current), keeps the number of nodes in each state
(``state_counts``, what metrics export without walking the tree), and reports
the transition to observers. The
driver also owns what changes the tree's shape (``add_child``, ``split``,
``remove``), the cache's logical clock (``tick``, ``touch``) and the walk
memo that lets ``insert`` reuse ``match_prefix``'s walk.

Listeners. Eviction keeps its candidate sets current from the driver's
reports; a runtime that keeps its own set of nodes by state (the storage
tier's backups awaiting a retry) registers a ``ResidencyListener`` with
``add_listener`` and hears the same reports: a state change, a split
(the new upper half starts in its lower half's state), a removal, and the
clearing of the whole tree (a cache ``reset``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Hashable, Protocol

from hicache_fsm.errors import BadIndices, UnknownNode
from hicache_fsm.jobs import H2S, JobKind, PageSlots, TransferJob
from hicache_fsm.radix import RadixTree, TreeNode

if TYPE_CHECKING:
    import torch

    from hicache_fsm.interfaces import Attached, Jobs, StructureHooks
    from hicache_fsm.machine import CompiledMachine, CompiledTransition
    from hicache_fsm.tokens import TokenIds


def _slots(slots: "bytes | torch.Tensor | None", allocator: object) -> "PageSlots | torch.Tensor | None":
    """A node's compact slots as a job carries them: page ids stay page ids (expanded if an executor reads them)."""
    return PageSlots(slots, allocator) if type(slots) is bytes else slots


class ResidencyListener(Protocol):
    """What a runtime keeping its own per-state set of nodes hears from the driver (O(1) each)."""

    def state_changed(self, node: TreeNode, old: str) -> None: ...

    def split(self, node: TreeNode, upper: TreeNode) -> None: ...

    def removed(self, node: TreeNode, parent: TreeNode) -> None: ...

    def cleared(self) -> None: ...  # every node dropped at once (``HiCache.reset``); ids start again from 1


class ResidencyDriver:
    """Fires residency triggers and keeps the tree's shape, the clock and observers.

    Interface: ``fire``, ``can_fire``, ``build_job``; ``add_child``,
    ``split``, ``remove``, ``walk``, ``walk_splitting``, ``require_node``;
    ``tick``, ``touch``, ``count_poll``, ``clock``, ``polls``;
    ``add_observer``, ``remove_observer``, ``notify``, ``observed``;
    ``state_counts`` (tree nodes per residency state, kept as they change);
    ``add_listener``, ``remove_listener`` (``ResidencyListener``).

    Built with the tree, the machine, the attached runtimes (a CP runtime
    splits its slots, the storage tier names H2S keys) and whether draft
    pools exist; ``connect`` then gives it the parts built after it: who
    hears of structure changes (eviction), where jobs go (the outbox) and the
    context guards and effects see by default.
    """

    def __init__(self, tree: "RadixTree", machine: "CompiledMachine", attached: "Attached", draft: bool) -> None:
        self.tree = tree
        self.machine = machine
        self.attached = attached
        self.draft = draft
        self.hooks: StructureHooks | None = None
        self.jobs: Jobs | None = None
        self.ctx: object = None
        self.clock = 0
        self.polls = 0
        self._memo: tuple | None = None  # the last tree walk (see walk)
        self._observers: list[Callable[[dict], None]] = []
        self._listeners: list[ResidencyListener] = []
        # every state present from the start: a reader on another thread (a metrics
        # scrape) copies this dict while the engine updates it, and its size never changes
        self.state_counts: dict[str, int] = dict.fromkeys(machine.spec.state_names, 0)

    def connect(self, hooks: "StructureHooks", jobs: "Jobs", ctx: object) -> None:
        """Wire the parts built after the driver: eviction's hooks, the outbox, the bindings' context."""
        self.hooks, self.jobs, self.ctx = hooks, jobs, ctx

    def cleared(self) -> None:
        """The tree was cleared (``HiCache.reset``): count afresh, forget the walk, tell every listener.

        Node ids start again from 1 after a clear, so a listener keeping
        anything by node id must drop it here, or a new node would inherit an
        old one's entry.
        """
        counts = dict.fromkeys(self.state_counts, 0)
        for node in self.tree.nodes():
            if not node.is_root:
                counts[node.state] += 1
        self.state_counts.update(counts)
        self._memo = None
        for listener in self._listeners:
            listener.cleared()

    # ------------------------------------------------------------------ clock

    def tick(self) -> int:
        """Advance the logical clock (recency of matches and inserts); returns the new time."""
        self.clock += 1
        return self.clock

    def touch(self, node: TreeNode, now: int | None = None) -> None:
        """Mark ``node`` used now: its recency and its poll count (write_behind coldness)."""
        node.last_access = self.tick() if now is None else now
        node.last_poll = self.polls

    def count_poll(self) -> int:
        self.polls += 1
        return self.polls

    # ------------------------------------------------------------------ observers

    @property
    def observed(self) -> bool:
        return bool(self._observers)

    def add_observer(self, fn: Callable[[dict], None]) -> None:
        if not callable(fn):  # refused here: the first event would raise it mid-transition
            raise TypeError(f"an observer is called with each event dict; got {type(fn).__name__}: {fn!r}")
        self._observers.append(fn)

    def remove_observer(self, fn: Callable[[dict], None]) -> None:
        self._observers.remove(fn)

    def notify(self, event: dict) -> None:
        for fn in self._observers:
            fn(event)

    # ------------------------------------------------------------------ listeners

    def add_listener(self, listener: ResidencyListener) -> None:
        """Report every state change, split and removal to ``listener`` (after eviction's own bookkeeping)."""
        self._listeners.append(listener)

    def remove_listener(self, listener: ResidencyListener) -> None:
        """Stop reporting to ``listener``; ``ValueError`` if it was not added."""
        self._listeners.remove(listener)

    def listening(self, listener: ResidencyListener) -> bool:
        """Whether ``listener`` was added and not removed since."""
        return any(added is listener for added in self._listeners)

    # ------------------------------------------------------------------ transitions

    def fire(self, node: TreeNode, trigger: str, ctx: object = None, emit: bool = True) -> "CompiledTransition":
        """Fire ``trigger`` on ``node`` (guards and effects see ``ctx``, the bindings' context by default).

        Emits the transition's jobs unless ``emit`` is False (a caller that
        builds one job for several nodes, such as a load-back). Raises
        ``InvalidTransition`` / ``GuardRejected`` with nothing changed. A job
        that cannot be built (an H2S job's storage keys) puts the node back
        in its old state and raises: a node never waits for a job that does
        not exist. Only effect-free transitions can fail so (the jobs of the
        others read the slots their effects just set).
        """
        old = node.state
        transition = self.machine.fire(node, trigger, self.ctx if ctx is None else ctx)
        if node.state != old:
            self._moved(node, old)
        if emit:
            emits = transition.emits
            if emits:
                try:
                    jobs = [self.build_job(kind, node) for kind in emits] if len(emits) > 1 else (
                        self.build_job(emits[0], node),)
                except Exception:
                    if getattr(transition, "effects", None) == ():  # None: a dispatcher that keeps its own state
                        node.state = old
                        self._moved(node, transition.dest)
                    raise
                emit_job = self.jobs.emit
                for job in jobs:
                    emit_job(job, [node])
        if self._observers:
            self.notify({"event": "transition", "machine": "residency", "node": node.id, "trigger": trigger,
                         "source": transition.source, "dest": transition.dest})
        return transition

    def _moved(self, node: TreeNode, old: str) -> None:
        """``node`` left state ``old``: the per-state counts and eviction's candidate sets follow."""
        counts = self.state_counts
        counts[old] -= 1
        counts[node.state] += 1
        self.hooks.state_changed(node, old)
        listeners = self._listeners
        if listeners:
            for listener in listeners:
                listener.state_changed(node, old)

    def can_fire(self, node: TreeNode, trigger: str) -> bool:
        return self.machine.can_fire(node, trigger, self.ctx)

    def build_job(self, kind: JobKind, node: TreeNode) -> TransferJob:
        """The job a transition of ``node`` emits: its slots (as page ids), or its storage keys for H2S."""
        ctx = self.ctx
        host = _slots(node.host_slots, ctx.host_allocator)
        if kind is H2S:
            return TransferJob(kind, (node.id,), host, keys=self.attached.storage.keys_for(node))
        return TransferJob(kind, (node.id,), host, _slots(node.device_slots, ctx.device_allocator),
                           draft_host_indices=host if self.draft else None)

    # ------------------------------------------------------------------ tree shape

    def require_node(self, node: object) -> TreeNode:
        """``node`` if it is a live non-root node of this cache, else ``UnknownNode``."""
        if not isinstance(node, TreeNode) or node.is_root or not self.tree.owns(node):
            raise UnknownNode(f"{node!r} is not a live node of this cache (removed, split off, or from another cache)")
        return node

    def add_child(self, parent: TreeNode, tokens: tuple, namespace: Hashable, start: int) -> TreeNode:
        """A new node (state ``absent``) for ``tokens[start:]`` under ``parent``; fire its first trigger next."""
        node = self.tree.add_child(parent, tokens, namespace, start)
        self.state_counts[node.state] += 1
        self.hooks.child_added(node)
        return node

    def split(self, node: TreeNode, at: int) -> TreeNode:
        """Split ``node`` after ``at`` tokens (see ``RadixTree.split``); in-flight jobs cover both halves."""
        upper = self.tree.split(node, at)
        self.state_counts[upper.state] += 1
        cp = self.attached.cp
        if cp is not None:  # CP host slots cover owned pages only: split them by ownership
            cp.on_split(node, upper, at)
        self.jobs.enrol_split(upper)
        self.hooks.split(node, upper)
        for listener in self._listeners:
            listener.split(node, upper)
        if self._observers:
            self.notify({"event": "split", "node": node.id, "upper": upper.id, "at": at})
        return upper

    def remove(self, node: TreeNode) -> None:
        """Take a leaf that left every tier (after ``drop`` / ``evict_host``) out of the tree."""
        parent = node.parent
        self.tree.remove_leaf(node)
        self.state_counts[node.state] -= 1
        self.hooks.removed(node, parent)
        for listener in self._listeners:
            listener.removed(node, parent)
        if self._observers:
            self.notify({"event": "removed", "node": node.id})

    def walk(self, tokens: "TokenIds", namespace: Hashable) -> tuple[list[TreeNode], int, int]:
        """``tree.walk``, remembered for the same ids while the tree keeps its shape.

        An engine calls ``match_prefix(tokens)`` and then ``insert(tokens, ...)``
        with the same prefix; the second walk reuses the first when nothing
        was split, added or removed in between. The same ids are the same
        object (the packing ``RequestIds`` remembered, for a tuple, a list or
        an array of the same ids) or equal packed ids: one ``memcmp`` of their
        bytes (``TokenIds`` are immutable), where the walk looks up a page at a time.
        """
        memo = self._memo
        tree = self.tree
        if memo is not None and (memo[0] is tokens or memo[0] == tokens) and memo[2] is tree \
                and memo[3] == tree.version and (memo[1] is namespace or memo[1] == namespace):
            return memo[4]
        try:
            result = tree.walk(tokens, namespace)
        except TypeError as exc:  # an unhashable namespace or token
            raise _unhashable(exc) from None
        self._memo = (tokens, namespace, tree, tree.version, result)
        return result

    def may_match(self, namespace: Hashable, first_page: bytes) -> bool:
        """False when no cached prefix begins with ``first_page``: a miss, known before the rest is packed."""
        try:
            return self.tree.starts_a_prefix(namespace, first_page)
        except TypeError as exc:  # an unhashable namespace: the error ``walk`` gives
            raise _unhashable(exc) from None

    def walk_splitting(self, tokens: "TokenIds", namespace: Hashable) -> tuple[list[TreeNode], int]:
        """``walk``, splitting a node that matches only in part so the match ends on a node boundary."""
        path, matched, partial = self.walk(tokens, namespace)
        if partial:
            tree = self.tree
            path = list(path)
            parent = path[-1] if path else tree.root
            child = parent.children[tree.child_key(namespace, tokens, matched)]
            path.append(self.split(child, partial))
            matched += partial
            self._memo = (tokens, namespace, tree, tree.version, (path, matched, 0))
        return path, matched

    def fork(self, tree: "RadixTree", attached: "Attached") -> "ResidencyDriver":
        """A copy driving ``tree`` (a fork's): same machine and observers, same clock, no walk memo.

        Listeners are not copied: each belongs to a runtime of the original
        cache; a forked runtime registers its own copy. Connect it as a new driver.
        """
        new = ResidencyDriver(tree, self.machine, attached, self.draft)
        new.clock, new.polls = self.clock, self.polls
        new.state_counts = dict(self.state_counts)
        new._observers = self._observers
        return new


def _unhashable(exc: TypeError) -> BadIndices:
    """The error for a namespace (or id) that cannot key the tree's child dicts."""
    return BadIndices(f"namespace and token ids must be hashable: {exc}")
