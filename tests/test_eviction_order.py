"""Eviction takes victims in exactly the order the from-scratch definition gives.

The cache keeps its candidate sets up to date as nodes change; these tests
predict the whole victim sequence from scratch (every candidate, policy-ordered,
a parent joining once its last device child left) and compare it with what
``evict`` / ``evict_host`` fire, for every eviction policy.
"""

from __future__ import annotations

import heapq

from hypothesis import given, settings
from hypothesis import strategies as st

from cache_helpers import drain, make_cache, put
from hicache_fsm.config import CacheConfig
from hicache_fsm.eviction import DEVICE_EVICTABLE, HOST_EVICTABLE, RESIDENT, POLICY_KEYS, Eviction

PAGE = 2
prompts_st = st.lists(
    st.lists(st.integers(0, 3), min_size=1, max_size=5).map(lambda t: tuple(x for x in t for _ in range(PAGE))),
    min_size=1, max_size=10,
)


def _victims(cache, triggers):
    seen = []
    cache.add_observer(lambda e: seen.append(e["node"]) if e.get("trigger") in triggers else None)
    return seen


def _predicted_device_order(cache):
    key = POLICY_KEYS[cache.config.eviction_policy]
    resident = {n.id for n in cache.tree.nodes() if n.state in RESIDENT}
    heap = [(key(n), n) for n in cache.tree.nodes() if Eviction.is_device_candidate(n)]
    heapq.heapify(heap)
    order = []
    while heap:
        _, n = heapq.heappop(heap)
        order.append(n.id)
        resident.discard(n.id)
        p = n.parent
        if (p.parent is not None and p.state in DEVICE_EVICTABLE and p.lock_ref == 0
                and not any(c.id in resident for c in p.children.values())):
            heapq.heappush(heap, (key(p), p))
    return order


def _predicted_host_order(cache):
    key = POLICY_KEYS[cache.config.eviction_policy]
    children = {n.id: len(n.children) for n in cache.tree.nodes()}
    heap = [(key(n), n) for n in cache.tree.nodes() if Eviction.is_host_candidate(n)]
    heapq.heapify(heap)
    order = []
    while heap:
        _, n = heapq.heappop(heap)
        order.append(n.id)
        p = n.parent
        children[p.id] -= 1
        if p.parent is not None and p.state in HOST_EVICTABLE and p.host_ref == 0 and children[p.id] == 0:
            heapq.heappush(heap, (key(p), p))
    return order


@settings(max_examples=40, deadline=None)
@given(prompts=prompts_st, hits=st.lists(st.integers(0, 9), max_size=12), locked=st.integers(0, 9),
       policy=st.sampled_from(["lru", "lfu", "priority"]), priorities=st.lists(st.integers(0, 3), max_size=10))
def test_device_then_host_victims_follow_the_policy_order(prompts, hits, locked, policy, priorities):
    cache, ex = make_cache(page=PAGE, device_pages=64, host_pages=64, config=CacheConfig(eviction_policy=policy))
    for i, tokens in enumerate(prompts):
        put(cache, tokens, priority=priorities[i] if i < len(priorities) else 0)
    drain(cache, ex)
    for h in hits:  # re-matching changes recency and hit counts after the nodes joined the sets
        cache.match_prefix(prompts[h % len(prompts)])
    lock = cache.match_prefix(prompts[locked % len(prompts)]).last_device_node
    cache.lock(lock)
    expected = _predicted_device_order(cache)
    seen = _victims(cache, {"evict_device", "drop"})
    cache.evict(1 << 30)
    assert seen == expected
    cache.unlock(lock)
    assert cache.eviction.violations() == []
    expected = _predicted_host_order(cache)
    seen = _victims(cache, {"evict_host"})
    cache.evict_host(1 << 30)
    assert seen == expected
    assert cache.eviction.violations() == []
    cache.check_invariants()


