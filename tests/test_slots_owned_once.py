"""``slots_owned_once`` (one sort over every owner's pages) reports exactly what a walk page by page reports.

The reference below is the plain walk the check was first written as: owners
in order, pages in order, remembering each page's latest owner. Random owner
lists with planted repeats, and real caches whose nodes were made to share,
lose or free pages, must give the same problems, in the same order.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_helpers import make_cache, put
from hicache_fsm.bindings.residency import ownership_problems, slots_owned_once
from hicache_fsm.errors import AllocationError


def walk_problems(tier: str, owners, page_size: int, allocated: set[int]) -> list[str]:
    """The reference: every owner's pages in order, each page's latest owner remembered."""
    problems = []
    seen: dict[int, str] = {}
    for owner, indices in owners:
        pages = [] if indices is None else (indices[::page_size] // page_size).tolist()
        for page in pages:
            if page in seen:
                problems.append(f"{tier} page {page} owned by both {seen[page]} and {owner}")
            seen[page] = owner
    leaked = allocated - set(seen)
    if leaked:
        problems.append(f"{tier} pages allocated but owned by nobody (leak): {sorted(leaked)[:8]}")
    freed = set(seen) - allocated
    if freed:
        problems.append(f"{tier} pages owned but on the free list: {sorted(freed)[:8]}")
    return problems


def slots(pages: list[int], page_size: int) -> torch.Tensor:
    p = torch.tensor(pages, dtype=torch.int64)
    return (p[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def slot_owners(cache, tier: str) -> list[tuple[str, torch.Tensor]]:
    """(owner, slot indices) of every holder of ``tier`` slots, enumerated apart from the check under test."""
    attr = f"{tier}_indices"
    owners = [(f"node {n.id}", getattr(n, attr)) for n in cache.tree.nodes() if getattr(n, attr) is not None]
    if tier == "host":
        return owners + cache.runtime_checks.host_owners()
    if cache.engine_pages:
        owners.append(("engine", slots(sorted(cache.engine_pages), cache.page_size)))
    return owners


owners_st = st.lists(st.lists(st.integers(0, 30), max_size=8), max_size=8)


@settings(max_examples=300, deadline=None)
@given(owners=owners_st, allocated=st.sets(st.integers(0, 30)), page_size=st.sampled_from([1, 2, 4]))
def test_sorted_check_matches_the_walk(owners, allocated, page_size):
    labels = [f"node {i}" for i in range(len(owners))]
    pairs = [(label, slots(pages, page_size)) for label, pages in zip(labels, owners)]
    arrays = [np.array(p, dtype=np.int64) for p in owners]
    expected = walk_problems("host", pairs, page_size, allocated)
    assert ownership_problems("host", labels, arrays, allocated) == expected
    assert ownership_problems("host", labels, arrays, np.array(sorted(allocated), dtype=np.int64)) == expected


@settings(max_examples=60, deadline=None)
@given(
    inputs=st.lists(st.lists(st.integers(0, 3), min_size=2, max_size=16), min_size=1, max_size=8),
    plants=st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50), st.sampled_from(["share", "leak", "free"])),
                    max_size=3),
)
def test_a_cache_with_planted_faults_reports_what_the_walk_reports(inputs, plants):
    cache, _ = make_cache(page=2, device_pages=16, host_pages=32)
    for tokens in inputs:
        put(cache, tokens[: len(tokens) // 2 * 2])
    for a, b, kind in plants:
        held = [n for n in cache.tree.nodes() if n.device_slots is not None]
        if not held:
            break
        x, y = held[a % len(held)], held[b % len(held)]
        if kind == "share":  # y's first page also held by x
            x.device_indices = torch.cat([x.device_indices, y.device_indices[: cache.page_size]])
        elif kind == "leak":  # x forgets its pages, still allocated
            x.device_slots = None
        else:  # x's pages go back to the free list while x keeps them (once: a second free is refused)
            with contextlib.suppress(AllocationError):
                cache.device_allocator.free(x.device_indices)
    expected = []
    for tier, allocator, owners in (("device", cache.device_allocator, slot_owners(cache, "device")),
                                    ("host", cache.host_allocator, slot_owners(cache, "host"))):
        expected += walk_problems(tier, owners, cache.page_size, allocator.owned_pages())
    assert slots_owned_once(cache) == expected


def test_a_page_held_twice_is_reported_once_per_repeat_against_its_latest_owner():
    labels = ["node 1", "node 2", "engine"]
    pages = [np.array([3, 4]), np.array([4, 5]), np.array([4])]
    assert ownership_problems("device", labels, pages, {3, 4, 6}) == [
        "device page 4 owned by both node 1 and node 2",
        "device page 4 owned by both node 2 and engine",
        "device pages allocated but owned by nobody (leak): [6]",
        "device pages owned but on the free list: [5]",
    ]
