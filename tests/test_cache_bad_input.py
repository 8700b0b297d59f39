"""Bad input: every rejection is a typed error with a clear message, and changes nothing."""

from __future__ import annotations

import pytest
import torch

from cache_helpers import drain, make_cache, pages, put
from hicache_fsm.cache import InvariantViolation
from hicache_fsm.errors import BadIndices, CompletionsFailed, GuardRejected, HiCacheError, LockError, UnknownJob, UnknownNode
from hicache_fsm.jobs import Completion


def rejected(cache, error, match, fn, *args, **kw):
    before = cache.snapshot()
    with pytest.raises(error, match=match):
        fn(*args, **kw)
    assert cache.snapshot() == before
    cache.check_invariants()


@pytest.fixture
def loaded():
    cache, ex = make_cache()
    a = put(cache, pages(2)).node
    b = put(cache, pages(4)).node
    drain(cache, ex)
    return cache, ex, a, b


# ------------------------------------------------------------------ nodes


def test_unknown_nodes_are_rejected(loaded):
    cache, ex, a, b = loaded
    other, _ = make_cache()
    foreign = put(other, pages(2)).node
    for op in (cache.lock, cache.unlock, cache.load_back, cache.write_backup, cache.evict_node,
               cache.pin_host, cache.unpin_host):
        for bad in (foreign, 17, "node", None):
            rejected(cache, UnknownNode, "not a live node", op, bad)


def test_removed_node_is_unknown(loaded):
    cache, ex, a, b = loaded
    cache.evict(100)
    cache.evict_host(4 * 4)  # b (a leaf) leaves the tree
    assert not cache.tree.owns(b)
    rejected(cache, UnknownNode, "not a live node", cache.load_back, b)
    rejected(cache, UnknownNode, "not a live node", cache.lock, b)


def test_root_is_not_an_operand_of_node_operations(loaded):
    cache, ex, a, b = loaded
    for op in (cache.write_backup, cache.evict_node, cache.pin_host):
        rejected(cache, UnknownNode, "not a live node", op, cache.tree.root)


# ------------------------------------------------------------------ jobs


def test_ack_of_unknown_job(loaded):
    cache, ex, a, b = loaded
    rejected(cache, UnknownJob, "not a job of this cache", cache.complete, Completion(10**9))
    rejected(cache, UnknownJob, "expected a Completion", cache.complete, 5)


def test_double_ack_is_rejected():
    cache, ex = make_cache()
    put(cache, pages(2))
    (job,) = cache.pending_job_ids()
    cache.complete(Completion(job))
    rejected(cache, UnknownJob, "already acknowledged", cache.complete, Completion(job))
    rejected(cache, UnknownJob, "already acknowledged", cache.complete, Completion(job, ok=False))


def test_ledger_memory_stays_bounded_and_counts_stay_exact():
    cache, ex = make_cache()
    cache.job_ledger.window = 3
    jobs = []
    for i in range(5):
        put(cache, pages(1, start=100 * i))
        jobs += cache.pending_job_ids()
        drain(cache, ex)
    ledger = cache.job_ledger
    assert list(ledger.recent) == jobs[-3:]  # only the newest ids are remembered
    assert (ledger.emitted, ledger.acked, ledger.failed) == (5, 5, 0)
    cache.check_invariants()
    rejected(cache, UnknownJob, "already acknowledged", cache.complete, Completion(jobs[-1]))
    rejected(cache, UnknownJob, "not a job of this cache", cache.complete, Completion(jobs[0]))  # aged out


def test_invariant_catches_a_job_that_vanished():
    cache, ex = make_cache()
    put(cache, pages(1))
    (job,) = cache.pending_job_ids()
    cache.outbox.forget(job)  # dropped without an ack: the ledger equation no longer holds
    with pytest.raises(InvariantViolation, match="dropped or ended twice"):
        cache.check_invariants()


