"""HiCache API behaviour with a ManualExecutor: every job is completed or failed by the test."""

from __future__ import annotations

import pytest
import torch

from cache_helpers import device_kv, drain, expected_kv, host_kv, make_cache, pages, put, put_fresh
from hicache_fsm.config import CacheConfig
from hicache_fsm.errors import ConfigError, GuardRejected, LockError
from hicache_fsm.executors import LoadNotFinished
from hicache_fsm.jobs import Completion, JobKind


def cfg(**kw) -> CacheConfig:
    return CacheConfig(**kw)


def assert_device_kv(cache, tokens, namespace=None):
    m = cache.match_prefix(tokens, namespace)
    n = m.device_hit_length
    k, v = device_kv(cache, m.device_indices)
    ek, ev = expected_kv(tuple(tokens)[:n], namespace)
    assert torch.equal(k, ek) and torch.equal(v, ev)
    return m


# ------------------------------------------------------------------ match / insert


def test_match_on_empty_cache_and_partial_pages():
    cache, _ = make_cache()
    m = cache.match_prefix(range(10))
    assert m.device_hit_length == 0 and m.host_hit_length == 0
    assert m.last_device_node is cache.tree.root and m.last_host_node is cache.tree.root
    s = cache.stats()
    assert s["match_requests"] == 1 and s["miss_tokens"] == 8  # 10 tokens = 2 whole pages + 2
    cache.check_invariants()


def test_insert_then_match_returns_device_indices_with_the_kv():
    cache, ex = make_cache()
    res = put(cache, pages(3))
    assert (res.cached_tokens, res.new_tokens) == (0, 12)
    m = assert_device_kv(cache, pages(3) + (1, 2, 3))  # the partial page is ignored
    assert m.device_hit_length == 12 and m.last_device_node is res.node
    cache.check_invariants()


def test_insert_accepts_the_cache_own_indices_and_frees_duplicates():
    cache, ex = make_cache()
    put(cache, pages(2))
    used = cache.device_allocator.used_pages
    res = put(cache, pages(4))  # own indices for the first 2 pages, fresh for the rest
    assert (res.cached_tokens, res.new_tokens) == (8, 8)
    assert cache.device_allocator.used_pages == used + 2
    res2 = put_fresh(cache, pages(4))  # fresh slots for everything: all duplicates
    assert (res2.cached_tokens, res2.new_tokens) == (16, 0) and res2.node is res.node
    assert cache.device_allocator.used_pages == used + 2
    assert_device_kv(cache, pages(4))
    cache.check_invariants()


def test_insert_revives_an_evicted_prefix_with_fresh_slots():
    cache, ex = make_cache()
    node = put(cache, pages(2)).node
    drain(cache, ex)
    assert cache.evict(8) == 8 and node.state == "host"
    host_idx = node.host_indices
    put_fresh(cache, pages(3))
    assert node.state == "device_host" and torch.equal(node.host_indices, host_idx)
    assert cache.stats()["revived_tokens"] == 8
    assert_device_kv(cache, pages(3))
    cache.check_invariants()


def test_insert_namespaces_are_separate():
    cache, ex = make_cache()
    put(cache, pages(2), namespace="a")
    assert cache.match_prefix(pages(2), "b").device_hit_length == 0
    put(cache, pages(2), namespace="b")
    assert_device_kv(cache, pages(2), "a")
    assert_device_kv(cache, pages(2), "b")
    assert len(cache.tree) == 2


def test_match_counts_hits_and_tokens():
    cache, ex = make_cache()
    put(cache, pages(2))
    drain(cache, ex)
    cache.evict(8)
    m = cache.match_prefix(pages(3))
    assert (m.device_hit_length, m.host_hit_length) == (0, 8)
    s = cache.stats()
    assert s["host_hit_tokens"] == 8 and s["device_hit_tokens"] == 0


# ------------------------------------------------------------------ locks


