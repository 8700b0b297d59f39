"""Calls an outside probe of the public API found accepted, or half-applied: each is now refused with a typed
error before anything changes (or, for ``close``, releases everything even when the executor fails)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache_fsm.cache import HiCache
from hicache_fsm.config import CacheConfig
from hicache_fsm.errors import BadIndices, ConfigError, LockError, StorageKeyError, UnknownJob
from hicache_fsm.executors import ManualExecutor, TorchExecutor
from hicache_fsm.jobs import Completion
from hicache_fsm.pools import DeviceKVPool, HostKVPool, KVShape, PoolConfig
from hicache_fsm.storage.memory import MemoryBackend
from hicache_fsm.testing.adapter import HiCacheAdapter

PS = 4


def pools(device_pages: int = 8, host_pages: int = 16) -> tuple[DeviceKVPool, HostKVPool]:
    shape = KVShape(1, 1, 4)
    return DeviceKVPool(shape, device_pages * PS, PS, "cpu"), HostKVPool(shape, host_pages * PS, PS, pin_memory=False)


def cache(device_pages: int = 8, host_pages: int = 16, **config) -> HiCache:
    return HiCache(*pools(device_pages, host_pages), CacheConfig(**config))


def put(c: HiCache, tokens: list[int]):
    m = c.match_prefix(tokens)
    return c.insert(tokens, torch.cat([m.device_indices, c.alloc_device(len(tokens) - m.device_hit_length)])).node


def state(c: HiCache) -> tuple:
    return c.snapshot(), c.device_allocator.available_tokens, c.host_allocator.available_tokens


# =========================================================================== locks


def test_unlocking_an_ancestor_that_was_not_locked_itself_is_refused():
    """Its lock ref was the child's lock: taking it would leave the child locked with an unlocked path, its pages
    unevictable until a reset."""
    c = cache()
    parent = put(c, list(range(4)))
    child = put(c, list(range(8)))
    c.lock(child)
    before = state(c)
    with pytest.raises(LockError, match="not locked itself"):
        c.unlock(parent)
    assert state(c) == before and not c.invariant_violations()
    c.unlock(child)
    assert (parent.lock_ref, child.lock_ref) == (0, 0) and c.evict(8 * PS) == 8


def test_the_upper_half_of_a_split_locked_node_cannot_be_unlocked_in_its_place():
    c = cache()
    node = put(c, list(range(8)))
    c.lock(node)
    c.match_prefix(list(range(4)) + [99, 99, 99, 99])  # splits the node after its first page
    upper = node.parent
    assert upper.num_tokens == 4 and upper.lock_ref == 1
    with pytest.raises(LockError):
        c.unlock(upper)
    c.unlock(node)
    assert upper.lock_ref == node.lock_ref == 0 and not c.invariant_violations()


def test_lock_refs_that_do_not_add_up_are_an_invariant_violation():
    c = cache()
    parent = put(c, list(range(4)))
    put(c, list(range(8)))
    parent.lock_ref += 1  # a lock ref no lock of its own or of a child accounts for
    assert any("lock_ref 1, but 0 lock(s) of its own" in p for p in c.invariant_violations())


# =========================================================================== requests that can never succeed


def test_an_allocation_larger_than_the_pool_evicts_nothing():
    c = cache(write_policy="write_through_selective")  # no backups: an eviction drops the KV
    put(c, list(range(16)))
    before = state(c)
    assert c.alloc_device(10**9) is None and c.alloc_device(8 * PS + PS) is None
    assert state(c) == before


def test_a_load_back_larger_than_the_device_pool_evicts_nothing():
    """A prefetch brings a three-page chain to the host of a cache whose device holds two pages: no eviction could
    make room for its load-back, so none is made (the one page cached on the device stays)."""
    a = HiCacheAdapter(device_pages=2, host_pages=8, storage=True, stop_policy="wait_complete")
    try:
        a.store_remote((1, 1, 1))  # another instance stored it
        a.insert((2,))
        for job in a.pending_jobs():
            a.complete_job(job.id)
        a.prefetch((1, 1, 1))
        while a.storage_steps():
            a.complete_storage(a.storage_steps()[0].id)
        a.prefetch_ready(a.prefetching()[0].id)
        c = a.cache
        m = c.match_prefix((1, 1, 1))
        assert m.host_hit_length == 3
        before = [(n.id, n.state) for n in c.tree.nodes()], c.device_allocator.available_tokens
        assert c.load_back(m.last_host_node) is None
        assert ([(n.id, n.state) for n in c.tree.nodes()], c.device_allocator.available_tokens) == before
        assert c.stats()["load_back_device_full"] == 1
    finally:
        a.close()


# =========================================================================== close and its collaborators


class FailingSync(TorchExecutor):
    """An executor whose device was lost: every wait for it raises."""

    def synchronize(self) -> None:
        raise RuntimeError("device lost")


def test_close_releases_the_executor_and_the_pools_when_the_executor_fails():
    device, host = pools()
    c = HiCache(device, host, CacheConfig(), FailingSync(device, host))
    put(c, list(range(4)))  # a backup in flight
    with pytest.raises(RuntimeError, match="device lost"):
        c.close()
    assert c.closed
    c.close()  # closed already: nothing more to do
    HiCache(device, host).close()  # the pools serve a new cache


def test_an_executor_class_is_refused_for_an_instance():
    with pytest.raises(ConfigError, match="got the class ManualExecutor"):
        HiCache(*pools(), executor=ManualExecutor)


@pytest.mark.parametrize("options", [dict(join_timeout=float("inf")), dict(join_timeout=1e300),
                                     dict(join_timeout=10**400), dict(probe_interval=float("inf")),
                                     dict(retry_interval=float("nan"))])
def test_seconds_no_thread_wait_takes_are_refused_at_attach(options):
    c = cache()
    try:
        with pytest.raises(ConfigError, match="finite number of seconds"):
            c.attach_storage("memory://", **options)
        assert not c.storage_attached
    finally:
        c.close()


def test_a_drain_beyond_any_float_is_a_config_error():
    c = cache()
    with pytest.raises(ConfigError, match="finite number of seconds"):
        c.close(drain=10**400)
    c.close()


# =========================================================================== what the engine hands in


@pytest.mark.parametrize("ok", ["no", None, 1])
def test_a_completion_whose_ok_is_not_a_bool_is_refused(ok):
    device, host = pools()
    executor = ManualExecutor(device, host)
    c = HiCache(device, host, CacheConfig(), executor)
    node = put(c, list(range(4)))
    c.poll()  # the backup starts
    [job] = executor.pending_jobs()
    with pytest.raises(UnknownJob, match="Completion.ok is True or False"):
        c.complete(Completion(job.id, ok, "copy failed"))
    assert node.state == "writing_host"
    c.complete(Completion(job.id, True))
    assert node.state == "device_host"


@pytest.mark.parametrize("observer", [5, None, "print"])
def test_an_observer_that_cannot_be_called_is_refused_when_added(observer):
    c = cache()
    with pytest.raises(TypeError, match="observer"):
        c.add_observer(observer)
    put(c, list(range(4)))  # inserts as before: nothing was added
    assert not c.invariant_violations()


@pytest.mark.parametrize("page", [1.7, "3", True])
def test_a_host_page_id_must_be_an_integer(page):
    _, host = pools()
    with pytest.raises(BadIndices, match="page id must be an int"):
        host.page_views(page)


def test_an_infinite_host_ratio_is_a_config_error():
    with pytest.raises(ConfigError, match="host_ratio must be a finite number"):
        PoolConfig(KVShape(1, 1, 4), device_tokens=32, page_size=PS, host_ratio=float("inf"))


@pytest.mark.parametrize("layer, k", [(1.0, None), (True, None), (0, "numpy"), (0, "meta")])
def test_a_device_pool_write_takes_an_int_layer_and_kv_tensors_with_values(layer, k):
    device, _ = pools()
    idx, kv = torch.arange(PS), torch.zeros(PS, 1, 4)
    k = {"numpy": kv.numpy(), "meta": kv.to("meta"), None: kv}[k]
    with pytest.raises(BadIndices, match="layer must be an int|must be torch tensors|meta device"):
        device.write(idx, layer, k, kv)


@pytest.mark.parametrize("k", [[[1]], "meta"])
def test_a_host_pool_write_takes_kv_tensors_with_values(k):
    _, host = pools()
    kv = torch.zeros(1, PS, 1, 4)
    with pytest.raises(BadIndices, match="must be torch tensors|meta device"):
        host.write(torch.arange(PS), kv.to("meta") if k == "meta" else k, kv)


# =========================================================================== storage backends


def test_a_backend_refuses_an_object_array_for_page_bytes():
    """Its buffer holds object addresses of this process, not KV."""
    backend = MemoryBackend()
    with pytest.raises(StorageKeyError, match="not Python objects"):
        backend.batch_set(["page"], [np.array([None], dtype=object)])
    assert backend.batch_exists(["page"]) == 0


@pytest.mark.parametrize("pool", [None, object()])
def test_zero_copy_calls_refuse_what_is_not_a_host_pool(pool):
    backend = MemoryBackend()
    for call in (backend.batch_get_into, backend.batch_set_from):
        with pytest.raises(StorageKeyError, match="host_pool must be a HostKVPool"):
            call(["page"], pool, [0])


def test_inference_mode_buffers_are_refused_at_adoption():
    """They were accepted; every write into them then raised, and a load-back left wrong KV behind a wait that
    returned."""
    from hicache_fsm.engine_kv import adopt_sglang_mha

    with torch.inference_mode():
        k, v = [torch.zeros(64, 2, 4)], [torch.zeros(64, 2, 4)]
    with pytest.raises(ConfigError, match="inference-mode tensor"):
        adopt_sglang_mha(k, v, 4)


# =========================================================================== found by a third probe


def test_a_cp_world_whose_ranks_an_int8_owner_cannot_hold_is_refused():
    """Owners are kept as int8: rank 150 wrapped to -106, and the load-back refused metadata the library wrote."""
    from hicache_fsm.cp import MAX_CP_RANKS, CPLayout

    CPLayout(MAX_CP_RANKS, MAX_CP_RANKS - 1, 2, 64)
    for world in (MAX_CP_RANKS + 1, 10**30):
        with pytest.raises(ConfigError, match="world_size must be at most 128"):
            CPLayout(world, 5, 2, 64)


@pytest.mark.parametrize("call", ["options_of_a_path", "options_of_none", "run_of_none", "bound", "sweep"])
def test_trace_replay_arguments_of_the_wrong_kind_are_config_errors(call):
    from hicache_fsm.trace import Trace, TraceRequest
    from hicache_fsm.trace_replay import TraceOptions, run_trace

    trace = Trace("hand-made", 16, (TraceRequest(0.0, 16, 0, (1,), 1),))
    options = TraceOptions(trace, device_tokens=64, host_tokens=128, storage=False, device="cpu")
    calls = {"options_of_a_path": lambda: TraceOptions("f.jsonl"), "options_of_none": lambda: TraceOptions(None),
             "run_of_none": lambda: run_trace(None), "bound": lambda: run_trace(options, bound="x"),
             "sweep": lambda: run_trace(options, sweep=5)}
    with pytest.raises(ConfigError):
        calls[call]()


@pytest.mark.parametrize("layer", [-1, 99, "a", True, 1.0])
def test_a_layer_outside_the_pool_is_refused_by_its_page_views(layer):
    """-1 read the last layer, 99 raised IndexError, "a" TypeError."""
    device, host = pools()
    for pool in (device, host):
        with pytest.raises(BadIndices, match="layer must be an int in"):
            pool.layer_pages(layer)
    assert len(device.layer_pages(np.int64(0))) == 2  # a numpy integer is a layer number


def test_a_group_refuses_a_purpose_it_cannot_send_negated():
    from hicache_fsm.tp import RankGroup

    with pytest.raises(ConfigError, match="purpose must be an int"):
        RankGroup(None).min([1], purpose=-(2**63))


def test_a_load_wait_for_a_bad_layer_starts_nothing():
    device, host = pools()
    executor = ManualExecutor(device, host)
    c = HiCache(device, host, CacheConfig(), executor)
    node = put(c, list(range(4)))
    c.poll()
    for job in executor.pending_jobs():
        executor.complete(job.id)
    c.poll()
    c.evict(4)
    lb = c.load_back(c.match_prefix(list(range(4))).last_host_node)
    assert lb is not None and node.state == "loading"
    with pytest.raises(BadIndices, match="layer must be an int >= 0"):
        lb.handle.wait(-1)
    assert executor.pending_jobs() == []  # the load's job was not flushed to the executor
    c.close()