def test_poll_applies_valid_completions_before_reporting_an_unknown_one():
    cache, ex = make_cache()
    node = put(cache, pages(2)).node
    cache.poll()
    ex.complete_all()
    ex._queue.append(Completion(10**9))  # an executor reporting a job it was never given
    with pytest.raises(CompletionsFailed) as info:
        cache.poll()
    (failure,) = info.value.failures
    assert isinstance(failure.error, UnknownJob) and failure.completion == Completion(10**9)
    assert [c.job_id for c in info.value.applied] != [] and node.state == "device_host"
    cache.check_invariants()


# ------------------------------------------------------------------ locks


def test_unlock_below_zero(loaded):
    cache, ex, a, b = loaded
    rejected(cache, LockError, "not locked itself", cache.unlock, b)
    cache.lock(a)
    rejected(cache, LockError, "not locked itself", cache.unlock, b)  # b itself was never locked
    cache.unlock(a)
    rejected(cache, LockError, "below zero", cache.unpin_host, a)


def test_locked_node_is_skipped_by_evict_and_refused_by_explicit_eviction(loaded):
    cache, ex, a, b = loaded
    cache.lock(b)
    assert cache.evict(100) == 0
    assert a.state == b.state == "device_host"
    rejected(cache, LockError, "locked", cache.evict_node, b)
    rejected(cache, LockError, "locked", cache.evict_node, a)
    rejected(cache, BadIndices, "not handed out by alloc_device", cache.free_device, b.device_indices)
    cache.unlock(b)
    assert cache.evict(100) == 16


def test_explicit_operations_in_the_wrong_state(loaded):
    cache, ex, a, b = loaded
    rejected(cache, GuardRejected, "only a device-only node", cache.write_backup, b)
    rejected(cache, GuardRejected, "children", cache.evict_node, a)  # b is still on the device
    cache.evict_node(b)
    rejected(cache, LockError, "not on the device", cache.lock, b)
    rejected(cache, GuardRejected, "evict_device", cache.evict_node, b)
    cache.evict_node(a)
    cache.load_back(b)
    rejected(cache, GuardRejected, "not evictable now", cache.evict_node, b)  # loading


# ------------------------------------------------------------------ index tensors


def _fresh(cache, n):
    idx = cache.alloc_device(n)
    assert idx is not None
    return idx


BAD_TENSORS = [
    (lambda idx: idx.to(torch.int32), "1-D int64"),
    (lambda idx: idx.to(torch.float32), "1-D int64"),
    (lambda idx: idx.view(2, -1), "1-D int64"),
    (lambda idx: idx.tolist(), "torch.Tensor"),
    (lambda idx: torch.empty(idx.numel(), dtype=torch.int64, device="meta"), "kept on the CPU"),
    (lambda idx: idx[:-4], "expected 8"),
    (lambda idx: idx + 1, "whole pages"),
    (lambda idx: idx.flip(0), "whole pages"),
    (lambda idx: torch.cat([idx[:2], idx[4:], idx[2:4]]), "whole pages"),
    (lambda idx: idx - idx.min() - 4 * 1000, "whole pages"),
    (lambda idx: idx + 4 * 1000, "out of range"),
]


@pytest.mark.parametrize("make_bad,match", BAD_TENSORS)
def test_insert_rejects_malformed_indices(make_bad, match):
    cache, ex = make_cache()
    put(cache, pages(1))
    idx = _fresh(cache, 8)
    rejected(cache, BadIndices, match, cache.insert, pages(2, start=100), make_bad(idx))
    cache.insert(pages(2, start=100), idx)  # the good tensor still works afterwards
    cache.check_invariants()


def test_insert_rejects_indices_not_from_alloc_device(loaded):
    cache, ex, a, b = loaded
    free_page = sorted(set(range(16)) - cache.device_allocator.owned_pages())[0]
    never_allocated = torch.arange(free_page * 4, free_page * 4 + 8) if free_page < 15 else None
    if never_allocated is not None:
        rejected(cache, BadIndices, "not handed out by alloc_device", cache.insert, pages(2, start=50), never_allocated)
    # a node's own slots for tokens that are not that node's
    rejected(cache, BadIndices, "not handed out by alloc_device", cache.insert, pages(2, start=50), a.device_indices)
    idx = _fresh(cache, 4)
    rejected(cache, BadIndices, "same page twice", cache.insert, pages(2, start=50), torch.cat([idx, idx]))
    cache.insert(pages(1, start=50), idx)
    rejected(cache, BadIndices, "already inserted", cache.insert, pages(1, start=60), idx)