def test_lock_pins_the_path_and_unlock_releases_it():
    cache, ex = make_cache(config=cfg(write_policy="write_back"))
    a = put(cache, pages(2)).node
    b = put(cache, pages(4)).node
    cache.lock(b)
    assert a.lock_ref == b.lock_ref == 1
    assert cache.evict(100) == 0
    cache.unlock(b)
    assert a.lock_ref == b.lock_ref == 0
    cache.lock(cache.tree.root)  # the root is accepted and ignored
    cache.unlock(cache.tree.root)
    with pytest.raises(LockError):
        cache.unlock(b)


def test_lock_of_host_only_node_is_refused():
    cache, ex = make_cache()
    node = put(cache, pages(2)).node
    drain(cache, ex)
    cache.evict(8)
    before = cache.snapshot()
    with pytest.raises(LockError, match="not on the device"):
        cache.lock(node)
    assert cache.snapshot() == before


# ------------------------------------------------------------------ eviction orders


def _three_leaves(policy):
    cache, ex = make_cache(config=cfg(eviction_policy=policy))
    a = put(cache, (1,) * 4, priority=5).node
    b = put(cache, (2,) * 4, priority=1).node
    c = put(cache, (3,) * 4, priority=9).node
    drain(cache, ex)
    return cache, ex, a, b, c


def test_evict_lru_takes_least_recently_used_first():
    cache, ex, a, b, c = _three_leaves("lru")
    cache.match_prefix((1,) * 4)  # a becomes most recent
    assert cache.evict(4) == 4
    assert b.state == "host" and a.state == c.state == "device_host"
    cache.evict(4)
    assert c.state == "host" and a.state == "device_host"


def test_evict_lfu_takes_least_hit_first():
    cache, ex, a, b, c = _three_leaves("lfu")
    for _ in range(3):
        cache.match_prefix((2,) * 4)
    cache.match_prefix((3,) * 4)
    assert cache.evict(4) == 4
    assert a.state == "host" and b.state == c.state == "device_host"
    cache.evict(4)
    assert c.state == "host" and b.state == "device_host"


def test_evict_priority_takes_lowest_priority_first():
    cache, ex, a, b, c = _three_leaves("priority")
    cache.evict(4)
    assert b.state == "host"
    cache.evict(4)
    assert a.state == "host" and c.state == "device_host"


def test_evict_takes_leaves_before_parents_and_skips_locked():
    cache, ex = make_cache()
    parent = put(cache, pages(2)).node
    child = put(cache, pages(4)).node
    other = put(cache, (7,) * 8).node
    drain(cache, ex)
    cache.match_prefix(pages(4))  # parent and child are the most recent: other goes first
    cache.lock(other)
    assert cache.evict(4) == 8
    assert child.state == "host" and parent.state == "device_host" and other.state == "device_host"
    assert cache.evict(100) == 8
    assert parent.state == "host" and other.state == "device_host"
    assert cache.stats()["evicted_device_tokens"] == 16
    cache.check_invariants()


def test_evict_drops_unbacked_nodes_under_write_through_selective():
    cache, ex = make_cache(config=cfg(write_policy="write_through_selective"))
    node = put(cache, pages(2)).node
    assert node.state == "device" and not cache.pending_job_ids()
    assert cache.evict(8) == 8
    assert not cache.tree.owns(node) and cache.match_prefix(pages(2)).host_hit_length == 0
    cache.check_invariants()


def test_explicit_evict_node():
    cache, ex = make_cache()
    node = put(cache, pages(2)).node
    with pytest.raises(GuardRejected):
        cache.evict_node(node)  # writing_host: in flight
    drain(cache, ex)
    assert cache.evict_node(node) == 8 and node.state == "host"


# ------------------------------------------------------------------ host eviction


def test_evict_host_takes_leaves_only_and_respects_pins():
    cache, ex = make_cache()
    parent = put(cache, pages(2)).node
    child = put(cache, pages(4)).node
    other = put(cache, (7,) * 4).node
    drain(cache, ex)
    cache.evict(100)
    cache.pin_host(other)
    assert cache.evict_host(4) == 8  # child first: parent is inner
    assert not cache.tree.owns(child) and parent.state == "host"
    assert cache.evict_host(100) == 8  # then parent; other is pinned
    assert not cache.tree.owns(parent) and other.state == "host"
    cache.unpin_host(other)
    assert cache.evict_host(100) == 4
    assert len(cache.tree) == 0
    assert cache.host_allocator.used_pages == 0
    cache.check_invariants()


