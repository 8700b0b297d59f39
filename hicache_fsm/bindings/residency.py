"""Guards, effects and invariants of the ``residency`` machine.

``obj`` is a radix ``TreeNode``; ``ctx`` is the owning ``HiCache``. Effects
only move slots between a node and the allocators; the transfer itself is the
job the transition emits, which the cache builds and an executor runs.
"""

from __future__ import annotations

from hicache_fsm.registry import machine_registry

residency = machine_registry("residency")

ON_DEVICE = frozenset({"device", "writing_host", "device_host", "device_host_storing", "device_host_stored"})
ON_HOST = frozenset(
    {"device_host", "device_host_storing", "device_host_stored", "host", "host_storing", "host_stored",
     "loading", "loading_storing", "loading_stored"}
)
LOADING = frozenset({"loading", "loading_storing", "loading_stored"})
EVICTED = frozenset({"host", "host_storing", "host_stored"}) | LOADING


@residency.guard
def host_has_room(node, cache) -> bool:
    cp = getattr(cache, "cp", None)
    if cp is not None:  # CP: the layer-write runtime reserved slots for the owned pages
        return cp.host_has_room(node)
    return cache.host_allocator.available_tokens >= node.num_tokens


@residency.guard
def device_has_room(node, cache) -> bool:
    cp = getattr(cache, "cp", None)
    if cp is not None:  # CP: a load reserved pages replaying the node's owner pattern
        return cp.device_has_room(node)
    return cache.device_allocator.available_tokens >= node.num_tokens


@residency.guard
def unlocked(node, cache) -> bool:
    return node.lock_ref == 0


@residency.guard
def host_unpinned(node, cache) -> bool:
    return node.host_ref == 0


@residency.guard
def storage_attached(node, cache) -> bool:
    # a CP host copy holds one rank's pages only: storing it per page is not wired (docs/cp-writes.md)
    return cache.storage_attached and getattr(node, "cp_meta", None) is None


@residency.effect
def alloc_host(node, cache) -> None:
    cp = getattr(cache, "cp", None)
    if cp is not None:
        cp.alloc_host(node)
        return
    node.host_indices = cache.host_allocator.alloc(node.num_tokens)


@residency.effect
def free_host(node, cache) -> None:
    cache.host_allocator.free(node.host_indices)
    node.host_indices = None
    cp = getattr(cache, "cp", None)
    if cp is not None:  # CP: draft host slots and the owner pattern go with the host copy
        cp.release_host(node)


@residency.effect
def alloc_device(node, cache) -> None:
    cp = getattr(cache, "cp", None)
    if cp is not None:
        cp.alloc_device(node)
        return
    node.device_indices = cache.device_allocator.alloc(node.num_tokens)


@residency.effect
def free_device(node, cache) -> None:
    cache.device_allocator.free(node.device_indices)
    node.device_indices = None


@residency.effect
def adopt_device(node, grant) -> None:
    node.device_indices = grant.device_indices


# --------------------------------------------------------------------------- invariants


def _pages(indices, page_size: int) -> list[int]:
    return [] if indices is None else (indices[::page_size] // page_size).tolist()


@residency.invariant
def slots_owned_once(cache) -> list[str]:
    """Every allocated device/host page is owned by exactly one node or in-flight holder."""
    problems = []
    for tier, allocator, owners in (
        ("device", cache.device_allocator, cache.device_slot_owners()),
        ("host", cache.host_allocator, cache.host_slot_owners()),
    ):
        seen: dict[int, str] = {}
        for owner, indices in owners:
            for page in _pages(indices, cache.page_size):
                if page in seen:
                    problems.append(f"{tier} page {page} owned by both {seen[page]} and {owner}")
                seen[page] = owner
        allocated = allocator.owned_pages()
        leaked = allocated - set(seen)
        if leaked:
            problems.append(f"{tier} pages allocated but owned by nobody (leak): {sorted(leaked)[:8]}")
        freed = set(seen) - allocated
        if freed:
            problems.append(f"{tier} pages owned but on the free list: {sorted(freed)[:8]}")
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
        if node.state in ON_HOST and node.host_indices is None:
            problems.append(f"node {node.id} in {node.state} has no host slots")
        if node.state in ON_DEVICE | LOADING and node.device_indices is None:
            problems.append(f"node {node.id} in {node.state} has no device slots")
        if node.state not in ON_DEVICE | LOADING and node.device_indices is not None:
            problems.append(f"node {node.id} in {node.state} still holds device slots")
        if node.state not in ON_HOST | {"writing_host"} and node.host_indices is not None:
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
        f"node {n.id} has negative refs (lock {n.lock_ref}, host {n.host_ref})"
        for n in cache.tree.nodes()
        if n.lock_ref < 0 or n.host_ref < 0
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

