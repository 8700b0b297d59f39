"""Guards, effects and invariants of the ``residency`` machine.

``obj`` is a radix ``TreeNode``; ``ctx`` of guards and effects is a
``ResidencyContext`` (the allocators and the attached runtimes), and
invariants get the owning cache. Effects only move slots between a node and
the allocators; the transfer itself is the job the transition emits, which
the cache builds and an executor runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache_fsm.jobs import JobKind
from hicache_fsm.registry import machine_registry

if TYPE_CHECKING:
    import numpy as np

residency = machine_registry("residency")

ON_DEVICE = frozenset({"device", "writing_host", "device_host", "device_host_storing", "device_host_stored"})
ON_HOST = frozenset(
    {"device_host", "device_host_storing", "device_host_stored", "host", "host_storing", "host_stored",
     "loading", "loading_storing", "loading_stored"}
)
LOADING = frozenset({"loading", "loading_storing", "loading_stored"})
EVICTED = frozenset({"host", "host_storing", "host_stored"}) | LOADING


class ResidencyContext:
    """What residency guards and effects see as ``ctx``: the two allocators and the attached runtimes."""

    __slots__ = ("device_allocator", "host_allocator", "attached")

    def __init__(self, device_allocator, host_allocator, attached) -> None:
        self.device_allocator = device_allocator
        self.host_allocator = host_allocator
        self.attached = attached  # interfaces.Attached: a CP runtime, the storage tier

    @property
    def cp(self):
        return self.attached.cp

    @property
    def storage_attached(self) -> bool:
        return self.attached.storage_attached()


@residency.guard
def host_has_room(node, ctx) -> bool:
    cp = getattr(ctx, "cp", None)
    if cp is not None:  # CP: the layer-write runtime reserved slots for the owned pages
        return cp.host_has_room(node)
    return ctx.host_allocator.available_tokens >= node.num_tokens


@residency.guard
def device_has_room(node, ctx) -> bool:
    cp = getattr(ctx, "cp", None)
    if cp is not None:  # CP: a load reserved pages replaying the node's owner pattern
        return cp.device_has_room(node)
    return ctx.device_allocator.available_tokens >= node.num_tokens


@residency.guard
def unlocked(node, ctx) -> bool:
    return node.lock_ref == 0


@residency.guard
def host_unpinned(node, ctx) -> bool:
    return node.host_ref == 0


@residency.guard
def storage_attached(node, ctx) -> bool:
    # a CP host copy holds one rank's pages only: storing it per page is not wired (docs/cp-writes.md)
    return ctx.storage_attached and getattr(node, "cp_meta", None) is None


def _take_slots(allocator, num_tokens: int):
    """Slots for a node in its compact form (page ids as bytes) when the allocator hands out page ids."""
    alloc_page_ids = getattr(allocator, "alloc_page_ids", None)
    if alloc_page_ids is None:
        from hicache_fsm.radix import pack_slots  # radix needs torch; diagrams load these bindings without it

        return pack_slots(allocator.alloc(num_tokens), allocator.page_size)
    pages = alloc_page_ids(num_tokens)
    return None if pages is None else pages.tobytes()


def _give_back(allocator, slots) -> None:
    """Return a node's slots (compact page ids or a tensor) to ``allocator``."""
    if type(slots) is bytes and hasattr(allocator, "free_packed_pages"):
        allocator.free_packed_pages(slots)
    elif type(slots) is bytes:
        from hicache_fsm.radix import slots_of_pages  # as in _take_slots: only an allocator without page ids

        allocator.free(slots_of_pages(slots, allocator.page_size))
    else:
        allocator.free(slots)


@residency.effect
def alloc_host(node, ctx) -> None:
    cp = getattr(ctx, "cp", None)
    if cp is not None:
        cp.alloc_host(node)
        return
    node.host_slots = _take_slots(ctx.host_allocator, node.num_tokens)


@residency.effect
def free_host(node, ctx) -> None:
    _give_back(ctx.host_allocator, node.host_slots)
    node.host_slots = None
    cp = getattr(ctx, "cp", None)
    if cp is not None:  # CP: draft host slots and the owner pattern go with the host copy
        cp.release_host(node)


@residency.effect
def alloc_device(node, ctx) -> None:
    cp = getattr(ctx, "cp", None)
    if cp is not None:
        cp.alloc_device(node)
        return
    node.device_slots = _take_slots(ctx.device_allocator, node.num_tokens)


@residency.effect
def free_device(node, ctx) -> None:
    _give_back(ctx.device_allocator, node.device_slots)
    node.device_slots = None


@residency.effect
def adopt_device(node, grant) -> None:
    node.device_indices = grant.device_indices


# --------------------------------------------------------------------------- invariants


def _page_array(indices, page_size: int) -> np.ndarray:
    """Page ids (int64) of slot indices: the first slot of each page, divided by the page size."""
    import numpy as np  # here, not at the top: the spec commands load these bindings without numpy

    if indices is None:
        return np.empty(0, dtype=np.int64)
    first = np.asarray(indices.numpy() if hasattr(indices, "numpy") else indices, dtype=np.int64)[::page_size]
    return first // page_size


