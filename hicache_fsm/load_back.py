"""Load-back: bring an evicted chain from host memory back to the device, all or nothing.

``LoadBacks.load_back`` finds the host-only chain above a node, makes device
room (evicting with the chain's anchor locked and its host copies pinned),
fires ``load`` on every node of the chain and emits one H2D job for all of
them, whose wait is the returned ``LoadHandle``. ``load_failed`` handles a
failed H2D job: nodes go back to host-only when safe, else the load is retried
into the same slots.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, Callable

import attrs
import torch

from hicache_fsm.bindings.residency import LOADING
from hicache_fsm.errors import GuardRejected
from hicache_fsm.eviction import RESIDENT, REVIVABLE
from hicache_fsm.jobs import H2D, TransferJob
from hicache_fsm.radix import RadixTree, TreeNode
from hicache_fsm.results import LoadBack, LoadHandle
from hicache_fsm.tp import PURPOSE_LOAD_ROOM

if TYPE_CHECKING:
    from hicache_fsm.config import CacheConfig
    from hicache_fsm.interfaces import Allocator, Attached, Driver, Jobs, Refs


@attrs.frozen
class CheckedFlush:
    """What a ``LoadHandle`` flushes before its first wait: the outbox, once the cache's entry check passed."""

    check_open: Callable[[], None]  # refuses a closed cache or a foreign thread
    outbox: "Jobs"

    def flush(self) -> None:
        self.check_open()
        self.outbox.flush()