def test_evict_host_never_takes_device_copies_or_loading_nodes():
    cache, ex = make_cache()
    a = put(cache, pages(2)).node
    b = put(cache, (5,) * 8).node
    drain(cache, ex)
    cache.evict_node(b)
    lb = cache.load_back(b)
    assert lb is not None and b.state == "loading"
    assert cache.evict_host(100) == 0
    assert a.state == "device_host" and b.state == "loading"


# ------------------------------------------------------------------ load-back


def test_load_back_loads_the_whole_evicted_chain_in_one_job():
    cache, ex = make_cache()
    a = put(cache, pages(2)).node
    b = put(cache, pages(4)).node
    c = put(cache, pages(6)).node
    drain(cache, ex)
    cache.evict(100)
    m = cache.match_prefix(pages(6))
    assert m.host_hit_length == 24 and m.last_host_node is c
    lb = cache.load_back(m.last_host_node)
    assert lb.nodes == (a, b, c) and lb.last_node is c
    assert all(n.state == "loading" for n in (a, b, c))
    (job,) = cache.pending_jobs()
    assert job.kind is JobKind.H2D and job.node_ids == (a.id, b.id, c.id)
    with pytest.raises(LoadNotFinished):
        lb.wait(0)  # the manual executor has not run it yet
    cache.poll()
    ex.complete(job.id)
    for layer in range(2):
        lb.wait(layer)
    cache.poll()
    assert all(n.state == "device_host" for n in (a, b, c))
    assert torch.equal(lb.device_indices, cache.match_prefix(pages(6)).device_indices)
    assert_device_kv(cache, pages(6))
    assert cache.stats()["loaded_back_tokens"] == 24
    cache.check_invariants()


def test_load_back_of_root_or_resident_node_is_none():
    cache, ex = make_cache()
    node = put(cache, pages(2)).node
    assert cache.load_back(cache.tree.root) is None
    assert cache.load_back(node) is None


def test_load_back_skipped_under_threshold_or_over_quota():
    for config, n_pages in ((cfg(load_back_threshold=12), 2), (cfg(load_back_max_tokens=4), 2)):
        cache, ex = make_cache(config=config)
        node = put(cache, pages(n_pages)).node
        drain(cache, ex)
        cache.evict(100)
        before = cache.snapshot()
        assert cache.load_back(node) is None
        after = cache.snapshot()
        assert after["counters"].pop("load_back_skipped") == 1
        before["counters"].pop("load_back_skipped", None)
        assert after == before


def test_load_back_evicts_when_device_is_full_then_gives_up_when_it_cannot():
    cache, ex = make_cache(device_pages=4, host_pages=16)
    a = put(cache, pages(2)).node
    drain(cache, ex)
    cache.evict(100)
    b = put(cache, (7,) * 16).node  # fills the device
    drain(cache, ex)
    assert cache.device_allocator.free_pages == 0
    lb = cache.load_back(a)  # device full -> evict b -> retry
    assert lb is not None and b.state == "host" and a.state == "loading"
    drain(cache, ex)
    assert_device_kv(cache, pages(2))
    # now everything on the device is locked: nothing to evict
    cache.evict_node(a)
    c = put(cache, (8,) * 16).node
    drain(cache, ex)
    cache.lock(c)
    assert cache.load_back(a) is None and a.state == "host"
    assert cache.stats()["load_back_device_full"] == 1
    cache.check_invariants()


def test_load_back_keeps_the_anchor_on_device_while_evicting():
    cache, ex = make_cache(device_pages=4, host_pages=16)
    anchor = put(cache, pages(2)).node
    child = put(cache, pages(4)).node
    drain(cache, ex)
    cache.evict_node(child)
    # the anchor is the only evictable device leaf now; loading the child must not evict it
    filler = put(cache, (9,) * 8).node
    drain(cache, ex)
    cache.lock(filler)
    assert cache.load_back(child) is None  # the only candidate is the anchor, which is protected
    assert anchor.state == "device_host"
    cache.check_invariants()


