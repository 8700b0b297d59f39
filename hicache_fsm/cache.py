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
    ... for layer in layers: lb.wait(layer); compute layer ...
    idx = cache.alloc_device(n); write KV; cache.insert(tokens, idx)
    cache.lock(node) ... cache.unlock(node)      # while a request uses the prefix
    cache.poll()                                 # flush jobs, apply completions

Every public method either does what it says or raises a typed error and
leaves the cache exactly as it was.
"""

from __future__ import annotations

import heapq
import logging
from collections import Counter
from typing import Callable, Hashable, Iterable, Sequence

import attrs
import torch

from hicache_fsm.bindings.residency import EVICTED, LOADING, ON_DEVICE, ON_HOST
from hicache_fsm.config import CacheConfig
from hicache_fsm.errors import (
    BadIndices,
    GuardRejected,
    HiCacheError,
    LockError,
    UnknownJob,
    UnknownNode,
)
from hicache_fsm.jobs import Completion, Executor, JobKind, LayerWait, TransferJob, merge_jobs
from hicache_fsm.machine import CompiledMachine, compile_machine
from hicache_fsm.radix import RadixTree, TreeNode
from hicache_fsm.registry import registry_for
from hicache_fsm.spec import load_builtin

log = logging.getLogger("hicache_fsm.cache")

DEVICE_EVICTABLE = frozenset({"device", "device_host", "device_host_storing", "device_host_stored"})
HOST_EVICTABLE = frozenset({"host", "host_stored"})
IN_FLIGHT = frozenset({"writing_host", "device_host_storing", "host_storing"}) | LOADING
RESIDENT = ON_DEVICE | LOADING  # device slots valid now or once the load's layer event fires

_DONE_TRIGGER = {JobKind.D2H: "write_done", JobKind.H2D: "load_done", JobKind.H2S: "store_done"}
_FAIL_TRIGGER = {JobKind.D2H: "write_failed", JobKind.H2D: "load_failed", JobKind.H2S: "store_failed"}


class InvariantViolation(HiCacheError):
    """``check_invariants`` found the cache in a state the specs forbid."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invariant violations:\n  " + "\n  ".join(problems))


@attrs.frozen
class DeviceGrant:
    """Context of ``revive``: the device slots the engine hands over."""

    device_indices: torch.Tensor


@attrs.frozen
class MatchResult:
    """What ``match_prefix`` found.

    ``device_indices`` cover the matched prefix that is on the device (or being
    loaded); ``host_hit_length`` tokens after it are only on the host and can be
    loaded back from ``last_host_node``.
    """

    device_indices: torch.Tensor
    last_device_node: TreeNode
    last_host_node: TreeNode
    host_hit_length: int

    @property
    def device_hit_length(self) -> int:
        return int(self.device_indices.numel())


class LoadHandle:
    """Per-layer wait handle of a load-back; flushes pending jobs on first use."""

    def __init__(self, cache: "HiCache") -> None:
        self._cache = cache
        self._wait: LayerWait | None = None

    def _bind(self, wait: LayerWait) -> None:
        self._wait = wait

    def wait(self, layer: int) -> None:
        """Block the forward pass until ``layer`` of this load is on the device."""
        if self._wait is None:
            self._cache.flush()
        assert self._wait is not None
        self._wait.wait(layer)

    def done(self) -> bool:
        return self._wait is not None and self._wait.done()


@attrs.frozen
class LoadBack:
    """A started load-back: device slots of the loaded chain (top-down) and its wait handle."""

    device_indices: torch.Tensor
    nodes: tuple[TreeNode, ...]
    handle: LoadHandle

    @property
    def last_node(self) -> TreeNode:
        return self.nodes[-1]

    def wait(self, layer: int) -> None:
        self.handle.wait(layer)


@attrs.frozen
class InsertResult:
    node: TreeNode
    cached_tokens: int  # tokens that were already in the tree (their engine slots were freed)
    new_tokens: int


@attrs.define
class JobLedger:
    """Every job emitted and how it ended; checks that each ends exactly once."""

    emitted: set[int] = attrs.Factory(set)
    acked: set[int] = attrs.Factory(set)
    failed: set[int] = attrs.Factory(set)
    duplicate_acks: list[int] = attrs.Factory(list)


