"""A deterministic storage tier for protocol testing: no threads, the test runs each storage step.

``ManualStorageTier`` is a ``StorageTier`` that starts no threads at attach
(the ``_start_workers`` seam). The work the query and I/O threads would pick
up stays queued: prefetch hit queries, S2H transfers (one prefetch's pages,
batch by batch) and H2S backups, plus a health probe while storage is
unhealthy. The test lists them (``steps()``) and runs one of its choice
(``run(step_id)``), on its own thread, in any order; the tier then learns the
outcome at the next ``poll`` exactly as it learns a thread's. Everything else
(admission, the prefetch machine, backups, retries) is the production code.

Faults are injected per step through a ``FaultyBackend`` whose schedule is a
``FaultPlan``: the driver arms ``StorageFault`` records (which call kind fails,
after how many calls, how often) or a one-shot failure of the very next call
(``fail_next``), so "fail this step" is "arm one failure, run the step".

    tier = ManualStorageTier.attach_to(cache, FaultyBackend(open_backend("memory://"), plan),
                                       prefetch_threshold=cache.page_size)
    cache.prefetch("r1", tokens, cache.match_prefix(tokens))
    [step] = tier.steps()                 # the hit query
    tier.run(step.id); cache.poll()       # -> the S2H transfer is queued
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from hicache_fsm.storage.faults import Fault
from hicache_fsm.storage.tier import StorageTier

if TYPE_CHECKING:  # pragma: no cover
    from hicache_fsm.cache import HiCache
    from hicache_fsm.testing.adapter import StorageFault

__all__ = ["CALL_METHODS", "FaultPlan", "ManualStorageTier", "StorageStep", "to_backend_fault"]

# StorageFault.call -> the backend methods it selects
CALL_METHODS = {
    "get": frozenset({"batch_get", "batch_get_into"}),
    "set": frozenset({"batch_set", "batch_set_from"}),
    "exists": frozenset({"batch_exists"}),
    "any": frozenset({"batch_exists", "batch_get", "batch_get_into", "batch_set", "batch_set_from"}),
}


@attrs.frozen
class StorageStep:
    """One queued unit of storage work: ``kind`` is ``query``, ``s2h``, ``h2s`` or ``probe``."""

    id: str
    kind: str
    detail: tuple = ()


class ManualStorageTier(StorageTier):
    """``StorageTier`` whose queued storage work runs only when the test says (see the module docstring)."""

    @classmethod
    def attach_to(cls, cache: HiCache, url_or_backend: Any, **options: Any) -> ManualStorageTier:
        """Install a manual tier as ``cache.storage`` (replacing none) and attach ``url_or_backend``."""
        if cache.storage is not None and not isinstance(cache.storage, cls):
            raise ValueError("the cache already has a threaded storage tier")
        if cache.storage is None:
            cache.storage = cls(cache)
        cache.storage.attach(url_or_backend, **options)
        return cache.storage

    def _start_workers(self) -> None:
        self.link.stop_event = threading.Event()  # what the threads would get: a fresh one per attach

    # ------------------------------------------------------------------ the queue, as steps

    @staticmethod
    def _step_id(kind: str, item: tuple) -> str:
        if kind == "query":
            return f"query:{item[1].request_id!r}"
        return f"{kind}:{item[1].id}"

    def _queues(self) -> list[tuple[str, Any]]:
        return [("query", self._query_q), ("s2h", self._transfer_q), ("h2s", self._backup_q)]

    def steps(self) -> list[StorageStep]:
        """Queued storage work, queries first, then transfers, backups, and a probe while unhealthy."""
        out = []
        if self.link.backend is None:  # detached: no thread would run queued work
            return out
        for kind, q in self._queues():
            for item in q:
                if kind == "query":
                    detail: tuple = (item[1].request_id,)
                elif kind == "s2h":
                    detail = (item[2].request_id, item[1].num_tokens)
                else:
                    detail = tuple(item[1].node_ids)
                out.append(StorageStep(self._step_id(kind, item), kind, detail))
        if self.link.state == "attached" and not self.healthy:
            out.append(StorageStep("probe", "probe"))
        return out

    def run(self, step_id: str) -> None:
        """Run one queued step now, on this thread (as the query or I/O thread would); KeyError if unknown."""
        backend = self.link.backend
        if step_id == "probe":
            if backend is None or self.healthy:
                raise KeyError(step_id)
            self._last_probe = float("-inf")  # a probe the test asked for is never rate-limited
            self._probe(backend)
            return
        kind = step_id.split(":", 1)[0]
        runner = {"query": self._run_query, "s2h": self._run_transfer, "h2s": self._run_backup}.get(kind)
        if runner is None:
            raise KeyError(step_id)
        with self._cv:
            queue = dict(self._queues())[kind]
            for i, item in enumerate(queue):
                if self._step_id(kind, item) == step_id:
                    del queue[i]
                    break
            else:
                raise KeyError(step_id)
            self._busy += 1
        try:
            if backend is None:  # cannot happen while the link guards hold: nothing is queued when detached
                raise KeyError(f"{step_id}: no backend attached")
            runner(self.link.stop_event, backend, *item)
        finally:
            self._done()


# =========================================================================== fault schedules


def to_backend_fault(fault: StorageFault, keys: Sequence[str]) -> Fault:
    """The ``FaultyBackend`` rule that plays ``fault`` on a call over ``keys``."""
    kind = fault.kind
    if kind == "raise":
        return Fault("error", message="scheduled storage error")
    if kind == "timeout":
        return Fault("timeout", delay=0.0, message="scheduled storage timeout")
    if kind == "short":
        return Fault("partial", keep=max(0, len(keys) - 1))
    if kind == "corrupt":
        return Fault("corrupt", positions=(max(0, len(keys) - 1),))
    raise ValueError(f"unknown storage fault kind {kind!r}")


class FaultPlan:
    """A ``FaultyBackend`` schedule (a callable) the driver arms as it goes.

    ``arm(StorageFault)``: the calls of ``fault.call`` after the next
    ``fault.after`` ones fail ``fault.count`` times (armed faults are played in
    arming order, one per call). ``fail_next()``: the very next backend call
    raises, whatever it is. ``corrupted`` collects the keys a corrupt fault damaged.
    """

    def __init__(self) -> None:
        self.armed: list[list] = []  # [StorageFault, calls still to skip, failures still to inject]
        self._next: Fault | None = None
        self.corrupted: set[str] = set()
        self.injected = 0

    def arm(self, fault: StorageFault) -> None:
        if fault.call not in CALL_METHODS:
            raise ValueError(f"unknown storage call {fault.call!r}; known: {sorted(CALL_METHODS)}")
        to_backend_fault(fault, ())  # validates the kind
        if fault.count > 0:
            self.armed.append([fault, max(0, fault.after), fault.count])

    def fail_next(self, kind: str = "error") -> None:
        self._next = Fault(kind, message="storage step failed by the test")

    def clear_next(self) -> None:
        self._next = None

    def __call__(self, method: str, index: int, keys: Sequence[str]) -> Fault | None:
        if method == "clear":
            return None
        if self._next is not None:
            fault, self._next = self._next, None
            self.injected += 1
            return fault
        for entry in self.armed:
            fault, skip = entry[0], entry[1]
            if method not in CALL_METHODS[fault.call]:
                continue
            if skip:
                entry[1] -= 1
                continue
            entry[2] -= 1
            if entry[2] <= 0:
                self.armed.remove(entry)
            out = to_backend_fault(fault, keys)
            if out.kind == "corrupt" and keys:
                self.corrupted.update(keys[p] for p in out.positions if 0 <= p < len(keys))
            self.injected += 1
            return out
        return None


# =========================================================================== forking (the explorer)


def _fork_plan(plan: FaultPlan, memo: dict) -> FaultPlan:
    if id(plan) in memo:
        return memo[id(plan)]
    new = object.__new__(FaultPlan)
    new.__dict__.update(plan.__dict__)
    new.armed = [list(entry) for entry in plan.armed]
    new.corrupted = set(plan.corrupted)
    memo[id(plan)] = new
    return new


def _fork_stats(stats):
    new = object.__new__(type(stats))
    new.__dict__.update(stats.__dict__)
    new._lock = threading.Lock()
    new._counts = dict(stats._counts)
    return new


def fork_backend(backend: Any, memo: dict) -> Any:
    """Copy a ``memory://`` backend (its pages included), possibly behind a ``FaultyBackend``."""
    from hicache_fsm.storage.base import LRUIndex
    from hicache_fsm.storage.faults import FaultyBackend
    from hicache_fsm.storage.memory import MemoryBackend, _Store

    if backend is None:
        return None
    if id(backend) in memo:
        return memo[id(backend)]
    new = object.__new__(type(backend))
    new.__dict__.update(backend.__dict__)
    memo[id(backend)] = new
    if "_stats" in backend.__dict__:
        new._stats = _fork_stats(backend._stats)
    if isinstance(backend, FaultyBackend):
        new.inner = fork_backend(backend.inner, memo)
        new._lock = threading.Lock()
        new._rng = random.Random()
        new._rng.setstate(backend._rng.getstate())
        new._call_index = dict(backend._call_index)
        new._fire_counts = dict(backend._fire_counts)
        new.fired = list(backend.fired)
        new._rules = None if backend._rules is None else list(backend._rules)
        if isinstance(backend.chooser, FaultPlan):
            new._chooser = _fork_plan(backend.chooser, memo)
        return new
    if isinstance(backend, MemoryBackend) and not backend.store_name:
        store = _Store()
        store.data = dict(backend._mem.data)
        new._mem = store
        lru = object.__new__(LRUIndex)
        lru.__dict__.update(backend._lru.__dict__)
        lru._order = type(backend._lru._order)(backend._lru._order)
        new._lru = lru
        return new
    raise NotImplementedError(f"cannot fork a {type(backend).__name__} (only private memory:// backends)")