def _parent_and_child_on_the_host():
    """A two-page node and a two-page child below it, both backed up, then evicted: (cache, executor, a, b)."""
    cache, ex = make_cache()
    a = put(cache, pages(2)).node
    b = put(cache, pages(4)).node
    drain(cache, ex)
    cache.evict(100)
    return cache, ex, a, b


def test_load_back_under_a_revived_node_waits_for_the_load_above_it():
    """An insert revives the upper half of an evicted node (the engine's own slots: on the device at once)
    while its parent's load is still in flight; a load-back of the lower half below that revived node must
    wait for the parent's load too, not only for the ancestors right above the chain."""
    cache, ex, a, b = _parent_and_child_on_the_host()
    lb_a = cache.load_back(a)
    cache.flush()  # a's load is on its way, in a batch of its own
    assert a.state == "loading" and b.state == "host"
    assert put(cache, pages(3)) is not None  # a's pages (loading) and b's first page (revived)
    upper = b.parent
    assert upper is not a and upper.parent is a and upper.state == "device_host" and b.state == "host"
    assert a.state == "loading"
    lb_b = cache.load_back(b)
    assert lb_b.nodes == (b,)
    (load_a,), (load_b,) = a.pending_jobs, b.pending_jobs
    cache.poll()
    ex.complete(load_b)  # the lower half lands first
    with pytest.raises(LoadNotFinished):
        lb_b.wait(0)  # it also waits for a's load, two nodes up
    ex.complete(load_a)
    lb_b.wait(0)
    lb_a.wait(1)
    drain(cache, ex)
    assert a.state == upper.state == b.state == "device_host"
    assert_device_kv(cache, pages(4))
    cache.check_invariants()


def test_load_back_under_a_loading_ancestor_waits_for_both():
    cache, ex, a, b = _parent_and_child_on_the_host()
    lb_a = cache.load_back(a)
    lb_b = cache.load_back(b)
    assert lb_b.nodes == (b,)
    jobs = cache.pending_job_ids()
    assert len(jobs) == 2
    cache.poll()
    ex.complete(jobs[1])  # the child's load lands first
    with pytest.raises(LoadNotFinished):
        lb_b.wait(0)  # it also waits for the ancestor's load
    ex.complete(jobs[0])
    lb_b.wait(0)
    lb_a.wait(1)
    cache.poll()
    assert a.state == b.state == "device_host"
    assert_device_kv(cache, pages(4))
    cache.check_invariants()


def test_match_reports_loads_covering_its_device_prefix():
    cache, ex = make_cache()
    a = put(cache, pages(2)).node
    drain(cache, ex)
    cache.evict(100)
    lb = cache.load_back(a)
    m = cache.match_prefix(pages(2))
    assert m.device_hit_length == 8 and m.loads == (lb.handle,)
    with pytest.raises(LoadNotFinished):
        m.wait(0)
    drain(cache, ex)
    m.wait(0)
    assert cache.match_prefix(pages(2)).loads == ()


# ------------------------------------------------------------------ write policies


def test_write_through_backs_up_every_new_node():
    cache, ex = make_cache()
    res = put(cache, pages(2))
    assert res.node.state == "writing_host"
    (job,) = cache.pending_jobs()
    assert job.kind is JobKind.D2H
    cache.poll()
    ex.complete(job.id)
    cache.poll()
    assert res.node.state == "device_host"
    k, v = host_kv(cache, res.node.host_indices)
    ek, ev = expected_kv(pages(2))
    assert torch.equal(k, ek) and torch.equal(v, ev)
    assert cache.stats()["bytes_d2h"] == 8 * cache.device_pool.shape.token_bytes


def test_write_through_selective_backs_up_at_the_hit_threshold():
    cache, ex = make_cache(config=cfg(write_policy="write_through_selective", write_through_threshold=3))
    node = put(cache, pages(2)).node  # put's own match counts no hit on a new prefix
    assert node.state == "device"
    cache.match_prefix(pages(2))
    cache.match_prefix(pages(2))
    assert node.state == "device" and node.hit_count == 2
    cache.match_prefix(pages(2))
    assert node.state == "writing_host"
    drain(cache, ex)
    assert node.state == "device_host"