def test_insert_own_indices_must_match_page_for_page(loaded):
    cache, ex, a, b = loaded
    own = cache.match_prefix(pages(4)).device_indices
    swapped = torch.cat([own[4:8], own[:4], own[8:]])  # the cache's pages, in the wrong order
    rejected(cache, BadIndices, "not handed out", cache.insert, pages(4), swapped)


def test_insert_rejects_token_count_not_whole_pages(loaded):
    cache, ex, a, b = loaded
    idx = _fresh(cache, 8)
    rejected(cache, BadIndices, "whole pages", cache.insert, tuple(range(7)), idx)
    rejected(cache, BadIndices, "int", cache.insert, pages(2, start=70), idx, priority="high")


def test_unhashable_namespace_is_rejected(loaded):
    cache, ex, a, b = loaded
    rejected(cache, BadIndices, "hashable", cache.match_prefix, pages(2), ["lora"])
    idx = _fresh(cache, 8)
    rejected(cache, BadIndices, "hashable", cache.insert, pages(2), idx, ["lora"])


def test_float_token_tensor_is_rejected(loaded):
    cache, ex, a, b = loaded
    rejected(cache, BadIndices, "must be an int", cache.match_prefix, torch.zeros(8))
    m = cache.match_prefix(torch.arange(16))  # an integer tensor of token ids is fine
    assert m.device_hit_length == 16


FREE_BAD = [
    (lambda idx: idx.to(torch.int32), "1-D int64"),
    (lambda idx: idx.to(torch.float32), "1-D int64"),
    (lambda idx: idx.view(2, -1), "1-D int64"),
    (lambda idx: idx.tolist(), "torch.Tensor"),
    (lambda idx: torch.empty(8, dtype=torch.int64, device="meta"), "kept on the CPU"),
    (lambda idx: idx[:6], "whole number of pages"),
    (lambda idx: idx + 1, "whole pages"),
]


@pytest.mark.parametrize("make_bad,match", FREE_BAD)
def test_free_device_rejects_malformed_indices(make_bad, match):
    cache, ex = make_cache()
    idx = _fresh(cache, 8)
    rejected(cache, BadIndices, match, cache.free_device, make_bad(idx))
    cache.free_device(idx)
    rejected(cache, BadIndices, "not handed out", cache.free_device, idx)  # double free


@pytest.mark.parametrize("n", [3, -4, 4.0, True])
def test_alloc_device_rejects_bad_counts(n):
    cache, ex = make_cache()
    rejected(cache, BadIndices, "alloc_device wants", cache.alloc_device, n)


@pytest.mark.parametrize("fn", ["evict", "evict_host"])
def test_evict_counts_must_be_ints(fn):
    cache, ex = make_cache()
    rejected(cache, BadIndices, "int token count", getattr(cache, fn), 2.5)


def test_errors_share_one_base_class():
    for err in (BadIndices, GuardRejected, LockError, UnknownJob, UnknownNode):
        assert issubclass(err, HiCacheError)


# ------------------------------------------------------------------ configuration the reference refuses


def test_pool_combinations_that_cannot_work_are_refused_with_the_reason():
    from hicache_fsm.cache import HiCache
    from hicache_fsm.errors import ConfigError
    from hicache_fsm.pools import DeviceKVPool, HostKVPool, KVShape

    shape = KVShape(layers=1, heads=1, head_dim=2)
    dev, host = DeviceKVPool(shape, 32, 4, "cpu"), HostKVPool(shape, 64, 4, pin_memory=False)
    with pytest.raises(ConfigError, match="same page size"):
        HiCache(dev, HostKVPool(shape, 64, 8, pin_memory=False))
    with pytest.raises(ConfigError, match="given together"):
        HiCache(dev, host, draft_device_pool=DeviceKVPool(shape, 32, 4, "cpu"))
    with pytest.raises(ConfigError, match="page size"):
        HiCache(dev, host, draft_device_pool=DeviceKVPool(shape, 32, 8, "cpu"),
                draft_host_pool=HostKVPool(shape, 64, 8, pin_memory=False))
    with pytest.raises(ConfigError, match="CacheConfig"):
        HiCache(dev, host, config={"write_policy": "write_back"})


