"""``HiCache``: the hierarchical KV cache an inference engine embeds.

Theory of operation. The engine owns the forward pass; the cache owns where KV
pages live. Every node of the radix tree carries a ``residency`` state, moved
only by firing triggers on the compiled ``residency`` machine. A transition
never copies data: it names the job kinds it emits, the cache builds immutable
``TransferJob`` records into an outbox, ``flush()`` merges them into one batch
per kind and hands them to an executor, and completions come back through
``poll()`` as ``write_done`` / ``load_done`` / ... events on the same machine.

A step of an engine, in order::

    m = cache.match_prefix(tokens)               # device indices + host hit
    lb = cache.load_back(m.last_host_node)       # evicted chain -> device (maybe None)
    node = lb.last_node if lb else m.last_device_node
    cache.lock(node)                             # before alloc_device: its eviction must not take the prefix
    ... for layer in layers: m.wait(layer); lb and lb.wait(layer); compute layer ...
    idx = cache.alloc_device(n_new)              # slots for the new tokens' KV
    ... write KV into idx ...
    res = cache.insert(tokens, cat(prefix_indices, idx))
    cache.unlock(node)                           # request finished
    cache.poll()                                 # once per step: flush jobs, apply completions

Every public method either does what it says or raises a typed error
(``hicache_fsm.errors``) and leaves the cache exactly as it was: arguments are
validated before anything changes.

Failures. A failed device-to-host copy leaves the node device-only and frees the
reserved host slots. A failed host-to-device load keeps the host copy: the node
returns to host-only when that is safe (not locked, nothing below it on the
device); otherwise the device slots stay reserved and the load is retried into
the same slots, so the indices a reader already holds stay valid.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from typing import Callable, Hashable, Sequence

import torch

from hicache_fsm.acks import AckAgreement
from hicache_fsm.bindings.residency import LOADING, ON_HOST, ResidencyContext
from hicache_fsm.config import CacheConfig
from hicache_fsm.confinement import THIS_THREAD, ThreadOwner
from hicache_fsm.errors import (
    BadIndices,
    CompletionFailure,
    CompletionsFailed,
    ConfigError,
    GuardRejected,
    HiCacheError,
    LockError,
    UnknownJob,
)
from hicache_fsm.engine_pages import EnginePages
from hicache_fsm.insert_slots import own_pages, own_prefix
from hicache_fsm.inspection import HostOwners, InvariantViolation, RuntimeChecks, maintained_set_problems, snapshot, stats
from hicache_fsm.eviction import DEVICE_EVICTABLE, HOST_EVICTABLE, RESIDENT, REVIVABLE, Eviction, executor_can_block
from hicache_fsm.interfaces import Attached
from hicache_fsm.executors import ServesOneCache, TorchExecutor
from hicache_fsm.jobs import EXECUTOR_METHODS, Completion, Executor, TransferJob
from hicache_fsm.load_back import CheckedFlush, LoadBacks
from hicache_fsm.machine import CompiledMachine, compile_machine
from hicache_fsm.outbox import JobLedger, Outbox
from hicache_fsm.radix import RadixTree, TreeNode
from hicache_fsm.registry import registry_for
from hicache_fsm.request_ids import RequestIds
from hicache_fsm.residency_driver import ResidencyDriver
from hicache_fsm.results import DeviceGrant, InsertResult, LoadBack, LoadCancelled, LoadHandle, MatchResult
from hicache_fsm.slots import (
    bind_pools, check_dispatcher, check_index_pages, check_index_tensor, check_pools, device_slot_tensor, page_ids,
    unbind_pools,
)
from hicache_fsm.spec import load_builtin
from hicache_fsm.storage.ownership import check_completion_owner
from hicache_fsm.storage.calls import StorageCalls, drain_seconds
from hicache_fsm.tp import PURPOSE_BUILD, PoolState, RankGroup, StepAgreement, cache_fingerprint

log = logging.getLogger("hicache_fsm.cache")

__all__ = [
    "DEVICE_EVICTABLE", "HOST_EVICTABLE", "RESIDENT", "REVIVABLE", "DeviceGrant", "HiCache", "InsertResult",
    "InvariantViolation", "JobLedger", "LoadBack", "LoadCancelled", "LoadHandle", "MatchResult", "cache_from_pools",
]

_EMPTY = torch.empty(0, dtype=torch.int64)


class HiCache(StorageCalls):
    """A device + host (+ storage) KV cache over a radix tree: the facade an engine embeds.

    ``device_pool`` / ``host_pool`` are ``pools.DeviceKVPool`` / ``pools.HostKVPool``
    (draft pools optional); ``executor`` runs D2H and H2D jobs (a
    ``TorchExecutor`` over the pools by default). ``dispatcher`` replaces the
    compiled residency machine: anything with ``fire / select / can_fire /
    spec / add_listener`` (used to benchmark against ``transitions``).
    ``group`` is the engine's tensor-parallel group (a ``tp.RankGroup`` or a
    ``torch.distributed`` ProcessGroup; None: one rank): with more than one
    rank, what a rank observes alone (acks, storage answers) is agreed on with
    MIN before it acts, so every rank's tree stays identical
    (docs/tensor-parallel.md).

    The work is done by four parts, each a public attribute with a small
    interface, built by ``compose`` with the collaborators it uses and never
    the facade (docs/architecture.md): ``driver`` (``ResidencyDriver``),
    ``eviction`` (``Eviction``), ``loads`` (``LoadBacks``) and ``outbox``
    (``Outbox``). The facade validates arguments, then delegates.
    """

    def __init__(
        self,
        device_pool,
        host_pool,
        config: CacheConfig | None = None,
        executor: Executor | None = None,
        draft_device_pool=None,
        draft_host_pool=None,
        dispatcher: CompiledMachine | None = None,
        group=None,
    ) -> None:
        check_pools(device_pool, host_pool, draft_device_pool, draft_host_pool)
        check_dispatcher(dispatcher)
        if config is not None and not isinstance(config, CacheConfig):
            raise ConfigError(f"config must be a CacheConfig, got {type(config).__name__}")
        if isinstance(executor, type):
            raise ConfigError(f"executor must be an executor instance, got the class {executor.__name__}: make one")
        if executor is not None and not all(callable(getattr(executor, m, None)) for m in EXECUTOR_METHODS):
            raise ConfigError(f"executor must have {', '.join(EXECUTOR_METHODS)} (a jobs.Executor), "
                              f"got {type(executor).__name__}")
        pools = (device_pool, host_pool, draft_device_pool, draft_host_pool)
        self.bound_allocators = bind_pools(self, pools)
        try:
            if isinstance(executor, ServesOneCache):  # ours: over these very pools, for this cache alone
                executor.bind_cache(self, pools)
            self._build(device_pool, host_pool, config, executor, draft_device_pool, draft_host_pool, dispatcher, group)
        except BaseException:  # refused (a bad group, ...): the pools and the executor may serve another cache
            unbind_pools(self, self.bound_allocators)
            if isinstance(executor, ServesOneCache):
                executor.unbind_cache(self)
            raise

    def _build(self, device_pool, host_pool, config: CacheConfig | None, executor: Executor | None,
               draft_device_pool, draft_host_pool, dispatcher: CompiledMachine | None, group) -> None:
        self.config = config or CacheConfig()
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.draft_device_pool = draft_device_pool
        self.draft_host_pool = draft_host_pool
        self.page_size = device_pool.page_size
        if executor is None:
            executor = TorchExecutor(device_pool, host_pool, draft_device_pool, draft_host_pool)
        self.executor = executor
        machine = dispatcher or compile_machine(load_builtin("residency"))
        self.residency_registry = registry_for("residency")
        self.tree = RadixTree(self.page_size)  # cleared in place by reset: every part holds this one
        self.token_bytes = device_pool.shape.token_bytes
        self.counters: Counter[str] = Counter()
        # tensor parallelism (hicache_fsm.tp): what one rank observes alone is agreed on before it acts
        self.group = RankGroup.of(group)
        differ = self.group.differing(cache_fingerprint(self.config, device_pool, host_pool, draft_device_pool,
                                                        draft_host_pool), PURPOSE_BUILD)
        if differ:
            raise ConfigError(f"rank {self.group.rank} of {self.group.size}: the ranks' caches differ in "
                              f"{', '.join(differ)}; every rank needs the same configuration and pool sizes")
        self.agreement = StepAgreement(self.group)
        self.compose(ResidencyDriver(self.tree, machine, Attached(), draft_host_pool is not None))
        if self.acks is not None:
            self.agreement.register(self.acks)
            self.agreement.register(PoolState(self.tree, device_pool, host_pool, self.attached))
        self.engine_pages = EnginePages()  # device pages handed out by alloc_device, not yet inserted or freed
        self.runtime_checks = RuntimeChecks()  # host slots and invariants of attached runtimes
        self.check_candidates = False  # also recompute the eviction candidate sets in invariant_violations
        self.closed = False
        self.thread_owner = ThreadOwner()  # the thread that drives the cache (none yet: the next caller adopts it)

    def compose(self, driver: ResidencyDriver, outbox: Outbox | None = None) -> None:
        """Build the parts around ``driver`` (and ``outbox``, a fork's copy) from this cache's collaborators.

        The one place that wires the parts: each gets what it uses, never the facade. ``__init__``
        calls it, and so does a fork (``testing.adapter.fork_cache``) with its copies of both.
        """
        tree, counters, attached = self.tree, self.counters, driver.attached
        if outbox is None:
            outbox = Outbox(tree, driver, self.executor, attached, counters, self.token_bytes, self.agreement)
        eviction = Eviction(self.config, tree, driver, outbox, self.executor, self.host_allocator, counters, attached)
        loads = LoadBacks(self.config, tree, driver, outbox, eviction, self.device_allocator, self.group,
                          self.draft_host_pool is not None, counters, attached, CheckedFlush(self.check_open, outbox))
        self.attached, self.driver, self.outbox, self.eviction, self.loads = attached, driver, outbox, eviction, loads
        self.residency_ctx = ResidencyContext(self.device_allocator, self.host_allocator, attached)
        self.request_ids = RequestIds(driver, self.page_size)
        self.acks = None if self.group.solo else AckAgreement(outbox, attached)
        driver.connect(eviction, outbox, self.residency_ctx)
        outbox.connect(loads, self.acks)

    storage = property(lambda self: self.attached.storage, lambda self, tier: setattr(self.attached, "storage", tier),
                       doc="The storage tier (L3), once attached (see hicache_fsm.storage).")
    cp = property(lambda self: self.attached.cp, lambda self, runtime: setattr(self.attached, "cp", runtime),
                  doc="A CP layer-write runtime, once attached (see hicache_fsm.layer_write).")

    @property
    def residency(self) -> CompiledMachine:
        """The residency machine every node moves through (the driver fires it)."""
        return self.driver.machine

    @residency.setter
    def residency(self, machine: CompiledMachine) -> None:
        self.driver.machine = machine

    # ================================================================== allocators and slots

    @property
    def device_allocator(self):
        return self.device_pool.allocator

    @property
    def host_allocator(self):
        return self.host_pool.allocator

    @property
    def job_ledger(self) -> JobLedger:
        return self.outbox.ledger

    @property
    def storage_attached(self) -> bool:
        return self.attached.storage_attached()

    def alloc_device(self, num_tokens: int) -> torch.Tensor | None:
        """Device slots for the engine to compute new KV into.

        Called before a prefill/extend writes KV for tokens the cache did not
        have. Hand the slots back through ``insert`` (the cache takes them) or
        ``free_device`` (aborted request). Evicts unlocked device KV when needed;
        None when even that is not enough (at once, when the pool is smaller).
        """
        self.check_open()
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise BadIndices(f"alloc_device wants a non-negative int token count; got {num_tokens!r}")
        if num_tokens % self.page_size:
            raise BadIndices(f"alloc_device wants whole pages of {self.page_size} tokens; got {num_tokens}")
        if num_tokens > self.device_allocator.capacity_tokens:  # more than the pool holds: evicting would only lose KV
            return None
        if self.device_allocator.available_tokens < num_tokens:
            self.eviction.evict(num_tokens - self.device_allocator.available_tokens
                                + self.config.eviction_headroom_tokens)
        taken = self.device_allocator.alloc_with_page_ids(num_tokens)
        if taken is None:
            return None
        indices, pages = taken
        self.engine_pages.hand_out(pages.tobytes())
        return indices

    def free_device(self, indices: torch.Tensor) -> None:
        """Return device slots from ``alloc_device`` that will not be inserted (aborted request)."""
        self.check_open()
        pages = self._check_tensor(indices, None)
        self.engine_pages.check(pages)
        self.device_allocator.free(indices)
        self.engine_pages.release(pages)

    def _page_ids(self, indices: torch.Tensor) -> list[int]:
        return page_ids(indices, self.page_size)

    def _check_tensor(self, indices: object, length: int | None) -> list[int]:
        return check_index_tensor(indices, length, self.page_size, self.device_allocator)

    # ================================================================== match and insert

    def match_prefix(self, tokens: Sequence[int], namespace: Hashable = None) -> MatchResult:
        """Longest cached prefix of ``tokens`` (whole pages), counted as a hit.

        Called when a request is scheduled, before deciding what to compute.
        A node that only partly matches is split so that the match ends on a
        node boundary. Under ``write_through_selective`` nodes whose hit count
        reaches the threshold are backed up here.

        Every id the walk reads is checked first, and a miss reads one page.
        A miss is known from the first page (no cached prefix begins with it):
        that page is checked and packed, and nothing after it is read, so a
        miss costs no per-id work for the rest of the request (``insert``
        checks every id). Otherwise every id is checked and packed before the
        walk (the first page twice: about 1 us for a tuple).
        """
        if self.closed or THIS_THREAD.token != self.thread_owner.token:  # ``check_open``, inline
            self.check_open()
        driver = self.driver
        path, n_ids = self.request_ids.match_walk(tokens, namespace)
        now = driver.tick()
        polls = driver.polls
        device_parts: list = []  # the nodes' compact device slots
        loads: list[LoadHandle] = []
        last_device = self.tree.root
        host_hit = 0
        for node in path:
            node.hit_count += 1
            node.last_access = now
            node.last_poll = polls
            if host_hit == 0 and node.state in RESIDENT:
                device_parts.append(node.device_slots)
                last_device = node
                if node.state in LOADING:
                    for h in self.outbox.handles_of(node):
                        if h not in loads:
                            loads.append(h)
            else:
                host_hit += node.num_tokens
        device_indices = device_slot_tensor(device_parts, self.device_pool.allocator)
        device_hit = device_indices.numel()
        c = self.counters
        c["match_requests"] += 1
        c["device_hit_tokens"] += device_hit
        c["host_hit_tokens"] += host_hit
        c["miss_tokens"] += n_ids // self.page_size * self.page_size - device_hit - host_hit
        if self.config.write_policy == "write_through_selective":
            self.eviction.back_up_hot(path, self.config.write_through_threshold)
        return MatchResult(device_indices, last_device, path[-1] if path else last_device, host_hit, tuple(loads))

    def insert(
        self,
        tokens: Sequence[int],
        device_indices: torch.Tensor,
        namespace: Hashable = None,
        priority: int = 0,
    ) -> InsertResult:
        """Insert a computed prefix; the cache takes ownership of the engine's slots in ``device_indices``.

        Called when a request's KV is complete on the device (after prefill,
        or when the request finishes). ``device_indices`` has one slot per
        token; ``len(tokens)`` must be a whole number of pages. For the part
        already cached on the device, the slots may be the cache's own (as
        ``match_prefix`` returned them: kept) or fresh ones from
        ``alloc_device`` (duplicates: freed). Every other slot must come from
        ``alloc_device``; an evicted part is revived with them. Nodes keep
        the page ids, not the tensor: the engine may reuse its buffer.
        """
        if self.closed or THIS_THREAD.token != self.thread_owner.token:  # ``check_open``, inline
            self.check_open()
        tokens = self.request_ids.packed(tokens)
        ps = self.page_size
        n_tokens = len(tokens)
        if n_tokens % ps:
            raise BadIndices(f"insert wants whole pages of {ps} tokens; got {n_tokens} tokens")
        page_array = check_index_pages(device_indices, n_tokens, ps, self.device_allocator)
        if type(priority) is not int and (isinstance(priority, bool) or not isinstance(priority, int)):
            raise BadIndices(f"priority must be an int, got {priority!r}")
        driver = self.driver
        path, matched, partial = driver.walk(tokens, namespace)
        # ---- validate every page before changing anything
        packed = page_array.tobytes()  # the engine's page ids, as nodes keep them
        own = own_prefix(path, partial)
        if own is not None and packed.startswith(own):  # the usual case: the cached part is the cache's own slots
            page_ids = own_ids = None  # not needed: nothing to revive, no duplicate
            self.engine_pages.take_packed(packed[len(own) :])  # the last check: from here on the cache holds them
        else:
            page_ids = page_array.tolist()
            own_ids = own_pages(path, partial, self.tree, tokens, namespace, matched)
            n_own = len(own_ids)
            self.engine_pages.check([p for i, p in enumerate(page_ids) if i >= n_own or own_ids[i] != p])  # last check
        # ---- apply
        if partial:
            path, matched = driver.walk_splitting(tokens, namespace)
        now = driver.tick()
        polls = driver.polls
        if own_ids is None:
            for node in path:
                node.last_access = now
                node.last_poll = polls
                if priority > node.priority:
                    node.priority = priority
        else:
            self._adopt_path(path, device_indices, page_ids, own_ids, priority, now, polls)
        node = path[-1] if path else self.tree.root
        if matched < n_tokens:
            node = driver.add_child(node, tokens, namespace, matched)
            node.last_access, node.priority, node.last_poll = now, priority, polls
            node.device_slots = packed[(matched // ps) << 3 :]
            driver.fire(node, "insert")
        if self.config.write_policy == "write_through":
            # new node, plus any node on the path whose earlier backup failed or was refused
            try_backup = self.eviction.try_backup
            for n in path:
                if n.state == "device":
                    try_backup(n)
            if matched < n_tokens:
                try_backup(node)
        self.counters["inserted_tokens"] += n_tokens - matched
        return InsertResult(node, matched, n_tokens - matched)

    def _adopt_path(self, path: list[TreeNode], device_indices: torch.Tensor, page_ids: list[int],
                    own: list[int | None], priority: int, now: int, polls: int) -> None:
        """Touch the matched nodes; revive evicted ones with the engine's slots, free the engine's duplicates."""
        ps = self.page_size
        driver = self.driver
        pos = 0
        duplicate: list[torch.Tensor] = []
        for node in path:
            size = node.num_tokens
            first = pos // ps
            pos += size
            node.last_access = now
            node.last_poll = polls
            if priority > node.priority:
                node.priority = priority
            if node.state in REVIVABLE:
                driver.fire(node, "revive", DeviceGrant(device_indices[pos - size : pos]))
                self.engine_pages.release(page_ids[first : first + size // ps])
                self.counters["revived_tokens"] += size
            elif own[first : first + size // ps] != page_ids[first : first + size // ps]:
                duplicate.append(device_indices[pos - size : pos])
        for part in duplicate:
            pages = self._page_ids(part)
            mine = [i for i, p in enumerate(pages) if p in self.engine_pages]
            if len(mine) != len(pages):  # some pages were the node's own: free only the engine's
                part = torch.cat([part[i * ps : (i + 1) * ps] for i in mine]) if mine else _EMPTY
                pages = [pages[i] for i in mine]
            if pages:
                self.device_allocator.free(part)
                self.engine_pages.release(pages)
        self.engine_pages.release(page_ids[pos // ps :])  # the new node's (added next), if any

    # ================================================================== locks

    def lock(self, node: TreeNode) -> None:
        """Pin a device-resident (or loading) node and its ancestors on the device.

        Called when a request starts using a matched or loaded prefix; the
        root is accepted and ignored. Pair every call with ``unlock``.
        """
        if self.closed or THIS_THREAD.token != self.thread_owner.token:  # ``check_open``, inline
            self.check_open()
        if type(node) is not TreeNode or self.tree.by_id.get(node.id) is not node:  # the root passes: no-op below
            node = self.driver.require_node(node)
        self.eviction.lock_path(node)

    def unlock(self, node: TreeNode) -> None:
        """Release a ``lock`` when the request that took it no longer reads the prefix."""
        if self.closed or THIS_THREAD.token != self.thread_owner.token:  # ``check_open``, inline
            self.check_open()
        if type(node) is not TreeNode or self.tree.by_id.get(node.id) is not node:  # the root passes: no-op below
            node = self.driver.require_node(node)
        self.eviction.unlock_path(node)

    def pin_host(self, node: TreeNode) -> None:
        """Protect a node's host copy from host eviction (prefetch anchors, storage readers)."""
        self.check_open()
        node = self.driver.require_node(node)
        if node.state not in ON_HOST:
            raise LockError(f"node {node.id} has no host copy to pin ({node.state})")
        self.eviction.add_pins((node,), 1)

    def unpin_host(self, node: TreeNode) -> None:
        """Release a ``pin_host``."""
        self.check_open()
        node = self.driver.require_node(node)
        if node.host_ref <= 0:
            raise LockError(f"unpin_host of node {node.id} would take its host ref below zero")
        self.eviction.add_pins((node,), -1)

    # ================================================================== backup, eviction, load-back

    def write_backup(self, node: TreeNode) -> bool:
        """Back a device-only node up to host now; False if host memory stays full.

        For engines that decide backups themselves (any write policy). Host
        full -> evict host KV -> retry -> the node stays device-only (False).
        """
        self.check_open()
        node = self.driver.require_node(node)
        if node.state != "device":
            raise GuardRejected("residency", node.state, "backup", f"node {node.id}: only a device-only node can be backed up")
        return self.eviction.try_backup(node)

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device tokens if possible; returns tokens freed.

        Called by ``alloc_device`` / ``load_back`` under memory pressure, or
        by an engine that wants headroom. Picks unlocked leaves of the
        device-resident subtree in eviction-policy order; a parent becomes a
        candidate when its last resident child goes. Backed-up nodes just lose
        their device copy. A device-only node is dropped (KV lost) under
        ``write_through(_selective)``; under ``write_back`` / ``write_behind``
        (or when it has host-only children) it is backed up first and evicted
        once the copy lands: the call waits for the copies when the executor
        can block, otherwise later calls evict it. A failed backup is never
        taken for a backup. Under write_back a node whose backup cannot start
        (host full even after host eviction) is dropped so eviction progresses.
        """
        self.check_open()
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
            raise BadIndices(f"evict wants an int token count; got {num_tokens!r}")
        if num_tokens <= 0:
            return 0
        return self.eviction.evict(num_tokens)

    def executor_can_block(self) -> bool:
        return executor_can_block(self.executor)  # a manual executor waits for a test

    def evict_node(self, node: TreeNode) -> int:
        """Take one node's KV off the device now; returns the tokens freed.

        For an engine that knows a prefix will not be reused (or tests). The
        node must be unlocked, have no child on the device, and not be in
        flight. A backed-up node keeps its host copy; a device-only leaf is
        dropped under ``write_through(_selective)`` and refused under
        ``write_back`` / ``write_behind`` (back it up first).
        """
        self.check_open()
        return self.eviction.evict_node(self.driver.require_node(node))

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host tokens of nodes that are off the device.

        Called by backups when host memory is short, or by an engine/prefetch
        that needs host room. Only leaves leave (a host-only inner node would
        orphan its subtree); a parent becomes a candidate when its last child
        goes. Never a node whose host copy is pinned or in flight.
        """
        self.check_open()
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
            raise BadIndices(f"evict_host wants an int token count; got {num_tokens!r}")
        if num_tokens <= 0:
            return 0
        return self.eviction.evict_host(num_tokens)

    def load_back(self, node: TreeNode) -> LoadBack | None:
        """Load the evicted chain ending at ``node`` back to the device, all or nothing.

        Called after ``match_prefix`` reported a host hit, with its
        ``last_host_node`` (the root or a resident node: nothing to do, None).
        Returns None (the engine recomputes) when the chain is under
        ``load_back_threshold`` or over ``load_back_max_tokens`` tokens, or
        device memory stays short after eviction. The chain is one H2D job;
        its host copies stay protected until the load is acknowledged. Read
        layer ``i`` only after ``result.wait(i)``.
        """
        self.check_open()
        if node is self.tree.root:
            return None
        return self.loads.load_back(self.driver.require_node(node))

    # ================================================================== jobs

    def pending_job_ids(self) -> list[int]:
        """Ids of jobs emitted and not yet acknowledged (queued or running), oldest first."""
        return self.outbox.pending_ids()

    def pending_jobs(self) -> list[TransferJob]:
        """The pending jobs themselves (tests, tracing, an engine-side executor)."""
        return self.outbox.pending_jobs()

    def flush(self) -> None:
        """Merge queued jobs into one batch per kind and start them.

        ``poll`` calls it; call it directly to start copies earlier in a step.
        If the executor refuses a batch, the unstarted jobs stay queued.
        """
        self.check_open()
        self.outbox.flush()

    def poll(self) -> list[Completion]:
        """Start queued jobs and apply every completion that is ready; returns the completions applied.

        Called once per engine step. Also runs ``write_behind`` backups of nodes
        that went cold. Completions of jobs ``reset`` dropped are ignored. A
        completion that cannot be applied (an unknown job, or one whose
        transitions raised) never stops the others: every other completion is
        applied first, then ``CompletionsFailed`` lists the failures (its
        ``applied`` holds what this call would have returned). No node is left
        in flight without a job (``in_flight_has_job``). With a rank group, a
        rank whose executor raised still takes part in the step's collective
        (with no completion of its own), then raises: the other ranks are in it.
        """
        if self.closed or THIS_THREAD.token != self.thread_owner.token:  # ``check_open``, inline
            self.check_open()
        self.driver.count_poll()
        outbox = self.outbox
        local_error = None
        try:
            if self.config.write_policy == "write_behind":
                self.eviction.write_behind()
            outbox.flush()
            done = list(self.executor.poll())
        except Exception as exc:
            if self.group.solo:
                raise
            local_error, done = exc, []
        failures = outbox.take_deferred()
        storage = self.attached.storage
        if storage is not None:
            try:
                done += storage.poll()
            except Exception as exc:  # the executor's completions are applied all the same
                failures.append(CompletionFailure(None, exc))
        try:
            applied, more = outbox.apply_agreed(done)  # with a rank group: a collective every poll, even with none
        except Exception:
            if local_error is not None:
                raise local_error  # the agreement's error rides along as its context
            raise
        if more:
            failures += more
        if local_error is not None:
            outbox.defer(failures)  # reported by the next poll
            raise local_error
        if failures:
            unknown = {id(f.completion) for f in failures if isinstance(f.error, UnknownJob)}
            raise CompletionsFailed(failures, [c for c in applied if id(c) not in unknown])
        return applied

    def complete(self, completion: Completion, *, owner: object = None) -> None:
        """Apply one completion reported by an engine-side executor.

        Raises ``UnknownJob`` (changing nothing) for a job that is not pending,
        including a second ack of the same job, and its subclass ``JobOwnerError``
        for a job the caller does not run: h2s / s2h jobs are completed by the
        storage tier alone (``owner=cache.storage``), every other job by the engine.
        ``CompletionsFailed`` if the job ended but a transition it causes raised.
        """
        self.check_open()
        self.outbox.check(completion)
        check_completion_owner(self.outbox.pending_job(completion.job_id), owner, self.storage)
        held = [completion] if self.acks is None else self.acks.hold([completion])  # a rank group: at a poll
        failures = self.outbox.apply(held)
        if failures:
            raise CompletionsFailed(failures)

    # ================================================================== observation

    def add_observer(self, fn: Callable[[dict], None]) -> None:
        """Call ``fn(event_dict)`` on every transition, job, completion and split (tracing)."""
        self.check_open()
        self.driver.add_observer(fn)

    def remove_observer(self, fn: Callable[[dict], None]) -> None:
        """Stop calling ``fn`` (added by ``add_observer``); ``ValueError`` if it was not added. Allowed once closed."""
        if not self.closed:
            self.check_open()
        self.driver.remove_observer(fn)

    def register_host_owner(self, source: HostOwners) -> None:
        """Let a runtime (prefetch, CP writes) declare host slots it holds, for invariant checks."""
        self.runtime_checks.register_host_owner(source)

    def register_invariants(self, check: Callable[[], list[str]]) -> None:
        """Add a runtime's own invariant check (returns problems) to ``check_invariants``."""
        self.runtime_checks.register_invariants(check)

    def unregister_runtimes(self) -> None:
        """Forget every registered host owner and invariant (a fork re-registers its own runtimes' copies)."""
        self.runtime_checks.clear()

    @property
    def registered_runtimes(self) -> int:
        """How many runtimes registered host owners or invariants (a fork refuses what it cannot copy)."""
        return len(self.runtime_checks)

    def invariant_violations(self) -> list[str]:
        """Every broken invariant of the residency spec and of registered runtimes, as text.

        With ``check_candidates`` set, also the maintained eviction candidate
        sets and per-state node counts against a recomputation (O(N): for
        tests, off on the hot path).
        """
        problems = []
        for name in self.residency.spec.invariants:
            problems += [f"{name}: {p}" for p in self.residency_registry.invariants[name](self)]
        problems += self.runtime_checks.problems()
        if self.check_candidates:
            problems += maintained_set_problems(self.tree, self.eviction, self.driver.state_counts)
        return problems

    def check_invariants(self) -> None:
        """Raise ``InvariantViolation`` listing every broken invariant (tests call this after every step)."""
        problems = self.invariant_violations()
        if problems:
            raise InvariantViolation(problems)

    def snapshot(self) -> dict:
        """A plain, comparable picture of the whole cache (tests compare before/after a rejected call)."""
        return snapshot(tree=self.tree, device_allocator=self.device_allocator, host_allocator=self.host_allocator,
                        engine_pages=self.engine_pages, outbox=self.outbox, ledger=self.job_ledger,
                        counters=self.counters, driver=self.driver, eviction=self.eviction, cp=self.cp)

    def stats(self) -> dict:
        """Counters (hits per tier, bytes per direction, evictions, failures) and occupancy."""
        return stats(tree=self.tree, page_size=self.page_size, device_allocator=self.device_allocator,
                     host_allocator=self.host_allocator, outbox=self.outbox, counters=self.counters,
                     storage=self.storage)

    # ================================================================== lifecycle

    def reset(self) -> None:
        """Drop every cached prefix and pending job; pools return to empty.

        Called when the engine flushes its cache (weights updated, tests).
        Waits for in-flight copies first so no executor writes into freed
        slots; with a manual executor pending jobs are marked cancelled and
        their later completions ignored. Engine-held slots are freed too.
        """
        self.check_open()
        if self.executor_can_block():
            self.flush()
            self.executor.synchronize()
            self.executor.poll()
        if self.storage is not None:
            self.storage.reset()
        self.outbox.cancel_all()
        if self.acks is not None:
            self.acks.reset()
        self.engine_pages.clear()
        self.device_allocator.reset()
        self.host_allocator.reset()
        self.tree.clear()
        self.driver.cleared()
        self.eviction.rebuild()
        if self.cp is not None:
            self.cp.reset()
        self.counters["resets"] += 1

    def close(self, drain: float = 0.0) -> None:
        """Finish in-flight copies, stop storage threads, release executor resources (engine shutdown).

        ``drain``: seconds queued storage backups may take to finish first (0: they fail); anything
        but a finite number >= 0 is refused with ``ConfigError`` before anything changes.
        """
        drain = drain_seconds(drain)
        if self.closed:
            return
        self.check_open()
        with contextlib.ExitStack() as release:  # each step runs whatever an earlier one raised (last added first)
            release.callback(self._release_pools)
            release.callback(self.executor.close)
            release.callback(setattr, self, "closed", True)
            if self.storage is not None:
                release.callback(self.storage.close, drain=drain)
            if self.executor_can_block():  # in-flight copies land first; an executor that fails still releases all
                self.flush()
                self.executor.synchronize()
                if drain and self.storage is not None:  # the landed host copies go on to storage within the drain
                    self.poll()

    def _release_pools(self) -> None:
        """The pools may serve another cache: at once, or once a storage thread past its join stopped writing."""
        if self.storage is None:
            unbind_pools(self, self.bound_allocators)
        else:
            self.storage.when_threads_stopped(lambda: unbind_pools(self, self.bound_allocators))

    def check_open(self) -> None:
        """Refuse a call unless the cache is open and the calling thread drives it.

        Every entry point, the runtimes' included, calls this first, so a
        refused call changes nothing: ``HiCacheError`` once closed,
        ``WrongThread`` from a thread that does not own the cache. The owner
        is the first thread that calls; it stays the owner until it ends or
        calls ``release_thread``. One token comparison on the hot path (see ``hicache_fsm.confinement``).
        """
        if self.closed or THIS_THREAD.token != self.thread_owner.token:
            if self.closed:
                raise HiCacheError("this cache is closed")
            self.thread_owner.adopt()

    def release_thread(self) -> None:
        """Hand the cache over: the owning thread gives it up, and the next thread that calls it adopts it.

        For an engine that moves the cache to another thread (start-up in one
        thread, serving in another is fine without it: a thread that ended
        owns nothing). Only the owner may release.
        """
        self.check_open()
        self.thread_owner.release()

    def __enter__(self) -> "HiCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def cache_from_pools(pools, config: CacheConfig | None = None, executor: Executor | None = None) -> HiCache:
    """A ``HiCache`` over ``pools.build_pools(...)``'s result (draft pools included)."""
    return HiCache(pools.device, pools.host, config, executor, pools.draft_device, pools.draft_host)