def _fork_op(op: Any, memo: dict) -> Any:
    if id(op) in memo:
        return memo[id(op)]
    new = object.__new__(type(op))
    new.__dict__.update(op.__dict__)
    new.anchor = memo.get(id(op.anchor), op.anchor)
    new.deferred = list(op.deferred)
    new.reserved_pages = set(op.reserved_pages)
    new.inserted_pages = set(op.inserted_pages)
    new.freed_pages = type(op.freed_pages)(op.freed_pages)
    new._lock = threading.Lock()
    memo[id(op)] = new
    return new


def fork_tier(tier: ManualStorageTier, memo: dict, cache: Any) -> ManualStorageTier:
    """Copy a manual storage tier onto the forked ``cache`` (whose nodes and jobs are in ``memo``)."""
    from collections import Counter, deque

    from hicache_fsm.storage.prefetch import PrefetchOp

    if not isinstance(tier, ManualStorageTier):
        raise NotImplementedError("only a ManualStorageTier (no threads) can be forked")
    new = object.__new__(type(tier))
    d = new.__dict__
    d.update(tier.__dict__)
    memo[id(tier)] = new
    d["cache"] = cache
    d["_cv"] = threading.Condition()
    link = object.__new__(type(tier.link))
    link.__dict__.update(tier.link.__dict__)
    link._wake = new._wake
    link.threads = []
    link.stop_event = threading.Event()
    if tier.link.stop_event.is_set():
        link.stop_event.set()
    link.backend = fork_backend(tier.link.backend, memo)
    link.last_backend_stats = dict(tier.link.last_backend_stats)
    d["link"] = link
    rt = object.__new__(type(tier.runtime))
    rt.__dict__.update(tier.runtime.__dict__)
    rt.cache = cache
    rt._submit_transfer = new._submit_transfer
    rt.active = {k: _fork_op(op, memo) for k, op in tier.runtime.active.items()}
    rt.draining = {k: _fork_op(op, memo) for k, op in tier.runtime.draining.items()}
    rt.counters = Counter(tier.runtime.counters)
    rt._violations = list(tier.runtime._violations)
    d["runtime"] = rt

    def fork_item(x):
        return _fork_op(x, memo) if isinstance(x, PrefetchOp) else x

    d["_query_q"] = deque(tuple(fork_item(x) for x in item) for item in tier._query_q)
    d["_transfer_q"] = deque(tuple(fork_item(x) for x in item) for item in tier._transfer_q)
    d["_backup_q"] = deque(tier._backup_q)
    d["_events"] = deque(tuple(fork_item(x) for x in ev) for ev in tier._events)
    d["_completions"] = list(tier._completions)
    d["_pending_transfer"] = {k: _fork_op(op, memo) for k, op in tier._pending_transfer.items()}
    d["_retry_after"] = dict(tier._retry_after)
    d["counters"] = Counter(tier.counters)
    d["_thread_counts"] = Counter(tier._thread_counts)
    return new


