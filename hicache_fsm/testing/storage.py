"""A deterministic storage tier for protocol testing: no threads, the test runs each storage step.

``ManualStorageTier`` is a ``StorageTier`` that starts no threads at attach
(the ``start_workers`` seam). The work the query and I/O threads would pick
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

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from hicache_fsm.storage.faults import Fault
from hicache_fsm.storage.stepped import SteppedStorageTier

if TYPE_CHECKING:  # pragma: no cover
    from hicache_fsm.testing.interface import StorageFault

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


class ManualStorageTier(SteppedStorageTier):
    """``StorageTier`` whose queued storage work runs only when the test says (see the module docstring)."""

    # ------------------------------------------------------------------ the queue, as steps

    @staticmethod
    def _step_id(kind: str, work: Any) -> str:
        if kind == "query":
            return f"query:{work.request_id!r}"
        return f"{kind}:{(work[0] if kind == 's2h' else work).id}"

    def steps(self) -> list[StorageStep]:
        """Queued storage work, queries first, then transfers, backups, and a probe while unhealthy."""
        out = []
        if self.link.backend is None:  # detached: no thread would run queued work
            return out
        for kind, items in self.queued_work().items():
            for work in items:
                if kind == "query":
                    detail: tuple = (work.request_id,)
                elif kind == "s2h":
                    detail = (work[1].request_id, work[0].num_tokens)
                else:
                    detail = tuple(work.node_ids)
                out.append(StorageStep(self._step_id(kind, work), kind, detail))
        if self.link.state == "attached" and not self.healthy:
            out.append(StorageStep("probe", "probe"))
        return out

    def run(self, step_id: str) -> None:
        """Run one queued step now, on this thread (as the query or I/O thread would); KeyError if unknown."""
        if step_id == "probe":
            if self.link.backend is None or self.healthy:
                raise KeyError(step_id)
            self.probe_now()  # a probe the test asked for is never rate-limited
            return
        kind = step_id.split(":", 1)[0]
        for index, work in enumerate(self.queued_work().get(kind, ())):
            if self._step_id(kind, work) == step_id:
                self.run_queued(kind, index)
                return
        raise KeyError(step_id)


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
        self.widest = 0  # the most keys one backend call took since the driver last reset it (``batch_bound``)

    def arm(self, fault: StorageFault) -> None:
        if fault.call not in CALL_METHODS:
            raise ValueError(f"unknown storage call {fault.call!r}; known: {sorted(CALL_METHODS)}")
        to_backend_fault(fault, ())  # validates the kind
        if fault.count > 0:
            self.armed.append([fault, max(0, fault.after), fault.count])

    def fork(self, memo: dict) -> "FaultPlan":
        """An independent copy (``FaultyBackend.fork`` calls it), once per ``memo``."""
        if id(self) not in memo:
            new = FaultPlan()
            new.armed = [list(entry) for entry in self.armed]
            new._next = self._next
            new.corrupted = set(self.corrupted)
            new.injected = self.injected
            new.widest = self.widest
            memo[id(self)] = new
        return memo[id(self)]

    def fail_next(self, kind: str = "error") -> None:
        self._next = Fault(kind, message="storage step failed by the test")

    def clear_next(self) -> None:
        self._next = None

    def __call__(self, method: str, index: int, keys: Sequence[str]) -> Fault | None:
        if method == "clear":
            return None
        self.widest = max(self.widest, len(keys))
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


def fork_tier(tier: ManualStorageTier, memo: dict, cache: Any) -> ManualStorageTier:
    """Copy a manual storage tier onto the forked ``cache`` (whose nodes and jobs are in ``memo``)."""
    if not isinstance(tier, ManualStorageTier):
        raise NotImplementedError("only a ManualStorageTier (no threads) can be forked")
    new = tier.fork(cache, memo)
    new.use_manual_clock()
    return new