def _tier_owners(cache, tier: str) -> tuple[list[str], list[np.ndarray]]:
    """Who holds pages of ``tier``, and which: every node in tree order, then the engine (device) or each
    registered runtime holder (host).

    A node's compact slots (page ids as bytes) are read as they are, without
    expanding them to slot indices: at a million pages that expansion was
    most of a full invariant check.
    """
    import numpy as np

    ps = cache.page_size
    labels: list[str] = []
    pages: list[np.ndarray] = []
    attr = f"{tier}_slots"
    for node in cache.tree.nodes():
        slots = getattr(node, attr)
        if slots is None:
            continue
        labels.append(f"node {node.id}")
        pages.append(np.frombuffer(slots, dtype=np.int64) if type(slots) is bytes else _page_array(slots, ps))
    if tier == "device":
        if cache.engine_pages:  # pages the engine holds (from ``alloc_device``), one owner
            labels.append("engine")
            pages.append(np.array(sorted(cache.engine_pages), dtype=np.int64))
        return labels, pages
    for owner, indices in cache.runtime_checks.host_owners():
        labels.append(owner)
        pages.append(_page_array(indices, ps))
    return labels, pages


def _within(values: np.ndarray, ascending: np.ndarray) -> np.ndarray:
    """Which of ``values`` are in the ascending array ``ascending`` (a binary search each)."""
    import numpy as np

    if not ascending.size:
        return np.zeros(values.size, dtype=bool)
    at = np.minimum(np.searchsorted(ascending, values), ascending.size - 1)
    return ascending[at] == values


def ownership_problems(tier: str, labels: list[str], pages: list[np.ndarray],
                       allocated: "set[int] | np.ndarray") -> list[str]:
    """``slots_owned_once``'s findings for one tier: ``pages[i]`` held by ``labels[i]``, ``allocated`` by the allocator.

    ``allocated``: a set of page ids, or an ascending array of them.

    Reads as a walk over the owners in order, page by page, remembering each
    page's latest owner: a page met again is reported against that owner; then
    allocated pages nobody owns (leaks) and owned pages on the free list (the
    first 8 of each, ascending). Computed with one stable sort of all pages.
    """
    import numpy as np

    problems = []
    sizes = [p.size for p in pages]
    every = np.concatenate(pages) if pages else np.empty(0, dtype=np.int64)
    order = np.argsort(every, kind="stable")  # equal pages keep their walk order
    ranked = every[order]
    again = np.flatnonzero(ranked[1:] == ranked[:-1]) + 1
    if again.size:
        owner_of = np.repeat(np.arange(len(pages)), sizes)
        repeats = order[again]
        previous = order[again - 1]  # the same page's occurrence just before, in walk order
        by_walk = np.argsort(repeats, kind="stable")
        for at, before in zip(repeats[by_walk].tolist(), previous[by_walk].tolist()):
            problems.append(f"{tier} page {int(every[at])} owned by both {labels[owner_of[before]]} "
                            f"and {labels[owner_of[at]]}")
    first = np.ones(ranked.size, dtype=bool)
    first[1:] = ranked[1:] != ranked[:-1]
    owned = ranked[first]  # ascending, each page once
    if isinstance(allocated, np.ndarray):
        held = allocated
    else:
        held = np.fromiter(allocated, dtype=np.int64, count=len(allocated))
        held.sort()
    leaked = held[~_within(held, owned)]
    if leaked.size:
        problems.append(f"{tier} pages allocated but owned by nobody (leak): {leaked[:8].tolist()}")
    freed = owned[~_within(owned, held)]
    if freed.size:
        problems.append(f"{tier} pages owned but on the free list: {freed[:8].tolist()}")
    return problems


@residency.invariant
def slots_owned_once(cache) -> list[str]:
    """Every allocated device/host page is owned by exactly one node or in-flight holder."""
    problems = []
    for tier, allocator in (("device", cache.device_allocator), ("host", cache.host_allocator)):
        held = getattr(allocator, "owned_page_array", None)  # the ascending array, where the allocator has one
        problems += ownership_problems(tier, *_tier_owners(cache, tier), held() if held else allocator.owned_pages())
    return problems


@residency.invariant
def device_prefix_closed(cache) -> list[str]:
    """A node with KV on the device has every ancestor on the device too."""
    problems = []
    for node in cache.tree.nodes():
        if node.parent is not None and node.parent.parent is not None and node.state in ON_DEVICE | LOADING:
            if node.parent.state not in ON_DEVICE | LOADING:
                problems.append(f"node {node.id} is on device but its parent {node.parent.id} is not")
    return problems


@residency.invariant
def evicted_has_host_copy(cache) -> list[str]:
    problems = []
    for node in cache.tree.nodes():
        if node.parent is None:
            continue
        if node.state in ON_HOST and node.host_slots is None:
            problems.append(f"node {node.id} in {node.state} has no host slots")
        if node.state in ON_DEVICE | LOADING and node.device_slots is None:
            problems.append(f"node {node.id} in {node.state} has no device slots")
        if node.state not in ON_DEVICE | LOADING and node.device_slots is not None:
            problems.append(f"node {node.id} in {node.state} still holds device slots")
        if node.state not in ON_HOST | {"writing_host"} and node.host_slots is not None:
            problems.append(f"node {node.id} in {node.state} still holds host slots")
    return problems