def test_write_back_backs_up_on_eviction_and_eviction_waits_for_the_copy():
    cache, ex = make_cache(config=cfg(write_policy="write_back"))
    node = put(cache, pages(2)).node
    assert node.state == "device" and not cache.pending_job_ids()
    assert cache.evict(8) == 0  # the backup started; the manual executor cannot be waited on
    assert node.state == "writing_host"
    (job,) = cache.pending_job_ids()
    cache.poll()
    ex.complete(job)
    cache.poll()
    assert cache.evict(8) == 8 and node.state == "host"
    k, v = host_kv(cache, node.host_indices)
    assert torch.equal(k, expected_kv(pages(2))[0])
    cache.check_invariants()


def test_write_back_with_a_blocking_executor_evicts_in_one_call():
    cache, ex = make_cache(config=cfg(write_policy="write_back"), manual=False)
    a = put(cache, pages(2)).node
    b = put(cache, pages(4)).node  # a chain: the parent needs a second round
    assert cache.evict(16) == 16
    assert a.state == b.state == "host"
    m = cache.match_prefix(pages(4))
    lb = cache.load_back(m.last_host_node)
    cache.poll()
    lb.wait(0)
    cache.poll()
    assert_device_kv(cache, pages(4))
    cache.check_invariants()


def test_write_back_failed_backup_is_not_taken_for_a_backup():
    cache, ex = make_cache(config=cfg(write_policy="write_back"))
    node = put(cache, pages(2)).node
    cache.evict(8)
    host_used = cache.host_allocator.used_pages
    cache.poll()
    ex.fail(cache.pending_job_ids()[0])
    cache.poll()
    assert node.state == "device" and node.host_indices is None
    assert cache.host_allocator.used_pages == host_used - 2
    assert cache.evict(8) == 0 and node.state == "writing_host"  # a later eviction tries again
    drain(cache, ex)
    assert cache.evict(8) == 8 and node.state == "host"
    cache.check_invariants()


def test_write_behind_backs_up_cold_nodes_in_batches():
    cache, ex = make_cache(config=cfg(write_policy="write_behind", write_behind_idle_steps=2,
                                      write_behind_batch_tokens=8))
    a = put(cache, (1,) * 4).node
    b = put(cache, (2,) * 4).node
    c = put(cache, (3,) * 4).node
    assert not cache.pending_job_ids()
    cache.poll()
    cache.match_prefix((3,) * 4)  # c stays hot
    cache.poll()
    # a and b were untouched for two polls: one batch of both (8 tokens), c stays
    assert a.state == b.state == "writing_host" and c.state == "device"
    assert len(ex.submitted) == 1 and len(ex.submitted[0].jobs) == 2
    ex.complete_all()
    cache.match_prefix((3,) * 4)  # touched again: cold after two more polls
    cache.poll()
    assert a.state == b.state == "device_host" and c.state == "device"
    cache.poll()
    assert c.state == "writing_host"
    drain(cache, ex)
    cache.check_invariants()


def test_write_behind_backs_up_a_node_larger_than_the_batch_alone():
    """A node over ``write_behind_batch_tokens`` goes as the first of a poll's pass; it was never backed up."""
    cache, ex = make_cache(config=cfg(write_policy="write_behind", write_behind_idle_steps=1,
                                      write_behind_batch_tokens=4))
    big = put(cache, (1,) * 8).node
    small = put(cache, (2,) * 4).node
    cache.poll()
    assert big.state == "writing_host" and small.state == "device"  # the coldest, alone: the budget is spent
    cache.poll()
    assert small.state == "writing_host"
    drain(cache, ex)
    cache.check_invariants()


def test_write_behind_eviction_backs_up_instead_of_dropping():
    cache, ex = make_cache(config=cfg(write_policy="write_behind", write_behind_idle_steps=100))
    node = put(cache, pages(2)).node
    assert cache.evict(8) == 0 and node.state == "writing_host"
    drain(cache, ex)
    assert cache.evict(8) == 8 and node.state == "host"


def test_config_rejects_unknown_policies():
    with pytest.raises(ConfigError):
        CacheConfig(write_policy="write_sometimes")
    with pytest.raises(ConfigError):
        CacheConfig(eviction_policy="random")
    with pytest.raises(ConfigError):
        CacheConfig(load_back_threshold=-1)


