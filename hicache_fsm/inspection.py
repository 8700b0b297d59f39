"""Looking at a cache without changing it: invariants, slot owners, snapshots and stats.

Tests call ``check_invariants`` after every step and compare ``snapshot``s
before and after a rejected call; metrics read ``stats``. None of it is on the
engine's hot path, so it lives apart from the facade, which hands these
functions the parts they read (the tree, the allocators, the driver, the
outbox, eviction) and nothing else.

Runtimes that extend a cache (the storage tier, prefetch, CP writes) declare
the host slots they hold and their own invariants in ``RuntimeChecks``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Iterable

import attrs
import torch

from hicache_fsm.errors import HiCacheError
from hicache_fsm.radix import RadixTree

HostOwners = Callable[[], Iterable[tuple[str, torch.Tensor]]]
Check = Callable[[], list[str]]


class InvariantViolation(HiCacheError):
    """``check_invariants`` found the cache in a state the specs forbid."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invariant violations:\n  " + "\n  ".join(problems))


class RuntimeChecks:
    """Host slot owners and invariant checks that runtimes registered with a cache."""

    def __init__(self) -> None:
        self.host_owner_sources: list[HostOwners] = []
        self.checks: list[Check] = []

    def register_host_owner(self, source: HostOwners) -> None:
        self.host_owner_sources.append(source)

    def register_invariants(self, check: Check) -> None:
        self.checks.append(check)

    def clear(self) -> None:
        self.host_owner_sources = []
        self.checks = []

    def __len__(self) -> int:
        return len(self.host_owner_sources) + len(self.checks)

    def host_owners(self) -> list[tuple[str, torch.Tensor]]:
        owners: list[tuple[str, torch.Tensor]] = []
        for source in self.host_owner_sources:
            owners.extend(source())
        return owners

    def problems(self) -> list[str]:
        out: list[str] = []
        for check in self.checks:
            out += check()
        return out


def maintained_set_problems(tree: RadixTree, eviction: Any, state_counts: dict[str, int]) -> list[str]:
    """Eviction's candidate sets and the driver's per-state counts against a recomputation (O(N))."""
    problems = [f"eviction_candidates: {p}" for p in eviction.violations()]
    counted = Counter(node.state for node in tree.nodes() if not node.is_root)
    problems += [f"state_counts: {state} holds {n} nodes, the count says {state_counts[state]}"
                 for state, n in sorted(counted.items()) if state_counts[state] != n]
    problems += [f"state_counts: {state} holds no node, the count says {n}"
                 for state, n in sorted(state_counts.items()) if n and state not in counted]
    return problems


def snapshot(*, tree: RadixTree, device_allocator: Any, host_allocator: Any, engine_pages: Iterable[int], outbox: Any,
             ledger: Any, counters: Counter[str], driver: Any, eviction: Any, cp: Any) -> dict:
    """A plain, comparable picture of a whole cache (tests compare before/after a rejected call)."""
    def idx(t):
        return None if t is None else t.tolist()
    return {
        "nodes": sorted(
            (n.id, n.parent.id if n.parent else None, n.key, repr(n.namespace), n.state, idx(n.device_indices),
             idx(n.host_indices), n.lock_ref, n.host_ref, n.hit_count, n.last_access, n.last_poll, n.priority,
             tuple(sorted(n.pending_jobs)))
            for n in tree.nodes()
        ),
        "device_free": device_allocator.free_pages,
        "host_free": host_allocator.free_pages,
        "device_owned": sorted(device_allocator.owned_pages()),
        "host_owned": sorted(host_allocator.owned_pages()),
        "engine_pages": sorted(engine_pages),
        "pending": sorted(outbox.pending_ids()),
        "outbox": [j.id for j in outbox.queued_jobs()],
        "ledger": attrs.asdict(ledger),
        "counters": dict(counters),
        "clock": (driver.clock, driver.polls),
        "candidates": (sorted(eviction.device.ids()), sorted(eviction.host.ids())),
        "cp": cp.snapshot() if cp is not None else None,
    }


def stats(*, tree: RadixTree, page_size: int, device_allocator: Any, host_allocator: Any, outbox: Any,
          counters: Counter[str], storage: Any) -> dict:
    """Counters (hits per tier, bytes per direction, evictions, failures) and occupancy."""
    out = dict(counters)
    out.update(
        nodes=len(tree),
        device_used_tokens=device_allocator.used_pages * page_size,
        device_free_tokens=device_allocator.available_tokens,
        host_used_tokens=host_allocator.used_pages * page_size,
        host_free_tokens=host_allocator.available_tokens,
        pending_jobs=outbox.count(),
    )
    if storage is not None:
        out["storage"] = storage.stats()
    return out


__all__ = ["InvariantViolation", "RuntimeChecks", "maintained_set_problems", "snapshot", "stats"]
