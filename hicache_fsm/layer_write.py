"""Context-parallel per-layer host writes and CP loads: the ``layer_write`` runtime.

Theory of operation. Under CP (see ``hicache_fsm.cp``) each rank holds the
KV of the logical pages it owns. Backing a node up to host is one
``LayerWrite`` record per node, moved only by the ``layer_write`` machine
(``specs/layer_write.yaml``):

1. ``reserve(node)`` takes host slots (and draft host slots) for the owned
   pages only and saves the per-page owner pattern on the node
   (``node.cp_meta``). The node's residency goes ``device -> writing_host``
   (the residency bindings adopt the reserved slots through ``cache.cp``). A
   rank that owns no page gets an empty reservation and acks at once (in a
   rank group, whose completions are agreed job by job, it submits empty
   copies like the others, so its jobs line up with theirs); a rank
   without room reports how many slots it needed and holds nothing.
2. As the model finishes layer i the engine calls ``on_layer_end(i, source)``
   (``source`` is ``"target"`` or ``"draft"``; the draft model may have fewer
   layers). Each new layer emits one D2H ``TransferJob`` with ``layer=i``
   (draft layers as ``draft=True`` jobs) into the cache's outbox, so it runs
   on the cache's executor. A layer submitted again is a no-op.
   ``submit_all`` catches up every layer at once (the cache's own backup
   paths use it).
3. When every target and draft layer was submitted and every copy landed,
   the record gets its one final ``ack`` and the node's residency fires
   ``write_done`` (``writing_host -> device_host``). If a copy failed, the
   record instead takes ``copies_failed`` once its last copy ended, and the
   node fires ``write_failed`` (host slots freed).

``load_cp(nodes)`` brings host-only CP nodes back: it asks the logical
allocator for pages that replay the saved owner pattern, fires ``load`` on
each node, and emits one H2D job that copies only this rank's pages (an empty
job on a rank that owns none, so completions line up across ranks).
``HiCache.load_back`` goes through it when a runtime is attached.

Attach with ``LayerWriteRuntime(cache)``; the cache's device allocator must be
a ``CPPageAllocator`` (``cp_world.build_cp_rank`` builds a whole rank).
"""

from __future__ import annotations

import collections
import itertools
from typing import Iterable

import attrs
import torch

from hicache_fsm.bindings.residency import EVICTED, LOADING, ON_DEVICE, ON_HOST
from hicache_fsm.cp import CPLayout, CPPageAllocator
from hicache_fsm.errors import AllocationError, ConfigError, GuardRejected, HiCacheError, LayerWriteError
from hicache_fsm.interfaces import LayerWriteHost
from hicache_fsm.jobs import JobKind, TransferJob
from hicache_fsm.machine import compile_machine
from hicache_fsm.radix import TreeNode
from hicache_fsm.registry import registry_for
from hicache_fsm.spec import load_builtin

SOURCES = ("target", "draft")
PENDING = frozenset({"reserved", "submitting", "all_submitted"})

_write_ids = itertools.count(1)


def _empty() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


@attrs.frozen(slots=True, eq=False)
class CPNodeMeta:
    """What a CP node keeps with its host copy (``TreeNode.cp_meta``).

    ``page_owners``: owner rank of each logical page of the node (int8, the
    same on every rank). The target host slots are the node's
    ``host_indices``; ``draft_host_indices`` are the draft host slots (None
    without a draft model). Both cover this rank's owned pages, in page order.
    """

    page_owners: torch.Tensor
    draft_host_indices: torch.Tensor | None
    page_size: int

    @property
    def logical_len(self) -> int:
        return int(self.page_owners.numel()) * self.page_size

    def owned_mask(self, rank: int) -> torch.Tensor:
        """Bool per token of the node: owned by ``rank``."""
        return (self.page_owners == rank).repeat_interleave(self.page_size)

    def owned_tokens(self, rank: int) -> int:
        return int((self.page_owners == rank).sum()) * self.page_size


@attrs.frozen(slots=True)
class LayerEvent:
    """Context of a ``layer_write`` trigger: the runtime and, for ``submit_layer``, which layer."""

    runtime: "LayerWriteRuntime"
    source: str | None = None
    layer: int | None = None