# ------------------------------------------------------------------ pools and executor


def test_pools_serve_one_open_cache_at_a_time(loaded):
    """A second cache over the same slots would free the first's (``reset``) and hand them out again."""
    from hicache_fsm.cache import HiCache
    from hicache_fsm.errors import ConfigError
    from hicache_fsm.executors import ManualExecutor

    cache, ex, a, b = loaded
    pools = (cache.device_pool, cache.host_pool)
    before = cache.snapshot()
    with pytest.raises(ConfigError, match="already serve another HiCache"):
        HiCache(*pools, executor=ManualExecutor(*pools))
    with pytest.raises(ConfigError, match="already serve another HiCache"):  # either pool is enough
        HiCache(make_cache()[0].device_pool, cache.host_pool)
    assert cache.snapshot() == before
    cache.close()
    after = HiCache(*pools, executor=ManualExecutor(*pools))  # closed: the pools may serve a new cache
    after.close()


def test_a_cache_refused_after_binding_its_pools_leaves_them_free():
    from hicache_fsm.cache import HiCache
    from hicache_fsm.errors import ConfigError

    first, _ = make_cache()
    pools = (first.device_pool, first.host_pool)
    first.close()
    with pytest.raises(ConfigError, match="process group"):
        HiCache(*pools, group="not a group")
    HiCache(*pools).close()


@pytest.mark.parametrize("executor", ["torch", object(), (lambda batch: None)])
def test_an_executor_without_the_executor_methods_is_refused(executor):
    from hicache_fsm.cache import HiCache
    from hicache_fsm.errors import ConfigError

    first, _ = make_cache()
    pools = (first.device_pool, first.host_pool)
    first.close()
    with pytest.raises(ConfigError, match="executor must have submit, poll, synchronize, close"):
        HiCache(*pools, executor=executor)
    HiCache(*pools).close()  # the refusal bound nothing


def test_an_executor_serves_one_cache_over_that_cache_s_pools():
    """Copies over other pools miss the cache's slots; a shared executor hands completions to one cache only."""
    from hicache_fsm.cache import HiCache
    from hicache_fsm.errors import ConfigError
    from hicache_fsm.executors import AckExecutor, ManualExecutor, TorchExecutor

    first, second = make_cache()[0], make_cache()[0]
    mine = (first.device_pool, first.host_pool)
    theirs = (second.device_pool, second.host_pool)
    first.close()
    second.close()
    for executor in (ManualExecutor(*theirs), TorchExecutor(*theirs)):
        with pytest.raises(ConfigError, match="copies between other pools"):
            HiCache(*mine, executor=executor)
    shared = AckExecutor(layers=mine[0].layers)  # copies nothing, so it has no pools to compare
    one = HiCache(*mine, executor=shared)
    with pytest.raises(ConfigError, match="already serves another HiCache"):
        HiCache(*theirs, executor=shared)
    HiCache(*theirs).close()  # that refusal left the other pools free
    one.close()


def test_a_resource_has_one_user_until_it_gives_up_or_is_dropped():
    import copy
    import gc

    from hicache_fsm.errors import ConfigError
    from hicache_fsm.sole_user import SoleUser

    class User:
        pass

    held, first, second = SoleUser(), User(), User()
    held.take(first, ConfigError("taken"))
    held.take(first, ConfigError("taken"))  # the same user again: fine
    with pytest.raises(ConfigError, match="taken"):
        held.take(second, ConfigError("taken"))
    copy.deepcopy(held).take(second, ConfigError("taken"))  # a copy is another resource, used by nobody
    held.give_up(second)  # not its user: nothing changes
    with pytest.raises(ConfigError):
        held.take(second, ConfigError("taken"))
    del first
    gc.collect()
    held.take(second, ConfigError("taken"))  # a user dropped without giving up frees it
