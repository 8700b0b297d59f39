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
from hicache_fsm.jobs import Completion, Executor, JobBatch, JobKind, LayerWait, TransferJob, merge_jobs
from hicache_fsm.machine import CompiledMachine, compile_machine
from hicache_fsm.radix import RadixTree, TreeNode
from hicache_fsm.registry import registry_for
from hicache_fsm.spec import load_builtin
from hicache_fsm.acks import AckAgreement
from hicache_fsm.tp import RankGroup, StepAgreement

log = logging.getLogger("hicache_fsm.cache")

DEVICE_EVICTABLE = frozenset({"device", "device_host", "device_host_storing", "device_host_stored"})
HOST_EVICTABLE = frozenset({"host", "host_stored"})
RESIDENT = ON_DEVICE | LOADING  # device slots valid now or once the load's layer event fires
REVIVABLE = EVICTED - LOADING

_DONE_TRIGGER = {JobKind.D2H: "write_done", JobKind.H2D: "load_done", JobKind.H2S: "store_done"}
_FAIL_TRIGGER = {JobKind.D2H: "write_failed", JobKind.H2D: "load_failed", JobKind.H2S: "store_failed"}
_EMPTY = torch.empty(0, dtype=torch.int64)
_JOBS_KEY = {k: f"jobs_{k.value}" for k in JobKind}
_BYTES_KEY = {k: f"bytes_{k.value}" for k in JobKind}
_STORAGE_KINDS = frozenset({JobKind.H2S, JobKind.S2H})  # run by the storage tier, not the executor
_FAILED_KEY = {k: f"failed_{k.value}" for k in JobKind}