@attrs.define(eq=False)
class LayerWrite:
    """One node's CP host backup on this rank (the ``layer_write`` machine's object).

    ``nodes`` starts as ``[node]`` and grows when the node is split while the
    write is in flight: the halves share the copies and the final ack.
    """

    node: TreeNode
    page_owners: torch.Tensor
    owned_logical: torch.Tensor  # logical device slots of the owned pages
    physical: torch.Tensor  # the same slots in this rank's physical pool
    required_layers: frozenset
    nodes: list = attrs.Factory(list)
    state: str = "idle"
    submitted: frozenset = frozenset()
    host_indices: torch.Tensor | None = None
    draft_host_indices: torch.Tensor | None = None
    inflight: set = attrs.Factory(set)
    copy_failed: bool = False
    acks: int = 0
    needed_slots: int = 0
    id: int = attrs.field(factory=lambda: next(_write_ids))

    @property
    def owned_tokens(self) -> int:
        return int(self.physical.numel())

    @property
    def pending(self) -> bool:
        return self.state in PENDING


class LayerWriteRuntime:
    """Runs ``layer_write`` records and CP loads for one rank's ``HiCache``."""

    def __init__(self, cache: LayerWriteHost, history: int = 4096) -> None:
        allocator = cache.device_allocator
        if not isinstance(allocator, CPPageAllocator):
            raise ConfigError("a CP layer-write runtime needs a cache whose device allocator is a CPPageAllocator")
        if isinstance(history, bool) or not isinstance(history, int) or history < 0:
            raise ConfigError(f"history must be an int >= 0, got {history!r}")
        if getattr(cache, "cp", None) is not None:
            raise ConfigError("this cache already has a CP runtime attached")
        hosted = [n.id for n in cache.tree.nodes() if not n.is_root and n.state != "device"]
        if hosted:  # their host copies have no owner pattern: a CP load of them could not place their pages
            raise ConfigError(f"attach the CP runtime before any node is backed up (nodes {hosted[:8]} are not "
                              "device-only); build the rank with it, or reset the cache first")
        # the collaborators it uses, read off the cache once, at attach (never the cache itself)
        self.check_open = cache.check_open  # refuses a closed cache or a foreign thread
        self.flush = cache.flush  # what a CP load's LoadHandle flushes before its first wait
        self.evict_host = cache.evict_host
        self.register_invariants = cache.register_invariants
        self.tree, self.driver, self.outbox, self.loads = cache.tree, cache.driver, cache.outbox, cache.loads
        self.counters = cache.counters
        # a rank group agrees every completion job by job: a rank owning no page of a node then copies nothing
        # in as many (empty) jobs as the others, instead of acking alone (see ``submits_copies``)
        self.agreed = not cache.group.solo
        self.device_pool, self.draft_device_pool = cache.device_pool, cache.draft_device_pool
        self.draft_host_pool, self.host_allocator = cache.draft_host_pool, cache.host_allocator
        self.device_allocator = allocator
        self.layout: CPLayout = allocator.layout
        self.rank = self.layout.rank
        self.page_size = cache.page_size
        self.machine = compile_machine(load_builtin("layer_write"))
        self._registry = registry_for("layer_write")
        self.has_draft = cache.draft_host_pool is not None
        self.target_layers = cache.device_pool.layers
        self.draft_layers = cache.draft_device_pool.layers if self.has_draft else 0
        self.required_layers = frozenset(
            [("target", i) for i in range(self.target_layers)] + [("draft", i) for i in range(self.draft_layers)]
        )
        self._records: dict[int, LayerWrite] = {}  # node id -> its pending write
        self._job_records: dict[int, LayerWrite] = {}  # per-layer job id -> its write
        self._device_grants: dict[int, torch.Tensor] = {}  # node id -> logical slots load_cp reserved
        self._finished: collections.deque[LayerWrite] = collections.deque(maxlen=history)
        cache.cp = self
        self.register_invariants(self.invariant_violations)

    # ================================================================== allocators

    @property
    def draft_host_allocator(self):
        return self.draft_host_pool.allocator if self.has_draft else None

    def host_room(self) -> int:
        """Tokens this rank could still reserve (target and draft host together)."""
        room = self.host_allocator.available_tokens
        if self.has_draft:
            room = min(room, self.draft_host_allocator.available_tokens)
        return room

    # ---- called by the layer_write bindings

    def can_reserve(self, write: LayerWrite) -> bool:
        return self.host_room() >= write.owned_tokens

    def alloc_owned(self, write: LayerWrite) -> None:
        n = write.owned_tokens
        host = self.host_allocator.alloc(n)
        draft = None
        if host is not None and self.has_draft:
            draft = self.draft_host_allocator.alloc(n)
            if draft is None:
                self.host_allocator.free(host)
                host = None
        if host is None:  # the guard saw room: an allocator broke its word; nothing is kept
            raise AllocationError(f"host allocator refused {n} slots it reported free (node {write.node.id})")
        write.host_indices, write.draft_host_indices = host, draft
        write.node.cp_meta = CPNodeMeta(write.page_owners, draft, self.page_size)

    def record_failure(self, write: LayerWrite) -> None:
        write.needed_slots = write.owned_tokens
        self.counters["cp_reserve_failed"] += 1

    # ---- called by the residency bindings (``cache.cp``)

    def host_has_room(self, node: TreeNode) -> bool:
        write = self._records.get(node.id)
        return write is not None and write.state in ("reserved", "zero_owned") and node.host_indices is None

    def alloc_host(self, node: TreeNode) -> None:
        node.host_indices = self._records[node.id].host_indices

    def release_host(self, node: TreeNode) -> None:
        """The node's host copy is gone: free its draft host slots and forget its owner pattern."""
        meta = node.cp_meta
        if meta is not None and meta.draft_host_indices is not None:
            self.draft_host_allocator.free(meta.draft_host_indices)
        node.cp_meta = None

    def device_has_room(self, node: TreeNode) -> bool:
        return node.id in self._device_grants

    def alloc_device(self, node: TreeNode) -> None:
        node.device_indices = self._device_grants.pop(node.id)

    # ================================================================== reserve

    def reserve(self, node: TreeNode) -> LayerWrite:
        """Reserve host slots for the owned pages of a device-only node.

        Returns the write: ``reserved`` (submit layers next), ``acked`` (this
        rank owns nothing) or ``failed`` (``needed_slots`` says how many host
        slots it needed; nothing is held, the node stays device-only).
        """
        self.check_open()
        node = self.driver.require_node(node)
        if node.id in self._records or node.cp_meta is not None:
            raise LayerWriteError(f"node {node.id} already has a CP host reservation; a second one is not allowed")
        if node.state != "device":
            raise GuardRejected("residency", node.state, "backup", "only a device-only node can be backed up")
        logical = node.device_indices
        owned = self.layout.owned_by_this_rank(logical)
        write = LayerWrite(
            node=node,
            nodes=[node],
            page_owners=self.layout.page_owners(logical),
            owned_logical=logical[owned],
            physical=self.layout.logical_locs_to_physical(logical[owned]),
            required_layers=self.required_layers,
        )
        self.machine.fire(write, "reserve", LayerEvent(self))
        if write.state == "failed":
            self._finished.append(write)
            return write
        if write.state == "zero_owned":
            write.host_indices = _empty()
            write.draft_host_indices = _empty() if self.has_draft else None
            node.cp_meta = CPNodeMeta(write.page_owners, write.draft_host_indices, self.page_size)
        self._records[node.id] = write
        try:
            self.driver.fire(node, "backup", emit=False)
        except BaseException:
            del self._records[node.id]
            self.host_allocator.free(write.host_indices)
            self.release_host(node)
            raise
        self.counters["cp_reserved"] += 1
        if write.state == "zero_owned":
            self._final_ack(write)
        return write

    # ================================================================== per-layer submission

    def _check_layer(self, layer: object, source: object) -> None:
        if source not in SOURCES:
            raise LayerWriteError(f"layer source must be 'target' or 'draft', got {source!r}")
        if source == "draft" and not self.has_draft:
            raise LayerWriteError("a draft layer ended but this cache has no draft pools")
        limit = self.target_layers if source == "target" else self.draft_layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < limit:
            raise LayerWriteError(f"{source} layer {layer!r} is outside [0, {limit})")

    def submit_layer(self, write: LayerWrite, layer: int, source: str = "target") -> bool:
        """Submit one layer of one write; True if a copy was emitted (False: already in, or nothing to do)."""
        self.check_open()
        self._check_layer(layer, source)
        if not isinstance(write, LayerWrite):
            raise LayerWriteError(f"expected a LayerWrite, got {type(write).__name__}")
        if write.pending and self._records.get(write.node.id) is not write:
            raise LayerWriteError(f"write {write.id} is not the reservation of node {write.node.id}")
        if not write.pending:
            return False
        return self._submit(write, layer, source)

    def submit_all(self, write: LayerWrite) -> int:
        """Catch up: submit every target and draft layer not yet submitted; returns copies emitted."""
        emitted = 0
        for layer in range(max(self.target_layers, self.draft_layers)):
            for source, limit in (("target", self.target_layers), ("draft", self.draft_layers)):
                if layer < limit:
                    emitted += self.submit_layer(write, layer, source)
        return emitted

    def on_layer_end(self, layer: int, source: str = "target", flush: bool = True) -> int:
        """Engine hook: ``layer`` of the target or draft model finished its forward pass.

        Submits that layer of every pending write; with ``flush`` the copies
        start now, overlapping the next layers. Returns copies emitted.
        """
        self.check_open()
        self._check_layer(layer, source)
        emitted = 0
        for write in self.pending_writes():
            emitted += self._submit(write, layer, source)
        if emitted and flush:
            self.flush()
        return emitted

    def _submit(self, write: LayerWrite, layer: int, source: str) -> bool:
        transition = self.machine.fire(write, "submit_layer", LayerEvent(self, source, layer))
        if not transition.emits:
            return False
        draft = source == "draft"
        job = TransferJob(
            JobKind.D2H,
            tuple(n.id for n in write.nodes),
            write.draft_host_indices if draft else write.host_indices,
            write.physical,
            layer=layer,
            draft=draft,
        )
        self._job_records[job.id] = write
        write.inflight.add(job.id)
        self.outbox.emit(job)
        return True

    # ================================================================== completions

    def layer_job_finished(self, job: TransferJob, ok: bool) -> None:
        """Called by ``HiCache._apply`` for each completed per-layer job."""
        write = self._job_records.pop(job.id, None)
        if write is None:
            return
        write.inflight.discard(job.id)
        if ok:
            self.counters["bytes_d2h"] += job.num_tokens * (
                self.draft_device_pool if job.draft else self.device_pool).shape.token_bytes
        else:
            write.copy_failed = True
            self.counters["failed_d2h"] += 1
        if write.state == "all_submitted" and not write.inflight:
            if write.copy_failed:
                self._abort(write)
            else:
                self._final_ack(write)

    def _forget(self, write: LayerWrite) -> None:
        for n in write.nodes:
            if self._records.get(n.id) is write:
                del self._records[n.id]
        self._finished.append(write)

    def _final_ack(self, write: LayerWrite) -> None:
        self.machine.fire(write, "ack", LayerEvent(self))
        write.acks += 1
        self._forget(write)
        for n in write.nodes:
            self.driver.fire(n, "write_done")
        self.counters["cp_write_acks"] += 1

    def _abort(self, write: LayerWrite) -> None:
        self.machine.fire(write, "copies_failed", LayerEvent(self))
        self._forget(write)
        for n in write.nodes:
            self.driver.fire(n, "write_failed")
        self.counters["cp_write_failed"] += 1

    # ================================================================== cache hooks

    def backup(self, node: TreeNode) -> bool:
        """The cache's backup path under CP: reserve (evicting host KV if short) and catch up all layers.

        Every rank of the group decides alike: host KV is evicted while *any* rank lacks room for its
        share of the node (``group_shortfall``, computed from the shared tree), and the node is backed up
        on every rank or on none. A rank short of room still records its refused reservation first.
        """
        node = self.driver.require_node(node)
        if node.state != "device":  # before the room checks, which read the node's device slots
            raise GuardRejected("residency", node.state, "backup", "only a device-only node can be backed up")
        if self.host_room() < self._owned_tokens(node, self.rank):
            write = self.reserve(node)  # refused (``failed``): nothing held, the tree unchanged
            if write.state != "failed":
                raise AllocationError(f"rank {self.rank} reserved node {node.id} without the room it lacked")
        while (short := self.group_shortfall(node)) > 0:
            if self.evict_host(short) <= 0:
                self.counters["backup_host_full"] += 1
                return False
        write = self.reserve(node)
        if write.state == "failed":
            raise AllocationError(f"rank {self.rank} was refused host room the group's count left for node {node.id}")
        self.submit_all(write)
        return True

    def _owned_tokens(self, node: TreeNode, rank: int) -> int:
        owners = self.layout.owner_for_logical_pages(node.device_indices[:: self.page_size] // self.page_size)
        return int((owners == rank).sum()) * self.page_size

    def group_shortfall(self, node: TreeNode) -> int:
        """Most host tokens any rank of the group lacks to hold its share of ``node`` (0: every rank has room).

        The same number on every rank: a rank's host holds the owned pages of the nodes with an owner
        pattern (``cp_meta``; the tree and the owner function are the same on every rank) plus what the
        engine holds by other, identical calls on every rank; so this rank's room plus its owned share of
        those nodes is every rank's.
        """
        metas = [n.cp_meta for n in self.tree.nodes() if n.cp_meta is not None]
        base = self.host_room() + sum(m.owned_tokens(self.rank) for m in metas)
        return max(self._owned_tokens(node, rank) - (base - sum(m.owned_tokens(rank) for m in metas))
                   for rank in range(self.layout.world_size))

    def on_split(self, lower: TreeNode, upper: TreeNode, at: int) -> None:
        """``upper`` took the first ``at`` tokens of ``lower``: split the owner pattern and host slots by ownership."""
        meta = lower.cp_meta
        if meta is not None:
            pages = at // self.page_size
            up_owners, low_owners = meta.page_owners[:pages], meta.page_owners[pages:]
            k = int((up_owners == self.rank).sum()) * self.page_size
            if upper.host_indices is not None:
                full = torch.cat([upper.host_indices, lower.host_indices])
                upper.host_indices, lower.host_indices = full[:k], full[k:]
            d = meta.draft_host_indices
            upper.cp_meta = CPNodeMeta(up_owners, None if d is None else d[:k], self.page_size)
            lower.cp_meta = CPNodeMeta(low_owners, None if d is None else d[k:], self.page_size)
        write = self._records.get(lower.id)
        if write is not None:
            write.nodes.insert(write.nodes.index(lower), upper)
            self._records[upper.id] = write

    def reset(self) -> None:
        """The cache was reset: every write and grant is gone, draft host slots are free."""
        self._records.clear()
        self._job_records.clear()
        self._device_grants.clear()
        if self.has_draft:
            self.draft_host_allocator.reset()

    # ================================================================== CP load

    def prepare_load(self, nodes: list[TreeNode]) -> torch.Tensor | None:
        """Reserve logical device pages that replay the saved owner pattern of ``nodes`` (top-down).

        The residency ``load`` of each node then adopts its part. Returns the
        slots, or None (nothing changed) when the allocator cannot match the
        pattern. Raises ``LayerWriteError`` for a node without CP metadata, a
        node whose parent would stay off the device, a node given twice, or an
        allocator answer that does not replay the pattern (what it took is freed).
        """
        seen: set[int] = set()
        for n in nodes:
            if n.state not in EVICTED - LOADING:
                raise GuardRejected("residency", n.state, "load", f"node {n.id} has no host-only copy to load")
            if n.cp_meta is None:
                raise LayerWriteError(f"node {n.id} has no CP metadata (owner pattern) to load with")
            if self.has_draft and n.cp_meta.draft_host_indices is None:
                raise LayerWriteError(f"node {n.id} has no draft host slots but this cache has a draft model")
            if n.id in seen:
                raise LayerWriteError(f"node {n.id} appears twice")
            parent = n.parent
            if parent.parent is not None and parent.id not in seen and parent.state not in ON_DEVICE | LOADING:
                raise LayerWriteError(f"node {n.id} would be on the device while its parent {parent.id} is not")
            seen.add(n.id)
        owners = torch.cat([n.cp_meta.page_owners for n in nodes])
        allocator: CPPageAllocator = self.device_allocator
        device = allocator.alloc_pages_with_owners(owners)
        if device is None:
            self.counters["cp_load_no_pattern"] += 1
            return None
        expected = sum(n.num_tokens for n in nodes)
        ok = isinstance(device, torch.Tensor) and device.numel() == expected
        if ok:
            try:
                ok = torch.equal(self.layout.page_owners(device), owners.to(torch.int8))
            except HiCacheError:
                ok = False
        if not ok:
            got = device.numel() if isinstance(device, torch.Tensor) else type(device).__name__
            if isinstance(device, torch.Tensor):
                allocator.free(device)
            raise LayerWriteError(f"alloc_pages_with_owners returned {got} slots that do not replay the owner "
                                  f"pattern of {expected} slots; everything it took was freed")
        offset = 0
        for n in nodes:
            self._device_grants[n.id] = device[offset: offset + n.num_tokens]
            offset += n.num_tokens
        return device

    def load_job(self, nodes: list[TreeNode]) -> TransferJob:
        """The H2D job of loading CP ``nodes``: this rank's pages only (empty when it owns none)."""
        host, physical, draft = [], [], []
        for n in nodes:
            mask = n.cp_meta.owned_mask(self.rank)
            physical.append(self.layout.logical_locs_to_physical(n.device_indices[mask]))
            host.append(n.host_indices)
            draft.append(n.cp_meta.draft_host_indices)
        return TransferJob(
            JobKind.H2D,
            tuple(n.id for n in nodes),
            torch.cat(host),
            torch.cat(physical),
            draft_host_indices=torch.cat(draft) if self.has_draft else None,
        )

    def load_cp(self, nodes: Iterable[TreeNode]):
        """Load host-only CP nodes (top-down) back to the device; a ``LoadBack``, or None.

        ``cache.load_back`` takes this path by itself when a runtime is
        attached; this is the direct form (no eviction, no thresholds). None
        (nothing changed) when device pages cannot replay the owner pattern.
        """
        from hicache_fsm.results import LoadBack, LoadHandle

        self.check_open()
        if not isinstance(nodes, Iterable):
            raise LayerWriteError(f"load_cp wants an iterable of nodes (top-down), got {type(nodes).__name__}")
        nodes = [self.driver.require_node(n) for n in nodes]
        if not nodes:
            return None
        device = self.prepare_load(nodes)
        if device is None:
            return None
        ids = {n.id for n in nodes}
        loads = self.loads  # the waits of every ancestor still loading, as ``cache.load_back`` takes them
        above = {a.id: a for n in nodes for a in loads.loading_above(n.parent) if a.id not in ids}
        deps = loads.loading_deps(above.values())
        for n in nodes:
            self.driver.fire(n, "load", emit=False)
        handle = LoadHandle(self, deps)
        self.loads.start(nodes, handle)
        self.counters["cp_loaded_tokens"] += int(device.numel())
        return LoadBack(device, tuple(nodes), handle)

    # ================================================================== observation

    def pending_writes(self) -> list[LayerWrite]:
        """Writes still waiting for layers or copies (each once, even if its node was split)."""
        return list({id(w): w for w in self._records.values()}.values())

    def write_for(self, node: TreeNode) -> LayerWrite | None:
        return self._records.get(node.id)

    def snapshot(self) -> dict:
        def idx(t):
            return None if t is None else t.tolist()

        return {
            "writes": sorted(
                (w.id, w.state, tuple(n.id for n in w.nodes), tuple(sorted(w.submitted)), tuple(sorted(w.inflight)),
                 w.copy_failed, w.acks)
                for w in self.pending_writes()
            ),
            "meta": sorted(
                (n.id, n.cp_meta.page_owners.tolist(), idx(n.cp_meta.draft_host_indices))
                for n in self.tree.nodes() if n.cp_meta is not None
            ),
            "draft_host_free": self.draft_host_allocator.free_pages if self.has_draft else None,
            "draft_host_owned": sorted(self.draft_host_allocator.owned_pages()) if self.has_draft else None,
            "grants": sorted(self._device_grants),
        }

    # ---- invariants (the layer_write spec names them; the bindings call these)

    def ack_violations(self) -> list[str]:
        problems = []
        for w in self.pending_writes():
            if not w.pending:
                problems.append(f"write {w.id} is {w.state} but still registered as pending")
            if w.acks:
                problems.append(f"pending write {w.id} was already acked {w.acks} times")
            if w.state == "all_submitted" and not w.inflight:
                problems.append(f"write {w.id}: every layer landed but no final ack was sent")
        for w in self._finished:
            if w.state == "acked" and w.acks != 1:
                problems.append(f"write {w.id} acked {w.acks} times")
            if w.state != "acked" and w.acks:
                problems.append(f"write {w.id} in {w.state} counts {w.acks} acks")
        for n in self.tree.nodes():
            if n.state == "writing_host" and n.id not in self._records:
                problems.append(f"node {n.id} is writing_host without a pending CP write")
        return problems

    def ownership_violations(self) -> list[str]:
        problems = []
        draft_seen: dict[int, int] = {}
        for n in self.tree.nodes():
            if n.parent is None:
                continue
            meta = n.cp_meta
            hosted = n.state in ON_HOST or n.state == "writing_host"
            if meta is None:
                if hosted:
                    problems.append(f"node {n.id} in {n.state} has a host copy but no owner pattern")
                continue
            if not hosted:
                problems.append(f"node {n.id} in {n.state} keeps an owner pattern without a host copy")
            if meta.logical_len != n.num_tokens:
                problems.append(f"node {n.id}: owner pattern covers {meta.logical_len} of {n.num_tokens} tokens")
            owned = meta.owned_tokens(self.rank)
            if n.host_indices is not None and n.host_indices.numel() != owned:
                problems.append(f"node {n.id} holds {n.host_indices.numel()} host slots for {owned} owned tokens")
            if self.has_draft:
                d = meta.draft_host_indices
                if d is None or d.numel() != owned:
                    problems.append(f"node {n.id} holds {None if d is None else d.numel()} draft host slots "
                                    f"for {owned} owned tokens")
                else:
                    for page in (d[:: self.page_size] // self.page_size).tolist():
                        if page in draft_seen:
                            problems.append(f"draft host page {page} owned by nodes {draft_seen[page]} and {n.id}")
                        draft_seen[page] = n.id
            if n.state == "writing_host" or n.state in LOADING:
                pattern = self.layout.page_owners(n.device_indices)
                if not torch.equal(pattern, meta.page_owners):
                    problems.append(f"node {n.id}: device pages do not follow its saved owner pattern")
        for w in self.pending_writes():
            if w.owned_tokens and not bool(self.layout.owned_by_this_rank(w.owned_logical).all()):
                problems.append(f"write {w.id} copies pages rank {self.rank} does not own")
        if self.has_draft:
            allocated = self.draft_host_allocator.owned_pages()
            if allocated != set(draft_seen):
                leaked = sorted(allocated - set(draft_seen))[:8]
                stray = sorted(set(draft_seen) - allocated)[:8]
                problems.append(f"draft host pages leaked {leaked} / owned but free {stray}")
        return problems

    def invariant_violations(self) -> list[str]:
        problems = []
        for name in self.machine.spec.invariants:
            problems += [f"layer_write.{name}: {p}" for p in self._registry.invariants[name](self)]
        return problems


__all__ = ["CPNodeMeta", "LayerEvent", "LayerWrite", "LayerWriteRuntime"]