class HiCache:
    """A device + host (+ storage) KV cache over a radix tree.

    ``device_pool`` / ``host_pool`` are ``pools.DeviceKVPool`` / ``pools.HostKVPool``
    (draft pools optional); ``executor`` runs D2H and H2D jobs (a
    ``TorchExecutor`` over the pools by default). ``dispatcher`` replaces the
    compiled residency machine (used to benchmark against ``transitions``).
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
    ) -> None:
        if device_pool.page_size != host_pool.page_size:
            raise HiCacheError("device and host pools must use the same page size")
        self.config = config or CacheConfig()
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.draft_device_pool = draft_device_pool
        self.draft_host_pool = draft_host_pool
        self.page_size = device_pool.page_size
        if executor is None:
            from hicache_fsm.executors import TorchExecutor

            executor = TorchExecutor(device_pool, host_pool, draft_device_pool, draft_host_pool)
        self.executor = executor
        self.residency = dispatcher or compile_machine(load_builtin("residency"))
        self._residency_registry = registry_for("residency")
        self.tree = RadixTree(self.page_size)
        self.storage = None  # the storage tier attaches itself here (see hicache_fsm.storage)
        self._outbox: list[TransferJob] = []
        self._pending: dict[int, TransferJob] = {}
        self._job_nodes: dict[int, list[TreeNode]] = {}
        self._load_handles: list[LoadHandle] = []
        self.job_ledger = JobLedger()
        self._engine_pages: set[int] = set()
        self._clock = 0
        self._polls = 0
        self._extra_host_owners: list[Callable[[], Iterable[tuple[str, torch.Tensor]]]] = []
        self._extra_invariants: list[Callable[[], list[str]]] = []
        self._observers: list[Callable[[dict], None]] = []
        self.counters: Counter[str] = Counter()
        self.closed = False

    # ================================================================== allocators and slots

    @property
    def device_allocator(self):
        return self.device_pool.allocator

    @property
    def host_allocator(self):
        return self.host_pool.allocator

    @property
    def storage_attached(self) -> bool:
        return self.storage is not None and self.storage.accepting_backups()

    def alloc_device(self, num_tokens: int) -> torch.Tensor | None:
        """Device slots for the engine to compute new KV into; hand them back via ``insert`` or ``free_device``.

        Evicts unlocked device KV when needed; None when even that is not enough.
        """
        self._check_open()
        if num_tokens % self.page_size:
            raise BadIndices(f"alloc_device wants whole pages of {self.page_size} tokens; got {num_tokens}")
        if self.device_allocator.available_tokens < num_tokens:
            self.evict(num_tokens - self.device_allocator.available_tokens)
        indices = self.device_allocator.alloc(num_tokens)
        if indices is not None:
            self._engine_pages.update(self._page_ids(indices))
        return indices

    def free_device(self, indices: torch.Tensor) -> None:
        """Return engine-held device slots that were never inserted."""
        pages = self._page_ids(self._validate_indices(indices, indices.numel(), engine_held=True))
        self.device_allocator.free(indices)
        self._engine_pages.difference_update(pages)

    def _page_ids(self, indices: torch.Tensor) -> list[int]:
        return (indices[:: self.page_size] // self.page_size).tolist()

    def _validate_indices(self, indices: object, length: int, engine_held: bool) -> torch.Tensor:
        if not isinstance(indices, torch.Tensor):
            raise BadIndices(f"device indices must be a torch.Tensor, got {type(indices).__name__}")
        if indices.dtype != torch.int64 or indices.dim() != 1:
            raise BadIndices(f"device indices must be a 1-D int64 tensor, got {indices.dtype} with shape {tuple(indices.shape)}")
        if indices.device.type != "cpu":
            raise BadIndices(f"slot indices are kept on the CPU; got a tensor on {indices.device}")
        if indices.numel() != length:
            raise BadIndices(f"expected {length} device indices, got {indices.numel()}")
        if length % self.page_size:
            raise BadIndices(f"{length} indices is not a whole number of pages of {self.page_size}")
        if length:
            pages = indices.view(-1, self.page_size)
            first = pages[:, :1]
            offsets = torch.arange(self.page_size, dtype=torch.int64, device=indices.device)
            if bool(((first % self.page_size) != 0).any()) or not torch.equal(pages, first + offsets):
                raise BadIndices("device indices must be whole pages: each page aligned and contiguous")
            if engine_held:
                page_ids = self._page_ids(indices)
                if len(set(page_ids)) != len(page_ids):
                    raise BadIndices("device indices name the same page twice")
                foreign = [p for p in page_ids if p not in self._engine_pages]
                if foreign:
                    raise BadIndices(f"device pages {foreign[:8]} were not handed out by alloc_device (or were already inserted)")
        return indices

    # ================================================================== tree operations

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _require_node(self, node: object) -> TreeNode:
        if not isinstance(node, TreeNode) or not self.tree.owns(node) or node.is_root:
            raise UnknownNode(f"{node!r} is not a live node of this cache")
        return node

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        upper = self.tree.split(node, at)
        for job_id in upper.pending_jobs:
            self._job_nodes[job_id].append(upper)
        self._notify({"event": "split", "node": node.id, "upper": upper.id, "at": at})
        return upper

    def _walk_splitting(self, tokens: tuple[int, ...], namespace: Hashable) -> tuple[list[TreeNode], int]:
        path, matched, partial = self.tree.walk(tokens, namespace)
        if partial:
            parent = path[-1] if path else self.tree.root
            child = parent.children[self.tree._child_key(namespace, tokens, matched)]
            path.append(self._split(child, partial))
            matched += partial
        return path, matched

    def match_prefix(self, tokens: Sequence[int], namespace: Hashable = None) -> MatchResult:
        """Longest cached prefix of ``tokens`` (whole pages), counted as a hit.

        Called when a request is scheduled. Nodes are split so that the match
        ends on a node boundary. Under ``write_through_selective`` nodes whose
        hit count reaches the threshold are backed up here.
        """
        self._check_open()
        tokens = tuple(tokens)
        path, _ = self._walk_splitting(tokens, namespace)
        now = self._tick()
        device_parts: list[torch.Tensor] = []
        last_device = self.tree.root
        host_hit = 0
        for node in path:
            node.hit_count += 1
            node.last_access = now
            if node.state in RESIDENT and host_hit == 0:
                device_parts.append(node.device_indices)
                last_device = node
            else:
                host_hit += node.num_tokens
        last_host = path[-1] if path else self.tree.root
        device_indices = torch.cat(device_parts) if device_parts else torch.empty(0, dtype=torch.int64)
        self.counters["match_requests"] += 1
        self.counters["device_hit_tokens"] += int(device_indices.numel())
        self.counters["host_hit_tokens"] += host_hit
        self.counters["miss_tokens"] += len(self.tree.aligned(tokens)) - int(device_indices.numel()) - host_hit
        if self.config.write_policy == "write_through_selective":
            for node in path:
                if node.state == "device" and node.hit_count >= self.config.write_through_threshold:
                    self._try_backup(node)
        return MatchResult(device_indices, last_device, last_host, host_hit)

    def insert(
        self,
        tokens: Sequence[int],
        device_indices: torch.Tensor,
        namespace: Hashable = None,
        priority: int = 0,
    ) -> InsertResult:
        """Insert a computed prefix; the cache takes ownership of ``device_indices``.

        Called when a request's KV is complete on the device (end of prefill or
        of the request). Slots of the part already cached are freed; an evicted
        part is revived with the engine's fresh slots. ``len(tokens)`` must be a
        whole number of pages and the slots must come from ``alloc_device``.
        """
        self._check_open()
        tokens = tuple(tokens)
        if len(tokens) % self.page_size:
            raise BadIndices(f"insert wants whole pages of {self.page_size} tokens; got {len(tokens)} tokens")
        self._validate_indices(device_indices, len(tokens), engine_held=True)
        path, matched = self._walk_splitting(tokens, namespace)
        now = self._tick()
        pos = 0
        duplicate: list[torch.Tensor] = []
        revived: list[TreeNode] = []
        for node in path:
            part = device_indices[pos : pos + node.num_tokens]
            pos += node.num_tokens
            node.last_access = now
            node.priority = max(node.priority, priority)
            if node.state in EVICTED - LOADING:
                self._fire(node, "revive", DeviceGrant(part))
                self._engine_pages.difference_update(self._page_ids(part))
                revived.append(node)
            else:
                duplicate.append(part)
        for part in duplicate:
            self.device_allocator.free(part)
            self._engine_pages.difference_update(self._page_ids(part))
        parent = path[-1] if path else self.tree.root
        node = parent
        if matched < len(tokens):
            node = self.tree.add_child(parent, tokens[matched:], namespace)
            node.last_access, node.priority = now, priority
            new_part = device_indices[matched:]
            node.device_indices = new_part
            self._fire(node, "insert", self)
            self._engine_pages.difference_update(self._page_ids(new_part))
            if self.config.write_policy == "write_through":
                self._try_backup(node)
        self.counters["inserted_tokens"] += len(tokens) - matched
        return InsertResult(node, matched, len(tokens) - matched)

    # ================================================================== locks

    def lock(self, node: TreeNode) -> None:
        """Pin a device-resident node and its ancestors while a request reads them."""
        node = self._require_node(node)
        chain = list(self.tree.path_to_root(node))
        off = [n.id for n in chain if n.state not in RESIDENT]
        if off:
            raise LockError(f"cannot lock node {node.id}: nodes {off} are not on the device")
        for n in chain:
            n.lock_ref += 1

    def unlock(self, node: TreeNode) -> None:
        node = self._require_node(node)
        chain = list(self.tree.path_to_root(node))
        unlocked = [n.id for n in chain if n.lock_ref <= 0]
        if unlocked:
            raise LockError(f"unlock of node {node.id} would take lock refs below zero on nodes {unlocked}")
        for n in chain:
            n.lock_ref -= 1

    def pin_host(self, node: TreeNode) -> None:
        """Protect a node's host copy from host eviction (prefetch anchors)."""
        node = self._require_node(node)
        if node.state not in ON_HOST:
            raise LockError(f"node {node.id} has no host copy to pin ({node.state})")
        node.host_ref += 1

    def unpin_host(self, node: TreeNode) -> None:
        node = self._require_node(node)
        if node.host_ref <= 0:
            raise LockError(f"unpin_host of node {node.id} would take its host ref below zero")
        node.host_ref -= 1

    # ================================================================== backup, eviction, load-back

    def write_backup(self, node: TreeNode) -> bool:
        """Back a device-only node up to host now; False if host memory stays full.

        Host full -> evict host KV -> retry -> stay device-only.
        """
        node = self._require_node(node)
        if node.state != "device":
            raise GuardRejected("residency", node.state, "backup", "only a device-only node can be backed up")
        return self._try_backup(node)

    def _try_backup(self, node: TreeNode) -> bool:
        if not self.residency.can_fire(node, "backup", self):
            self.evict_host(node.num_tokens - self.host_allocator.available_tokens)
            if not self.residency.can_fire(node, "backup", self):
                self.counters["backup_host_full"] += 1
                return False
        self._fire(node, "backup", self)
        return True

    def _sort_key(self, node: TreeNode) -> tuple:
        policy = self.config.eviction_policy
        if policy == "lfu":
            return (node.hit_count, node.last_access, node.id)
        if policy == "priority":
            return (node.priority, node.last_access, node.id)
        return (node.last_access, node.id)

    def _device_leaf(self, node: TreeNode) -> bool:
        return (
            node.state in DEVICE_EVICTABLE
            and node.lock_ref == 0
            and not any(c.state in RESIDENT or c.state == "writing_host" for c in node.children.values())
        )

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device tokens if possible; returns tokens freed.

        Picks unlocked leaves of the device-resident subtree by the eviction
        policy. Backed-up nodes just lose their device copy; a device-only node
        is dropped, except under ``write_back`` (or when it has host-only
        children), where it is backed up first and evicted once the copy lands.
        """
        self._check_open()
        freed = self._evict_pass(num_tokens)
        if freed < num_tokens and self._pending_kind(JobKind.D2H) and self.executor_can_block():
            self.flush()
            self.executor.synchronize()
            self._apply(self.executor.poll())
            freed += self._evict_pass(num_tokens - freed)
        return freed

    def executor_can_block(self) -> bool:
        """Whether waiting on the executor ends (a manual executor waits for a test)."""
        return not getattr(self.executor, "manual", False)

    def _pending_kind(self, kind: JobKind) -> bool:
        return any(j.kind is kind for j in self._outbox) or any(j.kind is kind for j in self._pending.values())

    def _evict_pass(self, num_tokens: int) -> int:
        heap = [(self._sort_key(n), n.id, n) for n in self.tree.nodes() if not n.is_root and self._device_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_tokens:
            _, _, node = heapq.heappop(heap)
            if not self._device_leaf(node):
                continue
            parent = node.parent
            if node.state == "device":
                if self.config.write_policy == "write_back" or node.children:
                    self._try_backup(node)
                    continue
                freed += node.num_tokens
                self._fire(node, "drop", self)
                self._remove(node)
            else:
                freed += node.num_tokens
                self._fire(node, "evict_device", self)
            self.counters["evicted_device_tokens"] += node.num_tokens
            if not parent.is_root and self._device_leaf(parent):
                heapq.heappush(heap, (self._sort_key(parent), parent.id, parent))
        return freed

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host tokens of nodes that are off the device.

        Only leaves leave (a host-only inner node would orphan its subtree), and
        never a node whose host copy is pinned or in flight.
        """
        self._check_open()
        if num_tokens <= 0:
            return 0
        def evictable(n: TreeNode) -> bool:
            return n.state in HOST_EVICTABLE and n.host_ref == 0 and not n.children and not n.is_root
        heap = [(self._sort_key(n), n.id, n) for n in self.tree.nodes() if evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_tokens:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            freed += node.num_tokens
            self._fire(node, "evict_host", self)
            self._remove(node)
            if evictable(parent):
                heapq.heappush(heap, (self._sort_key(parent), parent.id, parent))
        self.counters["evicted_host_tokens"] += freed
        return freed

    def _remove(self, node: TreeNode) -> None:
        self.tree.remove_leaf(node)
        self._notify({"event": "removed", "node": node.id})

    def load_back(self, node: TreeNode) -> LoadBack | None:
        """Load the evicted chain ending at ``node`` back to the device, all or nothing.

        Called after ``match_prefix`` reported a host hit, with its
        ``last_host_node``. Returns None (the engine recomputes) when there is
        nothing to load, the chain is under ``load_back_threshold`` or over
        ``load_back_max_tokens``, or device memory stays short after eviction.
        The host copies stay protected until the load is acknowledged.
        """
        self._check_open()
        node = self._require_node(node)
        chain: list[TreeNode] = []
        for n in self.tree.path_to_root(node):
            if n.state in RESIDENT:
                break
            if n.state not in EVICTED:
                raise GuardRejected("residency", n.state, "load", f"node {n.id} has no host copy to load")
            chain.append(n)
        chain.reverse()
        total = sum(n.num_tokens for n in chain)
        cfg = self.config
        if not chain or total < cfg.load_back_threshold or (cfg.load_back_max_tokens is not None and total > cfg.load_back_max_tokens):
            self.counters["load_back_skipped"] += 1 if chain else 0
            return None
        if self.device_allocator.available_tokens < total:
            for n in chain:  # keep the chain itself out of eviction's reach
                n.lock_ref += 1
            try:
                self.evict(total - self.device_allocator.available_tokens)
            finally:
                for n in chain:
                    n.lock_ref -= 1
            if self.device_allocator.available_tokens < total:
                self.counters["load_back_device_full"] += 1
                return None
        handle = LoadHandle(self)
        for n in chain:
            self._fire(n, "load", self)
        self._load_handles.append(handle)
        self.counters["loaded_back_tokens"] += total
        return LoadBack(torch.cat([n.device_indices for n in chain]), tuple(chain), handle)

    # ================================================================== jobs

    def _fire(self, node: TreeNode, trigger: str, ctx: object) -> None:
        transition = self.residency.fire(node, trigger, ctx)
        for kind in transition.emits:
            self._emit(self._build_job(kind, node))
        if self._observers:
            self._notify({"event": "transition", "machine": "residency", "node": node.id, "trigger": trigger,
                          "source": transition.source, "dest": transition.dest})

    def _build_job(self, kind: JobKind, node: TreeNode) -> TransferJob:
        draft = node.host_indices if self.draft_host_pool is not None else None
        if kind is JobKind.H2S:
            return TransferJob(kind, (node.id,), node.host_indices, keys=self.storage.keys_for(node))
        return TransferJob(kind, (node.id,), node.host_indices, node.device_indices, draft_host_indices=draft)

    def _emit(self, job: TransferJob) -> None:
        nodes = [self.tree.get(n) for n in job.node_ids]
        for n in nodes:
            n.pending_jobs.add(job.id)
        self._job_nodes[job.id] = nodes
        self._pending[job.id] = job
        self.job_ledger.emitted.add(job.id)
        if job.kind in (JobKind.H2S, JobKind.S2H):
            self.storage.submit(job)
        else:
            self._outbox.append(job)
        self.counters[f"jobs_{job.kind.value}"] += 1
        self._notify({"event": "job", "job": job.id, "kind": job.kind.value, "nodes": list(job.node_ids), "tokens": job.num_tokens})

    def pending_job_ids(self) -> list[int]:
        return list(self._pending)

    def pending_jobs(self) -> list[TransferJob]:
        return list(self._pending.values())

    def flush(self) -> None:
        """Merge queued jobs into one batch per kind and start them."""
        if not self._outbox:
            return
        jobs, self._outbox = self._outbox, []
        handles, self._load_handles = self._load_handles, []
        for batch in merge_jobs(jobs):
            wait = self.executor.submit(batch)
            if batch.kind is JobKind.H2D:
                for h in handles:
                    h._bind(wait)

    def poll(self) -> list[Completion]:
        """Start queued jobs and apply every completion that is ready.

        Called once per engine step. Also runs ``write_behind`` backups of nodes
        that went cold.
        """
        self._check_open()
        self._polls += 1
        if self.config.write_policy == "write_behind":
            self._write_behind()
        self.flush()
        done = list(self.executor.poll())
        if self.storage is not None:
            done += self.storage.poll()
        self._apply(done)
        return done

    def _write_behind(self) -> None:
        idle = self.config.write_behind_idle_steps
        budget = self.config.write_behind_batch_tokens
        cold = sorted(
            (n for n in self.tree.nodes() if n.state == "device" and self._clock - n.last_access >= idle),
            key=lambda n: (n.last_access, n.id),
        )
        for node in cold:
            if node.num_tokens > budget:
                break
            if self._try_backup(node):
                budget -= node.num_tokens

    def complete(self, completion: Completion) -> None:
        """Apply one completion reported by an engine-side executor.

        Raises ``UnknownJob`` (changing nothing) for a job that is not pending,
        including a second ack of the same job.
        """
        self._check_open()
        self._apply([completion])

    def _apply(self, completions: Iterable[Completion]) -> None:
        for c in completions:
            job = self._pending.get(c.job_id)
            if job is None:
                if c.job_id in self.job_ledger.acked or c.job_id in self.job_ledger.failed:
                    raise UnknownJob(f"job {c.job_id} was already acknowledged")
                raise UnknownJob(f"job {c.job_id} is not a job of this cache")
            del self._pending[c.job_id]
            (self.job_ledger.acked if c.ok else self.job_ledger.failed).add(c.job_id)
            nodes = self._job_nodes.pop(c.job_id)
            if job.kind is JobKind.S2H:
                continue
            trigger = (_DONE_TRIGGER if c.ok else _FAIL_TRIGGER)[job.kind]
            for node in nodes:
                node.pending_jobs.discard(c.job_id)
                self._fire(node, trigger, self)
            if c.ok:
                self.counters[f"bytes_{job.kind.value}"] += job.num_tokens * self.device_pool.shape.token_bytes
                if job.kind is JobKind.D2H and self.storage_attached:
                    for node in nodes:
                        if self.residency.can_fire(node, "store", self):
                            self._fire(node, "store", self)
            else:
                self.counters[f"failed_{job.kind.value}"] += 1
                log.warning("job %d (%s) failed: %s", c.job_id, job.kind.value, c.error)
            self._notify({"event": "completion", "job": c.job_id, "ok": c.ok})

    # ================================================================== observation

    def add_observer(self, fn: Callable[[dict], None]) -> None:
        """Call ``fn(event_dict)`` on every transition, job, completion and split (tracing)."""
        self._observers.append(fn)

    def _notify(self, event: dict) -> None:
        for fn in self._observers:
            fn(event)

    def device_slot_owners(self) -> list[tuple[str, torch.Tensor]]:
        owners = [(f"node {n.id}", n.device_indices) for n in self.tree.nodes() if n.device_indices is not None]
        if self._engine_pages:
            pages = torch.tensor(sorted(self._engine_pages), dtype=torch.int64)
            owners.append(("engine", (pages[:, None] * self.page_size + torch.arange(self.page_size)).flatten()))
        return owners

    def host_slot_owners(self) -> list[tuple[str, torch.Tensor]]:
        owners = [(f"node {n.id}", n.host_indices) for n in self.tree.nodes() if n.host_indices is not None]
        for source in self._extra_host_owners:
            owners.extend(source())
        return owners

    def register_host_owner(self, source: Callable[[], Iterable[tuple[str, torch.Tensor]]]) -> None:
        """Let a runtime (prefetch, CP writes) declare host slots it holds, for invariant checks."""
        self._extra_host_owners.append(source)

    def register_invariants(self, check: Callable[[], list[str]]) -> None:
        self._extra_invariants.append(check)

    def invariant_violations(self) -> list[str]:
        problems = []
        for name in self.residency.spec.invariants:
            problems += [f"{name}: {p}" for p in self._residency_registry.invariants[name](self)]
        for check in self._extra_invariants:
            problems += check()
        return problems

    def check_invariants(self) -> None:
        """Raise ``InvariantViolation`` listing every broken invariant (tests call this after every step)."""
        problems = self.invariant_violations()
        if problems:
            raise InvariantViolation(problems)

    def snapshot(self) -> dict:
        """A plain, comparable picture of the whole cache (tests compare before/after a rejected call)."""
        def idx(t):
            return None if t is None else t.tolist()
        return {
            "nodes": sorted(
                (n.id, n.parent.id if n.parent else None, n.key, n.state, idx(n.device_indices), idx(n.host_indices),
                 n.lock_ref, n.host_ref, n.hit_count, tuple(sorted(n.pending_jobs)))
                for n in self.tree.nodes()
            ),
            "device_free": self.device_allocator.free_pages,
            "host_free": self.host_allocator.free_pages,
            "device_owned": sorted(self.device_allocator.owned_pages()),
            "host_owned": sorted(self.host_allocator.owned_pages()),
            "engine_pages": sorted(self._engine_pages),
            "pending": sorted(self._pending),
            "outbox": [j.id for j in self._outbox],
        }

    def stats(self) -> dict:
        """Counters (hits per tier, bytes per direction, evictions, failures) and occupancy."""
        out = dict(self.counters)
        out.update(
            nodes=len(self.tree),
            device_used_tokens=self.device_allocator.used_pages * self.page_size,
            device_free_tokens=self.device_allocator.available_tokens,
            host_used_tokens=self.host_allocator.used_pages * self.page_size,
            host_free_tokens=self.host_allocator.available_tokens,
            pending_jobs=len(self._pending),
        )
        if self.storage is not None:
            out["storage"] = self.storage.stats()
        return out

    # ================================================================== lifecycle

    def reset(self) -> None:
        """Drop every cached prefix and pending job; pools return to empty.

        Waits for in-flight copies first so no executor writes into freed slots.
        """
        self._check_open()
        if self.executor_can_block():
            self.flush()
            self.executor.synchronize()
            self.executor.poll()
        if self.storage is not None:
            self.storage.reset()
        self._outbox.clear()
        self._pending.clear()
        self._job_nodes.clear()
        self._load_handles.clear()
        self._engine_pages.clear()
        self.device_allocator.reset()
        self.host_allocator.reset()
        self.tree = RadixTree(self.page_size)
        self.counters["resets"] += 1

    def close(self) -> None:
        """Finish in-flight copies, stop storage threads, release executor resources."""
        if self.closed:
            return
        if self.executor_can_block():
            self.flush()
            self.executor.synchronize()
        if self.storage is not None:
            self.storage.close()
        self.executor.close()
        self.closed = True

    def _check_open(self) -> None:
        if self.closed:
            raise HiCacheError("this cache is closed")

    def __enter__(self) -> "HiCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def cache_from_pools(pools, config: CacheConfig | None = None, executor: Executor | None = None) -> HiCache:
    """A ``HiCache`` over ``pools.build_pools(...)``'s result (draft pools included)."""
    return HiCache(pools.device, pools.host, config, executor, pools.draft_device, pools.draft_host)