@pytest.mark.parametrize("field", ["write_through_threshold", "load_back_threshold", "load_back_max_tokens",
                                   "write_behind_idle_steps", "write_behind_batch_tokens", "eviction_headroom_tokens"])
@pytest.mark.parametrize("value", ["2", 2.5, True, float("nan"), -1])
def test_config_counts_are_ints(field, value):
    """A str failed later with a TypeError; 2.5, True and nan compared as numbers and changed behaviour silently."""
    with pytest.raises(ConfigError, match=f"{field} must be an int >= 0"):
        CacheConfig(**{field: value})
    assert CacheConfig(**{field: 3}) != CacheConfig(**{field: 4})


# ------------------------------------------------------------------ failure paths


def test_host_full_evicts_host_then_retries_then_stays_device_only():
    cache, ex = make_cache(device_pages=16, host_pages=4)
    a = put(cache, pages(2)).node
    drain(cache, ex)
    cache.evict_node(a)  # a: host-only, 2 host pages
    b = put(cache, (5,) * 16).node  # needs 4 host pages: evict a's host copy, retry, succeed
    assert b.state == "writing_host" and not cache.tree.owns(a)
    drain(cache, ex)
    c = put(cache, (6,) * 4).node  # host full of b (on device too: not host-evictable)
    assert c.state == "device" and cache.stats()["backup_host_full"] == 1
    assert cache.write_backup(c) is False and c.state == "device"
    cache.check_invariants()


def test_failed_d2h_leaves_node_device_only_and_frees_host_slots():
    cache, ex = make_cache()
    node = put(cache, pages(2)).node
    assert cache.host_allocator.used_pages == 2
    cache.poll()
    ex.fail(cache.pending_job_ids()[0], "dma error")
    cache.poll()
    assert node.state == "device" and node.host_indices is None
    assert cache.host_allocator.used_pages == 0
    assert cache.stats()["failed_d2h"] == 1
    assert cache.write_backup(node) is True  # it can be tried again
    cache.check_invariants()


def test_failed_h2d_keeps_the_host_copy():
    cache, ex = make_cache()
    node = put(cache, pages(2)).node
    drain(cache, ex)
    cache.evict(100)
    host_idx = node.host_indices.clone()
    dev_free = cache.device_allocator.free_pages
    cache.load_back(node)
    cache.poll()
    ex.fail(cache.pending_job_ids()[0])
    cache.poll()
    assert node.state == "host" and torch.equal(node.host_indices, host_idx)
    assert cache.device_allocator.free_pages == dev_free
    assert cache.stats()["failed_h2d"] == 1
    k, _ = host_kv(cache, node.host_indices)
    assert torch.equal(k, expected_kv(pages(2))[0])
    lb = cache.load_back(node)  # and can be loaded again
    drain(cache, ex)
    assert lb.last_node.state == "device_host"
    assert_device_kv(cache, pages(2))
    cache.check_invariants()


def test_failed_h2d_of_a_locked_node_is_retried_in_the_same_slots():
    cache, ex = make_cache()
    node = put(cache, pages(2)).node
    drain(cache, ex)
    cache.evict(100)
    lb = cache.load_back(node)
    cache.lock(node)
    slots = node.device_indices.clone()
    cache.poll()
    first = cache.pending_job_ids()[0]
    ex.fail(first)
    cache.poll()
    assert node.state == "loading" and torch.equal(node.device_indices, slots)
    (retry,) = cache.pending_job_ids()
    assert retry != first and cache.stats()["load_retries"] == 1
    cache.check_invariants()
    cache.poll()
    ex.complete(retry)
    lb.wait(0)  # the handle follows the retry
    cache.poll()
    assert node.state == "device_host"
    assert_device_kv(cache, pages(2))
    cache.unlock(node)
    cache.check_invariants()


def test_completions_in_any_order():
    cache, ex = make_cache()
    nodes = [put(cache, (i,) * 4).node for i in range(4)]
    cache.poll()
    ids = cache.pending_job_ids()
    for j in reversed(ids):
        ex.complete(j)
        cache.poll()
        cache.check_invariants()
    assert all(n.state == "device_host" for n in nodes)


