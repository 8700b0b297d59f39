"""Stored pages the backend lost: a node marked stored goes back to "not stored" and is backed up again.

Seam of ``StorageTier`` (which inherits this class): a backend reports lost
data by a new data epoch or by eviction reports; an engine asks with
``verify_stored``, or tells with ``storage_lost``. Every way ends in the
residency machine's ``storage_lost`` trigger on the scheduler's thread.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Callable

from hicache_fsm.errors import StorageLinkError, UnknownNode
from hicache_fsm.interfaces import TierContext
from hicache_fsm.storage.evictions import EvictionTracker
from hicache_fsm.storage.link import StorageLink
from hicache_fsm.storage.options import TierOptions
from hicache_fsm.storage.retry import BackupRetries
from hicache_fsm.storage.threads import leading_hits
from hicache_fsm.tp import PURPOSE_ATTACH_COMMIT

if TYPE_CHECKING:
    from hicache_fsm.radix import TreeNode
    from hicache_fsm.storage.prefetch import PrefetchRuntime

log = logging.getLogger("hicache_fsm.storage.tier")


class LostPages:
    """The lost-pages side of ``StorageTier``: the data epoch, eviction reports, ``verify_stored``, ``storage_lost``."""

    ctx: TierContext
    options: TierOptions
    link: StorageLink
    agreement: Any  # a rank group's agreement, or None
    evictions: EvictionTracker
    retries: BackupRetries
    counters: Counter[str]
    runtime: PrefetchRuntime
    healthy: bool
    last_error: str
    _epoch: object = None  # the attached store's data epoch, kept over a detach (``_read_epoch_at_attach``)
    _sweep_due: bool
    _last_sweep: float
    now: Callable[[], float]  # the tier's clock
    keys_for: Callable[["TreeNode"], tuple[str, ...]]
    _check_open: Callable[[], None]  # refuses a closed tier
    _confine: Callable[[], None]  # refuses a thread that does not drive the cache

    def _data_epoch(self) -> object:
        """The epoch at an attach (on the scheduler's thread, as the attach's own probe); None if unreadable."""
        read = getattr(self.link.backend, "data_epoch", None)  # a duck-typed backend may not have one
        try:
            return read() if callable(read) else None
        except Exception as exc:  # noqa: BLE001 - an epoch that cannot be read tells nothing
            log.debug("storage data epoch unavailable: %s", exc)
            return None

    def epoch_read(self, epoch: object) -> None:
        """The I/O thread read the backend's data epoch: if it changed, its pages were lost (see ``storage_lost``).

        A rank group leaves this out: one rank's backend losing pages must not split the trees.
        """
        if self.agreement is not None or self.link.state != "attached" or not self.healthy:
            return
        if epoch is None or epoch == self._epoch:
            return
        self._epoch = epoch
        self.counters["data_epoch_changes"] += 1
        # each node stored again later than at its last loss: an epoch a full Redis keeps evicting (allkeys-lru)
        # would otherwise have every stored node rewritten at every change, evicting more in turn
        self._mark_lost(self.ctx.tree.nodes(), backoff=True)

    def _read_epoch_at_attach(self) -> None:
        """The attached store's data epoch, after the marks an earlier attachment left were judged by it."""
        epoch = self._data_epoch()
        self._check_stored_marks(epoch)
        self._epoch = epoch

    def _check_stored_marks(self, epoch: object) -> None:
        """At an attach: the nodes marked stored by an earlier attachment hold pages of that store. They are
        trusted only when this is the same store, not wiped since: the data epoch it had then (not 0, which
        every store without one reports). Otherwise (another directory, a private store a detach cleared,
        another client's pages) they go back to "not stored" and are stored again.

        The trees of a rank group are the same, so every rank makes this call, and the group agrees on it.
        """
        stored = [n for n in self.ctx.tree.nodes() if n.parent is not None and n.state.endswith("_stored")]
        if not stored:
            return
        same = epoch is not None and epoch != 0 and epoch == self._epoch
        if not self.ctx.group.all_true(same, PURPOSE_ATTACH_COMMIT):
            self.counters["data_epoch_changes"] += 1
            self._mark_lost(stored)

    def _apply_evictions(self) -> None:
        """Stored nodes whose pages the backend evicted go back to "not stored" (see ``storage.evictions``).

        They are stored again later, each after a longer wait than at its last
        eviction (``BackupRetries.evicted``): the backend evicted them for
        room, and storing them at once would evict others in their place.
        A rank group leaves this out, as it does the epoch: one rank's evictions must not split the trees.
        """
        lost = self.evictions.take_lost()
        if lost and self.agreement is None:
            self._mark_lost(lost, evicted=True)

    def verify_stored(self, nodes: Iterable[TreeNode] | None = None) -> int:
        """Ask the backend whether stored nodes (default: every one) still have all their pages, ``batch_pages``
        keys a call; a node whose keys are found missing goes back to "not stored" and is backed up again.
        Returns how many.

        A blocking backend call on this thread, for an engine's maintenance step; refused
        (StorageLinkError) unless attached and healthy, and with a rank group.
        """
        self._check_open()
        backend = self.link.backend
        if self.link.state != "attached" or backend is None or not self.healthy:
            raise StorageLinkError(f"cannot verify stored pages: the link is {self.link.state}"
                                   + ("" if self.healthy else f", storage unhealthy ({self.last_error})"))
        if self.agreement is not None:
            raise StorageLinkError("verify_stored is not agreed across a rank group; it would split the trees")
        stored = [n for n in (self.ctx.tree.nodes() if nodes is None else self._own_nodes(nodes))
                  if n.parent is not None and n.state.endswith("_stored")]
        step = self.options.batch_pages  # as every other storage call: at most a batch of keys each
        missing = []
        for node in stored:
            keys = list(self.keys_for(node))
            for start in range(0, len(keys), step):
                batch = keys[start: start + step]
                if leading_hits(backend.batch_exists(batch), len(batch)) < len(batch):
                    missing.append(node)
                    break
        return self._mark_lost(missing)

    def storage_lost(self, nodes: Iterable[TreeNode]) -> int:
        """Storage lost these nodes' pages: each stored one goes back to "not stored" and is backed up again.

        For a backend that reports lost data (``data_epoch``) or a check that found
        a node's keys missing. Returns how many nodes moved back. ``UnknownNode``,
        nothing changed, for anything but this cache's live nodes.
        """
        self._confine()
        return self._mark_lost(self._own_nodes(nodes))

    def _mark_lost(self, nodes: Iterable[TreeNode], evicted: bool = False, backoff: bool = False) -> int:
        """Fire ``storage_lost`` on each of ``nodes`` that is stored; returns how many moved. Lost pages are
        stored again at the next poll; pages the backend ``evicted`` for room, and with ``backoff``, later
        (each node later than at its last loss: ``BackupRetries.evicted``)."""
        nodes = list(nodes)
        if nodes:  # a running prefetch may hold pages the backend no longer has
            self.runtime.storage_lost()
        driver = self.ctx.driver
        moved = []
        for node in nodes:
            if node.parent is not None and driver.can_fire(node, "storage_lost"):
                driver.fire(node, "storage_lost")
                moved.append(node.id)
        if not moved:
            return 0
        self.counters["storage_lost_nodes"] += len(moved)
        if evicted or backoff:  # the backend's size cap at work (routine), or a store losing data again and again
            self.retries.evicted(moved, self.options.retry_interval, self.now())
            self._sweep_due = True
            (log.debug if evicted else log.warning)(
                "storage %s the pages of %d stored nodes; they will be stored again later",
                "evicted" if evicted else "lost", len(moved))
        else:
            self._store_again()
            log.warning("storage lost the pages of %d stored nodes; they will be stored again", len(moved))
        return len(moved)

    def _store_again(self) -> None:
        """Look for unstored nodes to back up at the next poll, whatever the retry interval."""
        self._sweep_due = True
        self._last_sweep = float("-inf")

    def _own_nodes(self, nodes: Iterable[TreeNode]) -> list[TreeNode]:
        """``nodes`` as a list of this cache's live nodes; ``UnknownNode`` names the first that is not one.

        Another cache's node moved here would be backed up from this cache's
        host pool at that cache's slots: other KV stored under its keys.
        """
        if not isinstance(nodes, Iterable):
            raise UnknownNode(f"expected an iterable of this cache's nodes, got {type(nodes).__name__}")
        require = self.ctx.driver.require_node
        return [require(node) for node in nodes]