def tier_state_key(tier: ManualStorageTier, prefix_of: Any, requests: Sequence[Any]) -> tuple:
    """What the tier's future depends on, for the explorer's visited set (``prefix_of(node)`` names nodes)."""
    inner = getattr(tier.link.backend, "inner", tier.link.backend)
    stored = tuple(sorted(inner._mem.data)) if inner is not None else ()
    plan = getattr(tier.link.backend, "chooser", None)
    faults = (tuple((f, skip, left) for f, skip, left in plan.armed), tuple(sorted(plan.corrupted))) \
        if isinstance(plan, FaultPlan) else ()

    def op_key(op):
        return (op.tokens, op.state, prefix_of(op.anchor), op.anchor_pin, op.anchor_pinned, op.hit_tokens,
                op.completed_tokens, op.landed_tokens, op.io_active, op.held_tokens(), len(op.deferred),
                op.terminated)

    rt = tier.runtime
    active = tuple(op_key(rt.active[r]) if r in rt.active else None for r in requests)
    others = tuple(sorted(op_key(op) for r, op in rt.active.items() if r not in requests))
    draining = tuple(sorted(op_key(op) for op in rt.draining.values()))
    queues = (tuple(op.tokens for _, op in tier._query_q),
              tuple((op.tokens, job.num_tokens) for _, job, op in tier._transfer_q),
              tuple(tuple(job.keys) for _, job in tier._backup_q))
    return (tier.link.state, tier.healthy, tier._sweep_due, stored, faults, active, others, draining, queues,
            rt.occupied_tokens, len(rt._violations), len(tier._events), len(tier._completions))