def test_complete_applies_one_engine_reported_completion():
    cache, ex = make_cache()
    node = put(cache, pages(1)).node
    (job,) = cache.pending_job_ids()
    cache.complete(Completion(job, True))
    assert node.state == "device_host"


# ------------------------------------------------------------------ poll / reset / stats


def test_reset_drops_everything_and_ignores_late_completions():
    cache, ex = make_cache()
    put(cache, pages(2))
    put(cache, (9,) * 8)
    cache.poll()
    stale = cache.pending_job_ids()
    engine_idx = cache.alloc_device(4)
    cache.reset()
    assert len(cache.tree) == 0 and not cache.pending_job_ids()
    assert cache.device_allocator.used_pages == 0 and cache.host_allocator.used_pages == 0
    cache.check_invariants()
    ex.fail(stale[0])
    cache.poll()  # ignored: the job was cancelled by reset
    assert cache.stats()["late_cancelled_completions"] == 1
    cache.check_invariants()
    del engine_idx
    put(cache, pages(2))
    drain(cache, ex)
    assert_device_kv(cache, pages(2))


def test_stats_report_occupancy_and_counters():
    cache, ex = make_cache()
    put(cache, pages(2))
    s = cache.stats()
    assert s["nodes"] == 1 and s["device_used_tokens"] == 8 and s["host_used_tokens"] == 8
    assert s["pending_jobs"] == 1 and s["jobs_d2h"] == 1 and s["inserted_tokens"] == 8
    drain(cache, ex)
    assert cache.stats()["pending_jobs"] == 0


def test_observer_sees_transitions_jobs_and_completions():
    cache, ex = make_cache()
    events = []
    cache.add_observer(events.append)
    put(cache, pages(2))
    drain(cache, ex)
    kinds = {e["event"] for e in events}
    assert {"transition", "job", "completion"} <= kinds


def test_close_then_calls_raise():
    cache, ex = make_cache()
    cache.close()
    from hicache_fsm.errors import HiCacheError

    with pytest.raises(HiCacheError, match="closed"):
        cache.match_prefix(pages(1))


# ------------------------------------------------------------------ the transitions baseline


def test_cache_behaves_the_same_through_transitions():
    from hicache_fsm.spec import load_builtin
    from hicache_fsm.transitions_dispatch import TransitionsDispatcher

    def scenario(dispatcher):
        cache, ex = make_cache(device_pages=6, host_pages=8)
        if dispatcher is not None:
            cache.residency = dispatcher
        trace = []
        cache.add_observer(lambda e: trace.append((e["event"], e.get("trigger"), e.get("dest"))))
        put(cache, pages(2))
        put(cache, pages(4))
        cache.poll()
        ex.fail(cache.pending_job_ids()[0])
        drain(cache, ex)
        cache.evict(100)
        cache.load_back(cache.match_prefix(pages(4)).last_host_node)
        drain(cache, ex)
        cache.evict_host(100)
        put(cache, (9,) * 12)
        drain(cache, ex)
        cache.check_invariants()
        return trace, cache.snapshot()["nodes"]

    d = TransitionsDispatcher(load_builtin("residency"))
    assert scenario(None) == scenario(d)
    assert d.model_count > 0


def test_controller_bench_reports_both_figures():
    import argparse

    from hicache_fsm.bench import controller

    parser = argparse.ArgumentParser()
    controller.configure(parser)
    result = controller.run(parser.parse_args(["--requests", "20", "--repeats", "1", "--tree-nodes", "30"]))
    # behaviour, not timing: the fields are there, positive, and consistent with each other up to
    # the rounding of each figure to two decimals (whatever the machine's load)
    assert {"us_per_request", "transitions_us_per_request", "speedup", "requests", "tree_nodes"} <= result.keys()
    assert result["requests"] == 20 and result["tree_nodes"] == 30
    us, tus, speedup = result["us_per_request"], result["transitions_us_per_request"], result["speedup"]
    assert us > 0 and tus > 0 and speedup > 0
    half = 0.005  # each figure is rounded to 0.01
    assert (tus - half) / (us + half) - half <= speedup <= (tus + half) / max(us - half, 1e-9) + half