@residency.invariant
def no_free_while_pinned(cache) -> list[str]:
    problems = []
    for node in cache.tree.nodes():
        if node.state == "removed":
            problems.append(f"removed node {node.id} is still in the tree")
        if node.lock_ref > 0 and node.parent is not None and node.state not in ON_DEVICE | LOADING:
            problems.append(f"locked node {node.id} is not on the device ({node.state})")
        if node.host_ref > 0 and node.state not in ON_HOST:
            problems.append(f"host-pinned node {node.id} has no host copy ({node.state})")
    return problems


@residency.invariant
def refs_nonnegative(cache) -> list[str]:
    return [
        f"node {n.id} has negative refs (lock {n.lock_ref}, own locks {n.own_locks}, host {n.host_ref})"
        for n in cache.tree.nodes()
        if n.lock_ref < 0 or n.own_locks < 0 or n.host_ref < 0
    ]


@residency.invariant
def lock_refs_add_up(cache) -> list[str]:
    """A node's lock refs are the locks taken on it and those of its children: a lock pins its path to the root,
    an unlock releases that path, so no unlock can leave a descendant's lock without its ancestors'."""
    return [
        f"node {n.id} has lock_ref {n.lock_ref}, but {n.own_locks} lock(s) of its own and "
        f"{sum(c.lock_ref for c in n.children.values())} in its children"
        for n in cache.tree.nodes()
        if n.parent is not None and n.lock_ref != n.own_locks + sum(c.lock_ref for c in n.children.values())
    ]


@residency.invariant
def jobs_acked_once(cache) -> list[str]:
    ledger = cache.job_ledger
    pending = cache.pending_job_ids()
    problems = []
    ended = ledger.acked + ledger.failed + ledger.cancelled
    if ledger.emitted != len(pending) + ended:
        problems.append(
            f"{ledger.emitted} jobs emitted but {len(pending)} pending + {ended} ended "
            f"({ledger.acked} acked, {ledger.failed} failed, {ledger.cancelled} cancelled): "
            "a job was dropped or ended twice"
        )
    both = [j for j in pending if j in ledger.recent]
    if both:
        problems.append(f"ended jobs still pending: {sorted(both)[:8]}")
    return problems


_DONE_KIND = {"write_done": JobKind.D2H, "load_done": JobKind.H2D, "store_done": JobKind.H2S}


def _waits_for(spec) -> dict[str, set[JobKind]]:
    """State -> the job kinds a node in it waits for: those whose ``*_done`` trigger leaves the state."""
    waits: dict[str, set[JobKind]] = {}
    for t in spec.transitions:
        kind = _DONE_KIND.get(t.trigger)
        if kind is not None:
            for source in t.sources:
                waits.setdefault(source, set()).add(kind)
    return waits


@residency.invariant
def in_flight_has_job(cache) -> list[str]:
    """A node waiting for a copy is covered by a pending job of that kind, and jobs and nodes agree.

    Queued jobs are pending too. The one wait without a job is a CP per-layer
    write: its node is ``writing_host`` from the reservation on and the runtime
    emits a D2H job per layer as layers are computed (the CP runtime's own
    invariants check its writes). Also: a node knows only pending jobs, is
    covered only by jobs its state waits for (or S2H), and every pending job
    covers live nodes that know it.
    """
    waits = _waits_for(cache.residency.spec)
    outbox = cache.outbox
    problems = []
    for node in cache.tree.nodes():
        if node.is_root:
            continue
        jobs = [outbox.pending_job(j) for j in node.pending_jobs]
        stale = sorted(j for j, job in zip(node.pending_jobs, jobs) if job is None)
        if stale:
            problems.append(f"node {node.id} waits for jobs {stale} that are not pending")
        have = {job.kind for job in jobs if job is not None}
        needed = waits.get(node.state, set())
        missing = needed - have
        if JobKind.D2H in missing and cache.cp is not None and cache.cp.write_for(node) is not None:
            missing.discard(JobKind.D2H)
        if missing:
            names = "/".join(sorted(k.value for k in missing))
            problems.append(f"node {node.id} is {node.state} but no pending {names} job covers it")
        extra = have - needed - {JobKind.S2H}
        if extra:
            names = "/".join(sorted(k.value for k in extra))
            problems.append(f"node {node.id} in {node.state} is covered by pending {names} jobs it does not wait for")
    for job in cache.pending_jobs():
        for node_id in job.node_ids:
            if cache.tree.get(node_id) is None:
                problems.append(f"pending job {job.id} ({job.kind.value}) covers node {node_id}, which left the tree")
        for node in outbox.nodes_of(job.id):
            if job.id not in node.pending_jobs:
                problems.append(f"job {job.id} covers node {node.id}, which does not know it")
    return problems