class LoadBacks:
    """Host-to-device loads of evicted chains.

    Interface: ``load_back`` (after the facade validated the node),
    ``evicted_chain``, ``loading_above``, ``loading_deps``, ``start`` (emit one H2D job for
    nodes already fired into ``loading``), ``load_failed`` (completion path).

    Built with the config, the tree, the driver, the outbox and eviction's
    refs (locks, pins, device eviction), the device allocator, the rank group
    (room on every rank), whether draft pools exist, the counters, the
    attached runtimes (a CP runtime replays its owner pattern) and what a
    handle flushes (``CheckedFlush``).
    """

    def __init__(self, config: "CacheConfig", tree: RadixTree, driver: "Driver", outbox: "Jobs", refs: "Refs",
                 device_allocator: "Allocator", group: Any, draft: bool, counters: Counter[str],
                 attached: "Attached", flusher: CheckedFlush) -> None:
        self.config = config
        self.tree = tree
        self.driver = driver
        self.outbox = outbox
        self.refs = refs
        self.device_allocator = device_allocator
        self.group = group
        self.draft = draft
        self.counters = counters
        self.attached = attached
        self.flusher = flusher

    def evicted_chain(self, node: TreeNode) -> tuple[list[TreeNode], TreeNode]:
        """The host-only chain ending at ``node`` (top-down) and the resident ancestor above it."""
        chain: list[TreeNode] = []
        tree = self.tree
        anchor = tree.root
        for n in tree.path_to_root(node):
            if n.state in RESIDENT:
                anchor = n
                break
            if n.state not in REVIVABLE:
                raise GuardRejected("residency", n.state, "load", f"node {n.id} has no host copy to load")
            chain.append(n)
        chain.reverse()
        return chain, anchor

    def loading_above(self, anchor: TreeNode) -> list[TreeNode]:
        """``anchor`` and its ancestors whose loads are still in flight: all of them, not only a run right above
        a chain (a node an insert revived is on the device at once, under a parent still loading)."""
        return [] if anchor.is_root else [n for n in self.tree.path_to_root(anchor) if n.state in LOADING]

    def loading_deps(self, nodes) -> list[LoadHandle]:
        """Handles of in-flight loads covering any of ``nodes`` (their layers must land first)."""
        deps: list[LoadHandle] = []
        outbox = self.outbox
        for n in nodes:
            for h in outbox.handles_of(n):
                if h not in deps:
                    deps.append(h)
        return deps

    def room_everywhere(self, tokens: int) -> bool:
        """Free device memory for ``tokens`` on every rank (one collective with a rank group)."""
        return self.group.all_true(self.device_allocator.available_tokens >= tokens, PURPOSE_LOAD_ROOM)

    def load_back(self, node: TreeNode) -> LoadBack | None:
        """See ``HiCache.load_back``."""
        tree = self.tree
        counters = self.counters
        chain, anchor = self.evicted_chain(node)
        if not chain:
            return None
        total = sum(n.num_tokens for n in chain)
        cfg = self.config
        if total < cfg.load_back_threshold or (cfg.load_back_max_tokens is not None and total > cfg.load_back_max_tokens):
            counters["load_back_skipped"] += 1
            return None
        device = self.device_allocator
        if not self.room_everywhere(total):
            if not self.group.all_true(total <= device.capacity_tokens, PURPOSE_LOAD_ROOM):
                counters["load_back_device_full"] += 1  # no eviction could make room: evict nothing
                return None
            # the anchor (and so its ancestors) must stay on the device, and the
            # chain's host copies must survive host eviction done by backups
            anchor_path = [] if anchor.is_root else list(tree.path_to_root(anchor))
            eviction = self.refs
            eviction.add_locks(anchor_path, 1)
            eviction.add_pins(chain, 1)
            try:
                eviction.evict(total - device.available_tokens + cfg.eviction_headroom_tokens)
            finally:
                eviction.add_pins(chain, -1)
                eviction.add_locks(anchor_path, -1)
            if not self.room_everywhere(total):
                counters["load_back_device_full"] += 1
                return None
            if not all(tree.owns(n) for n in chain) or self.evicted_chain(node) != (chain, anchor):
                counters["load_back_raced"] += 1  # completions applied while waiting changed the chain
                return None
        deps = self.loading_deps(self.loading_above(anchor))
        cp = self.attached.cp
        if cp is not None and cp.prepare_load(chain) is None:  # CP: replay the saved owner pattern
            counters["load_back_device_full"] += 1
            return None
        driver = self.driver
        for n in chain:
            driver.fire(n, "load", emit=False)
        handle = LoadHandle(self.flusher, deps)
        device_indices = torch.cat([n.device_indices for n in chain]) if len(chain) > 1 else chain[0].device_indices
        self.start(chain, handle)
        counters["loaded_back_tokens"] += total
        return LoadBack(device_indices, tuple(chain), handle)

    def start(self, nodes: list[TreeNode], handle: LoadHandle) -> TransferJob:
        """Emit one H2D job for ``nodes`` (already ``loading``, top-down); ``handle`` binds to its batch."""
        cp = self.attached.cp
        if cp is not None:  # CP: only this rank's pages move (an empty job if it owns none)
            job = cp.load_job(nodes)
        else:
            host = torch.cat([n.host_indices for n in nodes]) if len(nodes) > 1 else nodes[0].host_indices
            device = torch.cat([n.device_indices for n in nodes]) if len(nodes) > 1 else nodes[0].device_indices
            job = TransferJob(
                H2D, tuple(n.id for n in nodes), host, device,
                draft_host_indices=host if self.draft else None,
            )
        self.outbox.emit_load(job, handle)
        return job

    def load_failed(self, nodes: list[TreeNode], handle: LoadHandle | None) -> None:
        """Nodes whose load failed go back to host-only when safe, else the load is retried in place.

        Safe = unlocked and no child on (or coming to) the device. Deepest
        first, so a chain's lower part can leave while a locked upper part
        (or one with other resident children) is retried.
        """
        depth = {n.id: sum(1 for _ in self.tree.path_to_root(n)) for n in nodes}
        retry: list[TreeNode] = []
        for node in sorted(nodes, key=lambda n: -depth[n.id]):
            if node.lock_ref == 0 and not any(c.state in RESIDENT for c in node.children.values()):
                self.driver.fire(node, "load_failed")
            else:
                retry.append(node)
        if retry:
            retry.reverse()  # top-down
            self.counters["load_retries"] += 1
            self.start(retry, handle if handle is not None else LoadHandle(self.flusher))
            if handle is not None:
                handle.unbind()