def test_candidate_sets_stay_small_in_stale_entries():
    """Re-matching a prefix many times leaves stale heap entries; the heap is rebuilt before they pile up."""
    cache, ex = make_cache(page=PAGE, device_pages=64, host_pages=64)
    tokens = (1,) * (4 * PAGE)
    put(cache, tokens)
    drain(cache, ex)
    for _ in range(500):
        node = cache.match_prefix(tokens).last_device_node
        cache.lock(node)
        cache.unlock(node)
    assert cache.eviction.violations() == []
    assert len(cache.eviction.device) == 1
    assert cache.eviction.device.heap_size <= 2 * len(cache.eviction.device) + 64
    assert cache.evict(PAGE) >= PAGE


def test_a_candidate_that_leaves_before_the_next_pop_costs_the_heap_no_entry():
    """Joiners wait for the next ``pop`` (or for ``PENDING_LIMIT`` of them) before they get heap entries: one that
    left by then gets none, and one whose key grew meanwhile enters with its key as it is then."""
    from hicache_fsm.eviction import PENDING_LIMIT, CandidateSet
    from hicache_fsm.radix import RadixTree

    tree = RadixTree(1)
    nodes = [tree.add_child(tree.root, (i,), None) for i in range(10)]
    for i, n in enumerate(nodes):
        n.last_access = i
    cs = CandidateSet(POLICY_KEYS["lru"])
    for n in nodes:
        cs.add(n)
    for n in nodes[5:]:
        cs.discard(n)
    nodes[0].last_access = 50  # used again before any pop
    assert cs.pop() is nodes[1]
    cs.discard(nodes[1])  # evicted
    assert cs.heap_size == 4  # nodes 0, 2, 3, 4: none for the five that left
    assert cs.order_violations("device") == []
    many = [tree.add_child(tree.root, (100 + i,), None) for i in range(3 * PENDING_LIMIT)]
    for n in many:
        n.last_access = 1000
        cs.add(n)
    assert cs.heap_size == 4 + len(many)  # held back or entered, every joiner that stays counts once
    assert cs.order_violations("device") == []


def test_a_heap_rebuilt_before_popping_keeps_the_order():
    """Keys that grew are pushed again during ``pop``; the joiners it gives entries first may rebuild the heap
    (stale entries outnumber members), and the pop must go on in the rebuilt heap."""
    from hicache_fsm.eviction import CandidateSet
    from hicache_fsm.radix import RadixTree

    tree = RadixTree(1)
    nodes = [tree.add_child(tree.root, (i,), None) for i in range(200)]
    for i, n in enumerate(nodes):
        n.last_access = 10 * i
    cs = CandidateSet(POLICY_KEYS["lru"])
    for n in nodes:
        cs.add(n)
    left = nodes[:50]
    for n in nodes[50:]:  # left the set: their entries stay in the heap, stale
        cs.discard(n)
    # used again: the first pop re-pushes node 0, then node 1, which is now the oldest; a pop that went on in
    # a heap it did not rebuild would hand out node 0 first
    left[0].last_access, left[1].last_access = 15, 12
    order = []
    while (n := cs.pop()) is not None:
        order.append(n.id)
        cs.discard(n)
    assert order == [n.id for n in sorted(left, key=POLICY_KEYS["lru"])]
    assert cs.heap_size == 0


def test_a_locked_candidate_is_skipped_by_eviction_and_counts_again_once_unlocked():
    """A lock leaves the node in the device set's heap (no churn per request); it neither counts nor is evicted."""
    cache, ex = make_cache(page=PAGE, device_pages=64, host_pages=64)
    a, b = (1,) * (2 * PAGE), (2,) * (2 * PAGE)
    put(cache, a)
    put(cache, b)
    drain(cache, ex)
    node = cache.match_prefix(a).last_device_node
    device = cache.eviction.device
    assert node in device and len(device) == 2
    cache.lock(node)
    assert node not in device and len(device) == 1 and cache.eviction.violations() == []
    cache.evict(1 << 30)
    assert node.state in DEVICE_EVICTABLE and cache.match_prefix(b).device_hit_length == 0
    assert cache.eviction.violations() == []
    cache.unlock(node)
    assert node in device and cache.eviction.violations() == []
    assert cache.evict(1 << 30) == 2 * PAGE and node.state not in DEVICE_EVICTABLE
    cache.check_invariants()