class InvariantViolation(HiCacheError):
    """``check_invariants`` found the cache in a state the specs forbid."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invariant violations:\n  " + "\n  ".join(problems))


class LoadCancelled(HiCacheError):
    """``wait`` on a load that ``reset`` dropped before it was started."""


@attrs.frozen
class DeviceGrant:
    """Context of ``revive``: the device slots the engine hands over."""

    device_indices: torch.Tensor


class LoadHandle:
    """Per-layer wait of one load-back.

    Binds to the executor's wait when the load's batch is started (the first
    ``wait`` flushes the outbox if needed). It also waits for loads of
    ancestors that were still in flight when this load started, so reading
    layer ``i`` of the whole prefix is safe once ``wait(i)`` returns. A load
    retried after a failure re-binds to the retry's batch.
    """

    def __init__(self, cache: "HiCache", deps: Sequence["LoadHandle"] = ()) -> None:
        self._cache = cache
        self._wait: LayerWait | None = None
        self._deps = tuple(deps)
        self.cancelled = False

    def _bind(self, wait: LayerWait) -> None:
        self._wait = wait

    def wait(self, layer: int) -> None:
        """Block the forward pass until ``layer`` of this load (and of loading ancestors) is on the device."""
        for dep in self._deps:
            dep.wait(layer)
        if self._wait is None and not self.cancelled:
            self._cache.flush()
        if self._wait is None:
            raise LoadCancelled("this load was dropped by reset() before it started")
        self._wait.wait(layer)

    def done(self) -> bool:
        return self._wait is not None and self._wait.done() and all(d.done() for d in self._deps)


@attrs.frozen
class MatchResult:
    """What ``match_prefix`` found.

    ``device_indices`` cover the matched prefix that is on the device (or being
    loaded); ``host_hit_length`` tokens after it are only on the host and can be
    loaded back from ``last_host_node``. ``loads`` are the in-flight loads
    that cover part of ``device_indices``: ``wait(layer)`` before reading a layer.
    """

    device_indices: torch.Tensor
    last_device_node: TreeNode
    last_host_node: TreeNode
    host_hit_length: int
    loads: tuple[LoadHandle, ...] = ()

    @property
    def device_hit_length(self) -> int:
        return int(self.device_indices.numel())

    def wait(self, layer: int) -> None:
        """Wait until ``layer`` of every load covering ``device_indices`` has landed (no-op if none)."""
        for handle in self.loads:
            handle.wait(layer)


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
    cached_tokens: int  # tokens that were already in the tree (engine slots there were freed)
    new_tokens: int


@attrs.define
class JobLedger:
    """How every emitted job ended, in memory that stays bounded on a long-running server.

    The counts cover the cache's whole life, so "every emitted job is pending
    or ended exactly once" is an equation. Ids are remembered for the last
    ``window`` ended jobs only: enough to tell a re-delivered ack (an error) or
    a late ack of a job ``reset`` cancelled (ignored) from an unknown job.
    """

    window: int = 65536
    emitted: int = 0
    acked: int = 0
    failed: int = 0
    cancelled: int = 0
    recent: dict[int, str] = attrs.Factory(dict)  # job id -> "acked" | "failed" | "cancelled", oldest first

    def ended(self, job_id: int, how: str) -> None:
        """Record that ``job_id`` ended ``how``: "acked", "failed" or "cancelled"."""
        setattr(self, how, getattr(self, how) + 1)
        recent = self.recent
        recent[job_id] = how
        if len(recent) > self.window:
            del recent[next(iter(recent))]


def _batches(jobs: list[TransferJob]) -> list[JobBatch]:
    """``merge_jobs``, without concatenating the indices of a group that has one job."""
    if len(jobs) == 1:
        j = jobs[0]
        return [JobBatch(j.kind, (j,), j.host_indices, j.device_indices, j.layer, j.draft_host_indices)]
    return merge_jobs(jobs)


def _as_tokens(tokens: object) -> tuple:
    if isinstance(tokens, tuple):
        return tokens
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise BadIndices(f"token ids must be a 1-D integer tensor, got {tokens.dtype} with shape {tuple(tokens.shape)}")
        return tuple(tokens.tolist())
    try:
        return tuple(tokens)  # type: ignore[arg-type]
    except TypeError:
        raise BadIndices(f"token ids must be a sequence of ints, got {type(tokens).__name__}") from None


class HiCache:
    """A device + host (+ storage) KV cache over a radix tree.

    ``device_pool`` / ``host_pool`` are ``pools.DeviceKVPool`` / ``pools.HostKVPool``
    (draft pools optional); ``executor`` runs D2H and H2D jobs (a
    ``TorchExecutor`` over the pools by default). ``dispatcher`` replaces the
    compiled residency machine: anything with ``fire / select / can_fire /
    spec / add_listener`` (used to benchmark against ``transitions``).
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
        self.cp = None  # a CP layer-write runtime attaches itself here (see hicache_fsm.layer_write)
        self._outbox: list[TransferJob] = []
        self._pending: dict[int, TransferJob] = {}
        self._job_nodes: dict[int, list[TreeNode]] = {}
        self._load_handles: list[LoadHandle] = []  # handles whose load is still in the outbox
        self._job_handle: dict[int, LoadHandle] = {}  # pending h2d job -> the handle waiting on it
        self.job_ledger = JobLedger()
        self._engine_pages: set[int] = set()
        self._offsets = torch.arange(self.page_size, dtype=torch.int64)
        self._token_bytes = device_pool.shape.token_bytes
        self._clock = 0
        self._polls = 0
        self._memo: tuple | None = None  # the last tree walk (see _walk)
        self._extra_host_owners: list[Callable[[], Iterable[tuple[str, torch.Tensor]]]] = []
        self._extra_invariants: list[Callable[[], list[str]]] = []
        self._observers: list[Callable[[dict], None]] = []
        self.counters: Counter[str] = Counter()
        self.closed = False
        # --- tensor parallelism (hicache_fsm.tp): ranks agree on what each observes alone
        self.group = RankGroup.of(group)
        self.agreement = StepAgreement(self.group)
        self.acks = None if self.group.solo else AckAgreement(self)
        if self.acks is not None:
            self.agreement.register(self.acks)

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
        """Device slots for the engine to compute new KV into.

        Called before a prefill/extend writes KV for tokens the cache did not
        have. Hand the slots back through ``insert`` (the cache takes them) or
        ``free_device`` (aborted request). Evicts unlocked device KV when
        needed; returns None when even that is not enough.
        """
        self._check_open()
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise BadIndices(f"alloc_device wants a non-negative int token count; got {num_tokens!r}")
        if num_tokens % self.page_size:
            raise BadIndices(f"alloc_device wants whole pages of {self.page_size} tokens; got {num_tokens}")
        if self.device_allocator.available_tokens < num_tokens:
            self.evict(num_tokens - self.device_allocator.available_tokens)
        indices = self.device_allocator.alloc(num_tokens)
        if indices is not None:
            self._engine_pages.update(self._page_ids(indices))
        return indices

    def free_device(self, indices: torch.Tensor) -> None:
        """Return device slots from ``alloc_device`` that will not be inserted (aborted request)."""
        self._check_open()
        pages = self._check_tensor(indices, None)
        self._check_engine_pages(pages)
        self.device_allocator.free(indices)
        self._engine_pages.difference_update(pages)

    def _page_ids(self, indices: torch.Tensor) -> list[int]:
        return (indices.numpy()[:: self.page_size] // self.page_size).tolist()

    def _check_tensor(self, indices: object, length: int | None) -> list[int]:
        """Type, dtype, device, length and page alignment of an engine index tensor; returns its page ids."""
        if not isinstance(indices, torch.Tensor):
            raise BadIndices(f"device indices must be a torch.Tensor, got {type(indices).__name__}")
        if indices.dtype != torch.int64 or indices.dim() != 1:
            raise BadIndices(
                f"device indices must be a 1-D int64 tensor, got {indices.dtype} with shape {tuple(indices.shape)}"
            )
        if not indices.is_cpu:
            raise BadIndices(f"slot indices are kept on the CPU; got a tensor on {indices.device}")
        n = indices.numel()
        if length is not None and n != length:
            raise BadIndices(f"expected {length} device indices (one per token), got {n}")
        ps = self.page_size
        if n % ps:
            raise BadIndices(f"{n} indices is not a whole number of pages of {ps} tokens")
        if not n:
            return []
        a = indices.numpy()
        pages = self.device_allocator.whole_pages(a)
        if pages is not None:
            return pages.tolist()
        raise BadIndices(f"device indices {self.device_allocator.not_whole_pages_reason(a)}")

    def _node_pages(self, node: TreeNode) -> list[int]:
        """Page ids of a node's device slots, remembered for as long as the node keeps the same tensor."""
        memo = node.page_memo
        indices = node.device_indices
        if memo is not None and memo[0] is indices:
            return memo[1]
        pages = self._page_ids(indices)
        node.page_memo = (indices, pages)
        return pages

    def _check_engine_pages(self, page_ids: list[int]) -> None:
        if len(self._engine_pages.intersection(page_ids)) == len(page_ids):  # all handed out, none twice
            return
        if len(set(page_ids)) != len(page_ids):
            raise BadIndices("device indices name the same page twice")
        foreign = [p for p in page_ids if p not in self._engine_pages]
        if foreign:
            raise BadIndices(
                f"device pages {foreign[:8]} were not handed out by alloc_device (or were already inserted or freed)"
            )

    # ================================================================== tree operations

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _require_node(self, node: object) -> TreeNode:
        if not isinstance(node, TreeNode) or node.is_root or not self.tree.owns(node):
            raise UnknownNode(f"{node!r} is not a live node of this cache (removed, split off, or from another cache)")
        return node

    def _is_root(self, node: object) -> bool:
        return node is self.tree.root

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        upper = self.tree.split(node, at)
        if self.cp is not None:  # CP host slots cover owned pages only: split them by ownership
            self.cp.on_split(node, upper, at)
        for job_id in upper.pending_jobs:
            nodes = self._job_nodes.get(job_id)
            if nodes is not None:
                nodes.append(upper)
        if self._observers:
            self._notify({"event": "split", "node": node.id, "upper": upper.id, "at": at})
        return upper

    def _walk_splitting(self, tokens: tuple, namespace: Hashable) -> tuple[list[TreeNode], int]:
        path, matched, partial = self._walk(tokens, namespace)
        if partial:
            path = list(path)
            parent = path[-1] if path else self.tree.root
            child = parent.children[(namespace, tokens[matched : matched + self.page_size])]
            path.append(self._split(child, partial))
            matched += partial
            self._memo = (tokens, namespace, self.tree, self.tree.version, (path, matched, 0))
        return path, matched

    def _walk(self, tokens: tuple, namespace: Hashable) -> tuple[list[TreeNode], int, int]:
        """``tree.walk``, remembered for the same token tuple while the tree keeps its shape.

        An engine calls ``match_prefix(tokens)`` and then ``insert(tokens, ...)``
        with the same prefix; comparing thousands of token ids twice is the
        largest cost of a request, so the second walk reuses the first when
        nothing was split, added or removed in between (tuples are immutable).
        """
        memo = self._memo
        tree = self.tree
        if memo is not None and memo[0] is tokens and memo[2] is tree and memo[3] == tree.version and (
            memo[1] is namespace or memo[1] == namespace
        ):
            return memo[4]
        try:
            result = tree.walk(tokens, namespace)
        except TypeError as exc:  # an unhashable namespace or token
            raise BadIndices(f"namespace and token ids must be hashable: {exc}") from None
        self._memo = (tokens, namespace, tree, tree.version, result)
        return result

    def _handles_of(self, node: TreeNode) -> list[LoadHandle]:
        return [self._job_handle[j] for j in node.pending_jobs if j in self._job_handle]

    def match_prefix(self, tokens: Sequence[int], namespace: Hashable = None) -> MatchResult:
        """Longest cached prefix of ``tokens`` (whole pages), counted as a hit.

        Called when a request is scheduled, before deciding what to compute.
        A node that only partly matches is split so that the match ends on a
        node boundary. Under ``write_through_selective`` nodes whose hit count
        reaches the threshold are backed up here.
        """
        self._check_open()
        tokens = _as_tokens(tokens)
        path, _ = self._walk_splitting(tokens, namespace)  # a bad namespace fails before any split
        now = self._tick()
        polls = self._polls
        device_parts: list[torch.Tensor] = []
        loads: list[LoadHandle] = []
        last_device = self.tree.root
        host_hit = 0
        for node in path:
            node.hit_count += 1
            node.last_access = now
            node.last_poll = polls
            if host_hit == 0 and node.state in RESIDENT:
                device_parts.append(node.device_indices)
                last_device = node
                if node.state in LOADING:
                    for h in self._handles_of(node):
                        if h not in loads:
                            loads.append(h)
            else:
                host_hit += node.num_tokens
        last_host = path[-1] if path else self.tree.root
        if not device_parts:
            device_indices = _EMPTY
        elif len(device_parts) == 1:
            device_indices = device_parts[0]
        else:
            device_indices = torch.cat(device_parts)
        device_hit = int(device_indices.numel())
        c = self.counters
        c["match_requests"] += 1
        c["device_hit_tokens"] += device_hit
        c["host_hit_tokens"] += host_hit
        c["miss_tokens"] += len(tokens) - len(tokens) % self.page_size - device_hit - host_hit
        if self.config.write_policy == "write_through_selective":
            self._selective_backups(path)
        return MatchResult(device_indices, last_device, last_host, host_hit, tuple(loads))

    def _selective_backups(self, path: Sequence[TreeNode]) -> None:
        """Back up matched nodes that reached the hit threshold.

        A backup may evict host KV to make room; the host copies of the match
        being returned are pinned meanwhile so it cannot evict its own result.
        """
        threshold = self.config.write_through_threshold
        due = [n for n in path if n.state == "device" and n.hit_count >= threshold]
        if not due:
            return
        pinned = [n for n in path if n.state in ON_HOST]
        for n in pinned:
            n.host_ref += 1
        try:
            for node in due:
                self._try_backup(node)
        finally:
            for n in pinned:
                n.host_ref -= 1

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
        views of ``device_indices``: hand over a tensor you will not modify
        (clone a view of a reused buffer such as a request-to-token table).
        """
        self._check_open()
        tokens = _as_tokens(tokens)
        ps = self.page_size
        if len(tokens) % ps:
            raise BadIndices(f"insert wants whole pages of {ps} tokens; got {len(tokens)} tokens")
        page_ids = self._check_tensor(device_indices, len(tokens))
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise BadIndices(f"priority must be an int, got {priority!r}")
        path, matched, partial = self._walk(tokens, namespace)
        # ---- validate every page before changing anything
        own: list[int | None] = []
        for node in path:
            if node.state in RESIDENT:
                own.extend(self._node_pages(node))
            else:
                own.extend([None] * (node.num_tokens // ps))
        if partial:
            child = (path[-1] if path else self.tree.root).children[(namespace, tokens[matched : matched + ps])]
            if child.state in RESIDENT:
                own.extend(self._page_ids(child.device_indices[:partial]))
            else:
                own.extend([None] * (partial // ps))
        n_own = len(own)
        if own == page_ids[:n_own]:  # the usual case: the cached part is the cache's own slots
            engine = page_ids[n_own:]
        else:
            engine = [p for i, p in enumerate(page_ids) if i >= n_own or own[i] != p]
        self._check_engine_pages(engine)
        # ---- apply
        if partial:
            path, matched = self._walk_splitting(tokens, namespace)
        now = self._tick()
        polls = self._polls
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
                self._fire(node, "revive", DeviceGrant(device_indices[pos - size : pos]))
                self._engine_pages.difference_update(page_ids[first : first + size // ps])
                self.counters["revived_tokens"] += size
            elif own[first : first + size // ps] != page_ids[first : first + size // ps]:
                duplicate.append(device_indices[pos - size : pos])
        for part in duplicate:
            pages = self._page_ids(part)
            mine = [i for i, p in enumerate(pages) if p in self._engine_pages]
            if len(mine) != len(pages):  # some pages were the node's own: free only the engine's
                part = torch.cat([part[i * ps : (i + 1) * ps] for i in mine]) if mine else _EMPTY
                pages = [pages[i] for i in mine]
            if pages:
                self.device_allocator.free(part)
                self._engine_pages.difference_update(pages)
        node = path[-1] if path else self.tree.root
        if matched < len(tokens):
            parent = node
            node = self.tree.add_child(parent, tokens, namespace, matched)
            node.last_access, node.priority, node.last_poll = now, priority, polls
            node.device_indices = device_indices[matched : len(tokens)]  # an explicit stop slices faster
            new_pages = page_ids[matched // ps :]
            node.page_memo = (node.device_indices, new_pages)
            self._fire(node, "insert", self)
            self._engine_pages.difference_update(new_pages)
        if self.config.write_policy == "write_through":
            # new node, plus any node on the path whose earlier backup failed or was refused
            for n in path:
                if n.state == "device":
                    self._try_backup(n)
            if matched < len(tokens):
                self._try_backup(node)
        self.counters["inserted_tokens"] += len(tokens) - matched
        return InsertResult(node, matched, len(tokens) - matched)

    # ================================================================== locks

    def lock(self, node: TreeNode) -> None:
        """Pin a device-resident (or loading) node and its ancestors on the device.

        Called when a request starts using a matched or loaded prefix; the
        root is accepted and ignored. Pair every call with ``unlock``.
        """
        self._check_open()
        if self._is_root(node):
            return
        node = self._require_node(node)
        chain = list(self.tree.path_to_root(node))
        off = [n.id for n in chain if n.state not in RESIDENT]
        if off:
            raise LockError(f"cannot lock node {node.id}: nodes {off} are not on the device")
        for n in chain:
            n.lock_ref += 1

    def unlock(self, node: TreeNode) -> None:
        """Release a ``lock`` when the request that took it no longer reads the prefix."""
        self._check_open()
        if self._is_root(node):
            return
        node = self._require_node(node)
        chain = list(self.tree.path_to_root(node))
        unlocked = [n.id for n in chain if n.lock_ref <= 0]
        if unlocked:
            raise LockError(f"unlock of node {node.id} would take lock refs below zero on nodes {unlocked}")
        for n in chain:
            n.lock_ref -= 1

    def pin_host(self, node: TreeNode) -> None:
        """Protect a node's host copy from host eviction (prefetch anchors, storage readers)."""
        self._check_open()
        node = self._require_node(node)
        if node.state not in ON_HOST:
            raise LockError(f"node {node.id} has no host copy to pin ({node.state})")
        node.host_ref += 1

    def unpin_host(self, node: TreeNode) -> None:
        """Release a ``pin_host``."""
        self._check_open()
        node = self._require_node(node)
        if node.host_ref <= 0:
            raise LockError(f"unpin_host of node {node.id} would take its host ref below zero")
        node.host_ref -= 1

    # ================================================================== backup, eviction, load-back

    def write_backup(self, node: TreeNode) -> bool:
        """Back a device-only node up to host now; False if host memory stays full.

        For engines that decide backups themselves (any write policy). Host
        full -> evict host KV -> retry -> the node stays device-only (False).
        """
        self._check_open()
        node = self._require_node(node)
        if node.state != "device":
            raise GuardRejected("residency", node.state, "backup", f"node {node.id}: only a device-only node can be backed up")
        return self._try_backup(node)

    def _try_backup(self, node: TreeNode) -> bool:
        if self.cp is not None:  # CP: owned pages only, copied layer by layer (hicache_fsm.layer_write)
            return self.cp.backup(node)
        if self.host_allocator.available_tokens < node.num_tokens:
            self.evict_host(node.num_tokens - self.host_allocator.available_tokens)
        try:
            self._fire(node, "backup", self)
        except GuardRejected:  # host still full after host eviction
            self.counters["backup_host_full"] += 1
            return False
        return True

    def _sort_key(self, node: TreeNode) -> tuple:
        policy = self.config.eviction_policy
        if policy == "lfu":
            return (node.hit_count, node.last_access, node.id)
        if policy == "priority":
            return (node.priority, node.last_access, node.id)
        return (node.last_access, node.id)

    def _device_leaf(self, node: TreeNode) -> bool:
        """Unlocked, device-evictable, and no child on (or coming to) the device."""
        if node.state not in DEVICE_EVICTABLE or node.lock_ref != 0:
            return False
        for c in node.children.values():
            if c.state in RESIDENT:
                return False
        return True

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
        self._check_open()
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
            raise BadIndices(f"evict wants an int token count; got {num_tokens!r}")
        if num_tokens <= 0:
            return 0
        tried: set[int] = set()
        freed, _ = self._evict_pass(num_tokens, tried)
        while freed < num_tokens and self.executor_can_block() and self._pending_kind(JobKind.D2H):
            self.flush()
            self.executor.synchronize()
            self._apply(self._agreed(list(self.executor.poll())))
            more, started = self._evict_pass(num_tokens - freed, tried)
            freed += more
            if not more and not started:
                break
        return freed

    def executor_can_block(self) -> bool:
        """Whether waiting on the executor ends (a manual executor waits for a test)."""
        manual = getattr(self.executor, "manual", None)
        if manual is None:
            from hicache_fsm.executors import ManualExecutor

            manual = isinstance(self.executor, ManualExecutor)
        return not manual

    def _pending_kind(self, kind: JobKind) -> bool:
        return any(j.kind is kind for j in self._pending.values())

    def _evict_pass(self, num_tokens: int, tried: set[int]) -> tuple[int, int]:
        heap = [(self._sort_key(n), n) for n in self.tree.nodes() if not n.is_root and self._device_leaf(n)]
        heapq.heapify(heap)
        freed = started = 0
        keep_unbacked = self.config.write_policy in ("write_back", "write_behind")
        while heap and freed < num_tokens:
            _, node = heapq.heappop(heap)
            if not self._device_leaf(node):
                continue
            parent = node.parent
            if node.state == "device":
                if keep_unbacked or node.children:
                    if node.id in tried:
                        continue
                    tried.add(node.id)
                    if self._try_backup(node):
                        started += 1
                        continue
                    if node.children:
                        continue  # dropping it would orphan its host-only children
                    self.counters["dropped_unbacked_tokens"] += node.num_tokens
                freed += node.num_tokens
                self._fire(node, "drop", self)
                self._remove(node)
            else:
                freed += node.num_tokens
                self._fire(node, "evict_device", self)
            self.counters["evicted_device_tokens"] += node.num_tokens
            if not parent.is_root and self._device_leaf(parent):
                heapq.heappush(heap, (self._sort_key(parent), parent))
        return freed, started

    def evict_node(self, node: TreeNode) -> int:
        """Take one node's KV off the device now; returns the tokens freed.

        For an engine that knows a prefix will not be reused (or tests). The
        node must be unlocked, have no child on the device, and not be in
        flight. A backed-up node keeps its host copy; a device-only leaf is
        dropped under ``write_through(_selective)`` and refused under
        ``write_back`` / ``write_behind`` (back it up first).
        """
        self._check_open()
        node = self._require_node(node)
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
            if self.config.write_policy in ("write_back", "write_behind"):
                raise GuardRejected("residency", node.state, "drop",
                                    f"node {node.id} is not backed up under {self.config.write_policy}; back it up first")
            self._fire(node, "drop", self)
            self._remove(node)
        else:
            self._fire(node, "evict_device", self)
        self.counters["evicted_device_tokens"] += node.num_tokens
        return node.num_tokens

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host tokens of nodes that are off the device.

        Called by backups when host memory is short, or by an engine/prefetch
        that needs host room. Only leaves leave (a host-only inner node would
        orphan its subtree); a parent becomes a candidate when its last child
        goes. Never a node whose host copy is pinned or in flight.
        """
        self._check_open()
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
            raise BadIndices(f"evict_host wants an int token count; got {num_tokens!r}")
        if num_tokens <= 0:
            return 0

        def evictable(n: TreeNode) -> bool:
            return n.state in HOST_EVICTABLE and n.host_ref == 0 and not n.children and not n.is_root

        heap = [(self._sort_key(n), n) for n in self.tree.nodes() if evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_tokens:
            _, node = heapq.heappop(heap)
            parent = node.parent
            freed += node.num_tokens
            self._fire(node, "evict_host", self)
            self._remove(node)
            if evictable(parent):
                heapq.heappush(heap, (self._sort_key(parent), parent))
        self.counters["evicted_host_tokens"] += freed
        return freed

    def _remove(self, node: TreeNode) -> None:
        self.tree.remove_leaf(node)
        if self._observers:
            self._notify({"event": "removed", "node": node.id})

    def _evicted_chain(self, node: TreeNode) -> tuple[list[TreeNode], TreeNode]:
        """The host-only chain ending at ``node`` (top-down) and the resident ancestor above it."""
        chain: list[TreeNode] = []
        anchor = self.tree.root
        for n in self.tree.path_to_root(node):
            if n.state in RESIDENT:
                anchor = n
                break
            if n.state not in REVIVABLE:
                raise GuardRejected("residency", n.state, "load", f"node {n.id} has no host copy to load")
            chain.append(n)
        chain.reverse()
        return chain, anchor

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
        self._check_open()
        if self._is_root(node):
            return None
        node = self._require_node(node)
        chain, anchor = self._evicted_chain(node)
        if not chain:
            return None
        total = sum(n.num_tokens for n in chain)
        cfg = self.config
        if total < cfg.load_back_threshold or (cfg.load_back_max_tokens is not None and total > cfg.load_back_max_tokens):
            self.counters["load_back_skipped"] += 1
            return None
        if not self._all_ranks_have_room(total):
            # the anchor (and so its ancestors) must stay on the device, and the
            # chain's host copies must survive host eviction done by backups
            anchor_locked = not anchor.is_root
            if anchor_locked:
                for n in self.tree.path_to_root(anchor):
                    n.lock_ref += 1
            for n in chain:
                n.host_ref += 1
            try:
                self.evict(total - self.device_allocator.available_tokens)
            finally:
                for n in chain:
                    n.host_ref -= 1
                if anchor_locked:
                    for n in self.tree.path_to_root(anchor):
                        n.lock_ref -= 1
            if not self._all_ranks_have_room(total):
                self.counters["load_back_device_full"] += 1
                return None
            if not all(self.tree.owns(n) for n in chain) or self._evicted_chain(node) != (chain, anchor):
                self.counters["load_back_raced"] += 1  # completions applied while waiting changed the chain
                return None
        deps: list[LoadHandle] = []
        for n in self.tree.path_to_root(anchor) if not anchor.is_root else ():
            if n.state not in LOADING:
                break
            for h in self._handles_of(n):
                if h not in deps:
                    deps.append(h)
        if self.cp is not None and self.cp.prepare_load(chain) is None:  # CP: replay the saved owner pattern
            self.counters["load_back_device_full"] += 1
            return None
        for n in chain:
            self._fire(n, "load", self, emit=False)
        handle = LoadHandle(self, deps)
        device_indices = torch.cat([n.device_indices for n in chain]) if len(chain) > 1 else chain[0].device_indices
        self._emit_load(chain, handle)
        self.counters["loaded_back_tokens"] += total
        return LoadBack(device_indices, tuple(chain), handle)

    def _all_ranks_have_room(self, tokens: int) -> bool:
        """Free device memory for ``tokens`` on every rank (one collective with a rank group)."""
        return self.group.all_true(self.device_allocator.available_tokens >= tokens)

    def _emit_load(self, nodes: list[TreeNode], handle: LoadHandle) -> TransferJob:
        if self.cp is not None:  # CP: only this rank's pages move (an empty job if it owns none)
            job = self.cp.load_job(nodes)
        else:
            host = torch.cat([n.host_indices for n in nodes]) if len(nodes) > 1 else nodes[0].host_indices
            device = torch.cat([n.device_indices for n in nodes]) if len(nodes) > 1 else nodes[0].device_indices
            job = TransferJob(
                JobKind.H2D, tuple(n.id for n in nodes), host, device,
                draft_host_indices=host if self.draft_host_pool is not None else None,
            )
        self._emit(job)
        self._job_handle[job.id] = handle
        self._load_handles.append(handle)
        return job

    # ================================================================== jobs

    def _fire(self, node: TreeNode, trigger: str, ctx: object, emit: bool = True):
        transition = self.residency.fire(node, trigger, ctx)
        if emit:
            for kind in transition.emits:
                self._emit(self._build_job(kind, node), [node])
        if self._observers:
            self._notify({"event": "transition", "machine": "residency", "node": node.id, "trigger": trigger,
                          "source": transition.source, "dest": transition.dest})
        return transition

    def _build_job(self, kind: JobKind, node: TreeNode) -> TransferJob:
        if kind is JobKind.H2S:
            return TransferJob(kind, (node.id,), node.host_indices, keys=self.storage.keys_for(node))
        draft = node.host_indices if self.draft_host_pool is not None else None
        return TransferJob(kind, (node.id,), node.host_indices, node.device_indices, draft_host_indices=draft)

    def _emit(self, job: TransferJob, nodes: list[TreeNode] | None = None) -> None:
        """Register ``job`` as pending on its nodes (``nodes``: those of ``job.node_ids``, when at hand) and queue it."""
        if nodes is None:
            nodes = [self.tree.get(n) for n in job.node_ids]
        for n in nodes:
            n.pending_jobs.add(job.id)
        self._job_nodes[job.id] = nodes
        self._pending[job.id] = job
        self.job_ledger.emitted += 1
        if job.kind in _STORAGE_KINDS:
            self.storage.submit(job)
        else:
            self._outbox.append(job)
        self.counters[_JOBS_KEY[job.kind]] += 1
        if self._observers:
            self._notify({"event": "job", "job": job.id, "kind": job.kind.value, "nodes": list(job.node_ids),
                          "tokens": job.num_tokens})

    def is_pending(self, job_id: int) -> bool:
        """Whether ``job_id`` was emitted and not yet acknowledged."""
        return job_id in self._pending

    def pending_job_ids(self) -> list[int]:
        """Ids of jobs emitted and not yet acknowledged (queued or running), oldest first."""
        return list(self._pending)

    def pending_jobs(self) -> list[TransferJob]:
        """The pending jobs themselves (tests, tracing, an engine-side executor)."""
        return list(self._pending.values())

    def flush(self) -> None:
        """Merge queued jobs into one batch per kind and start them.

        ``poll`` calls it; call it directly to start copies earlier in a step.
        If the executor refuses a batch, the unstarted jobs stay queued.
        """
        if not self._outbox:
            return
        jobs, self._outbox = self._outbox, []
        handles, self._load_handles = self._load_handles, []
        batches = _batches(jobs)
        for i, batch in enumerate(batches):
            try:
                wait = self.executor.submit(batch)
            except BaseException:
                self._outbox = [j for b in batches[i:] for j in b.jobs] + self._outbox
                if any(b.kind is JobKind.H2D for b in batches[i:]):
                    self._load_handles = handles + self._load_handles
                raise
            if batch.kind is JobKind.H2D:
                for h in handles:
                    h._bind(wait)

    def poll(self) -> list[Completion]:
        """Start queued jobs and apply every completion that is ready.

        Called once per engine step. Also runs ``write_behind`` backups of nodes
        that went cold. Completions of jobs ``reset`` dropped are ignored; an
        unknown completion raises ``UnknownJob`` after the valid ones were applied.
        """
        self._check_open()
        self._polls += 1
        if self.config.write_policy == "write_behind":
            self._write_behind()
        self.flush()
        done = list(self.executor.poll())
        if self.storage is not None:
            done += self.storage.poll()
        done = self._agreed(done)
        self._apply(done)
        return done

    def _agreed(self, done: list[Completion]) -> list[Completion]:
        """With a rank group: hold ``done`` and run a step's agreement; the completions every rank has."""
        if self.acks is None:
            return done
        direct = self.acks.hold(done)
        self.agreement.step()
        return direct + self.acks.take()

    def _write_behind(self) -> None:
        idle = self.config.write_behind_idle_steps
        budget = self.config.write_behind_batch_tokens
        polls = self._polls
        cold = sorted(
            (n for n in self.tree.nodes() if n.state == "device" and polls - n.last_poll >= idle),
            key=lambda n: (n.last_access, n.id),
        )
        for node in cold:
            if node.num_tokens > budget:
                break
            if not self._try_backup(node):
                break  # host full even after host eviction: try again next poll
            budget -= node.num_tokens
            self.counters["write_behind_tokens"] += node.num_tokens

    def complete(self, completion: Completion) -> None:
        """Apply one completion reported by an engine-side executor.

        Raises ``UnknownJob`` (changing nothing) for a job that is not pending,
        including a second ack of the same job.
        """
        self._check_open()
        self._check_completion(completion)
        if self.acks is not None:  # applied at a poll, once every rank has it
            self._apply(self.acks.hold([completion]))
            return
        self._apply([completion])

    def _check_completion(self, c: object) -> None:
        if not isinstance(c, Completion):
            raise UnknownJob(f"expected a Completion, got {type(c).__name__}")
        if c.job_id in self._pending:
            return
        how = self.job_ledger.recent.get(c.job_id)
        if how == "cancelled":
            return
        if how is not None:
            raise UnknownJob(f"job {c.job_id} was already acknowledged ({how})")
        raise UnknownJob(f"job {c.job_id!r} is not a job of this cache")

    def _apply(self, completions: Iterable[Completion]) -> None:
        errors: list[str] = []
        for c in completions:
            try:
                self._check_completion(c)
            except UnknownJob as exc:
                errors.append(str(exc))
                continue
            job = self._pending.pop(c.job_id, None)
            if job is None:  # cancelled by reset
                self.counters["late_cancelled_completions"] += 1
                continue
            self.job_ledger.ended(c.job_id, "acked" if c.ok else "failed")
            nodes = self._job_nodes.pop(c.job_id)
            for node in nodes:
                node.pending_jobs.discard(c.job_id)
            handle = self._job_handle.pop(c.job_id, None)
            if job.kind is JobKind.H2S and self.storage is not None:
                self.storage.backup_finished(job, c.ok, c.error)
            if job.kind is JobKind.S2H:
                continue
            if job.layer is not None and self.cp is not None:  # a CP per-layer copy: the runtime acks once
                self.cp.layer_job_finished(job, c.ok)
                continue
            if c.ok:
                trigger = _DONE_TRIGGER[job.kind]
                for node in nodes:
                    self._fire(node, trigger, self)
                self.counters[_BYTES_KEY[job.kind]] += job.num_tokens * self._token_bytes
                if self.storage is not None and job.kind is JobKind.D2H and self.storage_attached:
                    for node in nodes:
                        if self.residency.can_fire(node, "store", self):
                            self._fire(node, "store", self)
            else:
                self.counters[_FAILED_KEY[job.kind]] += 1
                log.warning("job %d (%s) failed: %s", c.job_id, job.kind.value, c.error)
                if job.kind is JobKind.H2D:
                    self._load_failed(nodes, handle)
                else:
                    for node in nodes:
                        self._fire(node, _FAIL_TRIGGER[job.kind], self)
            if self._observers:
                self._notify({"event": "completion", "job": c.job_id, "ok": c.ok})
        if errors:
            raise UnknownJob("; ".join(errors))

    def _load_failed(self, nodes: list[TreeNode], handle: LoadHandle | None) -> None:
        """Nodes whose load failed go back to host-only when safe, else the load is retried in place.

        Safe = unlocked and no child on (or coming to) the device. Deepest
        first, so a chain's lower part can leave while a locked upper part
        (or one with other resident children) is retried.
        """
        depth = {n.id: sum(1 for _ in self.tree.path_to_root(n)) for n in nodes}
        retry: list[TreeNode] = []
        for node in sorted(nodes, key=lambda n: -depth[n.id]):
            if node.lock_ref == 0 and not any(c.state in RESIDENT for c in node.children.values()):
                self._fire(node, "load_failed", self)
            else:
                retry.append(node)
        if retry:
            retry.reverse()  # top-down
            self.counters["load_retries"] += 1
            self._emit_load(retry, handle if handle is not None else LoadHandle(self))
            if handle is not None:
                handle._wait = None

    # ================================================================== observation

    def add_observer(self, fn: Callable[[dict], None]) -> None:
        """Call ``fn(event_dict)`` on every transition, job, completion and split (tracing)."""
        self._observers.append(fn)

    def _notify(self, event: dict) -> None:
        for fn in self._observers:
            fn(event)

    def device_slot_owners(self) -> list[tuple[str, torch.Tensor]]:
        """(owner, slot indices) for every device slot held by a node or the engine (invariant checks)."""
        owners = [(f"node {n.id}", n.device_indices) for n in self.tree.nodes() if n.device_indices is not None]
        if self._engine_pages:
            pages = torch.tensor(sorted(self._engine_pages), dtype=torch.int64)
            owners.append(("engine", (pages[:, None] * self.page_size + self._offsets).flatten()))
        return owners

    def host_slot_owners(self) -> list[tuple[str, torch.Tensor]]:
        """(owner, slot indices) for every host slot held by a node or a registered runtime (invariant checks)."""
        owners = [(f"node {n.id}", n.host_indices) for n in self.tree.nodes() if n.host_indices is not None]
        for source in self._extra_host_owners:
            owners.extend(source())
        return owners

    def register_host_owner(self, source: Callable[[], Iterable[tuple[str, torch.Tensor]]]) -> None:
        """Let a runtime (prefetch, CP writes) declare host slots it holds, for invariant checks."""
        self._extra_host_owners.append(source)

    def register_invariants(self, check: Callable[[], list[str]]) -> None:
        """Add a runtime's own invariant check (returns problems) to ``check_invariants``."""
        self._extra_invariants.append(check)

    def invariant_violations(self) -> list[str]:
        """Every broken invariant of the residency spec and of registered runtimes, as text."""
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
                (n.id, n.parent.id if n.parent else None, n.key, repr(n.namespace), n.state, idx(n.device_indices),
                 idx(n.host_indices), n.lock_ref, n.host_ref, n.hit_count, n.last_access, n.last_poll, n.priority,
                 tuple(sorted(n.pending_jobs)))
                for n in self.tree.nodes()
            ),
            "device_free": self.device_allocator.free_pages,
            "host_free": self.host_allocator.free_pages,
            "device_owned": sorted(self.device_allocator.owned_pages()),
            "host_owned": sorted(self.host_allocator.owned_pages()),
            "engine_pages": sorted(self._engine_pages),
            "pending": sorted(self._pending),
            "outbox": [j.id for j in self._outbox],
            "ledger": attrs.asdict(self.job_ledger),
            "counters": dict(self.counters),
            "clock": (self._clock, self._polls),
            "cp": self.cp.snapshot() if self.cp is not None else None,
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

        Called when the engine flushes its cache (weights updated, tests).
        Waits for in-flight copies first so no executor writes into freed
        slots; with a manual executor pending jobs are marked cancelled and
        their later completions ignored. Engine-held slots are freed too.
        """
        self._check_open()
        if self.executor_can_block():
            self.flush()
            self.executor.synchronize()
            self.executor.poll()
        if self.storage is not None:
            self.storage.reset()
        for job_id in self._pending:
            self.job_ledger.ended(job_id, "cancelled")
        for h in self._load_handles:
            h.cancelled = True
        self._outbox.clear()
        self._pending.clear()
        self._job_nodes.clear()
        self._load_handles.clear()
        self._job_handle.clear()
        if self.acks is not None:
            self.acks.reset()
        self._engine_pages.clear()
        self.device_allocator.reset()
        self.host_allocator.reset()
        self.tree = RadixTree(self.page_size)
        if self.cp is not None:
            self.cp.reset()
        self.counters["resets"] += 1

    def close(self) -> None:
        """Finish in-flight copies, stop storage threads, release executor resources (engine shutdown)."""
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

    # ================================================================== storage tier (L3): engine-facing API
    # Thin delegations to ``self.storage`` (hicache_fsm.storage.tier.StorageTier); see docs/storage.md.

    def attach_storage(self, url_or_backend, **options) -> None:
        """Attach an L3 backend at run time (URL or open backend); rolls back fully and raises StorageLinkError on failure."""
        self._check_open()
        from hicache_fsm.storage.tier import attach_storage

        attach_storage(self, url_or_backend, **options)

    def detach_storage(self) -> None:
        """Detach the backend; a no-op when detached; StorageLinkError while storage transfers are in flight."""
        if self.storage is not None:
            self.storage.detach()

    def prefetch(self, request_id: Hashable, tokens: Sequence[int], match: MatchResult, namespace: Hashable = None) -> bool:
        """Start fetching the tokens after ``match``'s in-memory hit from storage into host memory; False if not admitted."""
        self._check_open()
        return self.storage is not None and self.storage.prefetch(request_id, tokens, match, namespace)

    def prefetch_ready(self, request_id: Hashable) -> bool:
        """Per-step check: True once the request may proceed (fetched pages inserted, the rest released)."""
        self._check_open()
        return self.storage is None or self.storage.prefetch_ready(request_id)

    def abort_prefetch(self, request_id: Hashable) -> bool:
        """End an aborted request's prefetch and release everything it holds; False if it had none."""
        self._check_open()
        return self.storage is not None and self.storage.abort_prefetch(request_id)

    def storage_transfers_in_flight(self) -> int:
        if self.storage is None:
            return sum(1 for j in self._pending.values() if j.kind in _STORAGE_KINDS)
        return self.storage.transfers_in_flight()

    def storage_link_violations(self) -> list[str]:
        return [] if self.storage is None else self.storage.link_violations()


def cache_from_pools(pools, config: CacheConfig | None = None, executor: Executor | None = None) -> HiCache:
    """A ``HiCache`` over ``pools.build_pools(...)``'s result (draft pools included)."""
    return HiCache(pools.device, pools.host, config, executor, pools.draft_device, pools.draft_host)