@pytest.mark.parametrize("ids", ["list", "list_per_call", "array", "tensor", "packed"])
def test_controller_bench_id_forms_do_the_tuple_forms_work(ids):
    """``bench controller --ids``: each form leaves the tree the tuple form leaves (the same work is timed)."""
    from hicache_fsm.bench import controller

    requests = controller.make_requests(6, seed=3)
    trees = []
    for form in ("tuple", ids):
        cache = controller.make_cache(8 * controller.REQUEST_TOKENS)
        controller.serve(cache, [controller.ID_FORMS[form](t) for t in requests])
        trees.append(sorted((tuple(n.key), n.state) for n in cache.tree.nodes() if not n.is_root))
        cache.check_invariants()
    assert trees[0] == trees[1] and len(trees[0]) >= len(requests)
    result = _controller_run(["--requests", "4", "--repeats", "1", "--tree-nodes", "4", "--ids", ids])
    assert result["ids"] == ids and result["speedup"] > 0


def test_controller_bench_lists_built_per_call_are_packed_once_a_request(monkeypatch):
    """``bench controller --ids list_per_call``: each call gets a new list, and each request is still packed whole
    once (by its match; its insert finds the same ids), one at a time or in batches."""
    import hicache_fsm.request_ids as request_ids
    from hicache_fsm.bench import controller

    prompts = controller.system_prompts(3)
    rest = tuple(range(1, 1 + controller.REQUEST_TOKENS - controller.PREFIX_TOKENS))
    requests = controller.make_requests(6, seed=3, prompts=prompts)
    for batch in (1, 3):
        cache = controller.make_cache(16 * controller.REQUEST_TOKENS)
        controller.serve(cache, [p + rest for p in prompts])  # every prompt cached: each match below packs whole
        whole = []  # the requests packed whole
        real = request_ids.pack_token_ids
        monkeypatch.setattr(request_ids, "pack_token_ids",
                            lambda t: len(t) == controller.REQUEST_TOKENS and whole.append(t) or real(t))
        controller.serve(cache, [controller.ID_FORMS["list_per_call"](t) for t in requests], batch=batch)
        monkeypatch.undo()
        assert sorted(whole) == sorted(requests)
        cache.check_invariants()


@pytest.mark.parametrize("ids", ["list", "list_per_call", "array", "packed"])
def test_controller_bench_in_batches_does_the_work_of_one_request_at_a_time(ids):
    """``bench controller --batch``: matching a batch before inserting it leaves the tree one at a time leaves."""
    from hicache_fsm.bench import controller

    requests = controller.make_requests(6, seed=5)
    trees = []
    for batch in (1, 3):
        cache = controller.make_cache(8 * controller.REQUEST_TOKENS)
        assert controller.serve(cache, [controller.ID_FORMS[ids](t) for t in requests], batch=batch) > 0
        trees.append(sorted((tuple(n.key), n.state) for n in cache.tree.nodes() if not n.is_root))
        cache.check_invariants()
    assert trees[0] == trees[1] and len(trees[0]) >= len(requests)
    result = _controller_run(["--requests", "6", "--repeats", "1", "--tree-nodes", "4", "--ids", ids, "--batch", "3"])
    assert result["batch"] == 3 and "batches of 3" in result["timed"] and result["speedup"] > 0


@pytest.mark.parametrize("tp", ["abc", "0", "65", "1,,2", "1,"])  # an empty element was skipped
def test_bench_controller_refuses_a_bad_tp_before_timing_anything(monkeypatch, capsys, tp):
    from hicache_fsm.bench import controller
    from hicache_fsm.cli import main

    def timed(*_args, **_kwargs):
        raise AssertionError("the timed runs started before --tp was read")

    monkeypatch.setattr(controller, "make_cache", timed)
    assert main(["bench", "controller", "--tp", tp]) == 2
    assert "--tp wants" in capsys.readouterr().err


def _controller_run(argv: list[str]) -> dict:
    import argparse

    from hicache_fsm.bench import controller

    parser = argparse.ArgumentParser()
    controller.configure(parser)
    return controller.run(parser.parse_args(argv + ["--tp", ""]))
