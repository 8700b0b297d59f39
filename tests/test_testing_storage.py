"""The protocol toolkit on the storage tier: ManualStorageTier, the adapter's L3 operations, explorer and fuzzer."""

from __future__ import annotations

import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_fsm.storage import open_backend
from hicache_fsm.storage.faults import FaultyBackend
from hicache_fsm.storage.link import THREAD_PREFIX
from hicache_fsm.testing import (
    Bounds,
    HiCacheAdapter,
    Step,
    StorageFault,
    catalogue,
    explore,
    fault_schedules,
    hicache_machine,
    kv_fingerprint,
    multi_turn_workloads,
    perform,
)
from hicache_fsm.testing.stateful import HICACHE_VARIANTS
from hicache_fsm.testing.storage import FaultPlan, ManualStorageTier

pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.usefixtures("quiet_logs")]


def _ok(adapter, prompts):
    problems = catalogue(adapter, prompts)
    assert not problems, problems


def _states(adapter):
    return sorted((adapter.cache.tree.prefix_tokens(n), n.state) for n in adapter.cache.tree.nodes() if not n.is_root)


def _ack_all(adapter):
    for job in adapter.pending_jobs():
        adapter.complete_job(job.id)


def _storage_threads():
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]


# ------------------------------------------------------------------ the manual tier


def test_manual_tier_starts_no_threads_and_runs_steps_in_any_order():
    a = HiCacheAdapter(device_pages=4, host_pages=6, storage=True)
    assert isinstance(a.cache.storage, ManualStorageTier) and not a.cache.storage.link.threads
    assert not _storage_threads()
    a.insert((1, 2))
    a.insert((3,))
    _ack_all(a)
    steps = a.storage_steps()
    assert [s.kind for s in steps] == ["h2s", "h2s"]
    a.complete_storage(steps[1].id)  # the later backup first
    assert ((3,), "device_host_stored") in _states(a) and ((1, 2), "device_host_storing") in _states(a)
    a.complete_storage(steps[0].id)
    assert _states(a) == [((1, 2), "device_host_stored"), ((3,), "device_host_stored")]
    assert a.stored_prefix((1, 2)) == 2 and a.stored_prefix((3,)) == 1
    _ok(a, [(1, 2), (3,)])


def test_a_failed_step_makes_storage_unhealthy_until_a_probe_answers():
    a = HiCacheAdapter(device_pages=4, host_pages=6, storage=True)
    a.insert((1, 2))
    _ack_all(a)
    [backup] = a.storage_steps()
    a.fail_storage(backup.id)
    tier = a.cache.storage
    assert _states(a) == [((1, 2), "device_host")] and not tier.healthy
    assert a.prefetch((2, 2)) is None  # prefetches are refused while storage is down
    assert [s.kind for s in a.storage_steps()] == ["probe"]
    a.complete_storage("probe")
    assert tier.healthy
    a.poll()  # the retry sweep stores the node again
    [retry] = a.storage_steps()
    a.complete_storage(retry.id)
    assert _states(a) == [((1, 2), "device_host_stored")]
    _ok(a, [(1, 2)])


def test_fault_plan_plays_scheduled_faults_on_the_selected_calls():
    plan = FaultPlan()
    backend = FaultyBackend(open_backend("memory://"), plan)
    plan.arm(StorageFault("raise", call="set", after=1, count=1))
    assert backend.batch_set(["a" * 64], [b"x"]) == [True]  # the first set passes
    with pytest.raises(Exception, match="scheduled storage error"):
        backend.batch_set(["b" * 64], [b"y"])
    assert backend.batch_set(["b" * 64], [b"y"]) == [True] and not plan.armed
    plan.arm(StorageFault("short", call="exists"))
    assert backend.batch_exists(["a" * 64, "b" * 64]) == 1
    plan.arm(StorageFault("corrupt", call="get"))
    assert backend.batch_get(["a" * 64]) == [None] and plan.corrupted == {"a" * 64}
    plan.fail_next()
    with pytest.raises(Exception, match="failed by the test"):
        backend.batch_exists(["b" * 64])
    with pytest.raises(ValueError):
        plan.arm(StorageFault("raise", call="nope"))


# ------------------------------------------------------------------ prefetch through the adapter


def test_backup_evict_prefetch_load_back_reads_the_kv_back():
    a = HiCacheAdapter(device_pages=3, host_pages=5, storage=True)
    p = (1, 2, 3)
    a.insert(p)
    _ack_all(a)
    a.complete_storage(a.storage_steps()[0].id)
    assert a.evict(3) == 3 and a.evict_host(3) == 3 and _states(a) == []
    rid = a.prefetch(p)
    assert rid is not None and [r.id for r in a.prefetching()] == [rid]
    for kind in ("query", "s2h"):
        [step] = a.storage_steps()
        assert step.kind == kind
        a.complete_storage(step.id)
        _ok(a, [p])
    assert a.prefetch_ready(rid) and not a.prefetching()
    assert _states(a) == [(p, "host_stored")]
    assert a.load_back(p) == 3
    _ack_all(a)
    assert _states(a) == [(p, "device_host_stored")]
    assert a.read_kv(p) == [(kv_fingerprint(p[: i + 1]),) * 2 for i in range(3)]
    _ok(a, [p])


def test_prefetch_under_a_cached_prefix_pins_its_anchor_until_released():
    a = HiCacheAdapter(device_pages=4, host_pages=6, storage=True)
    a.insert((1,))
    _ack_all(a)
    a.store_remote((1, 2, 3))  # another instance backed the longer prompt up
    rid = a.prefetch((1, 2, 3))
    anchor = a.cache.tree.get(next(n.id for n in a.cache.tree.nodes() if n.key == (1,)))
    assert anchor.host_ref == 1  # the anchor's host copy is pinned
    _ok(a, [(1, 2, 3)])
    a.complete_storage(a.storage_steps()[0].id)  # the hit query
    assert a.prefetch_ready(rid)  # best_effort: the scheduler may end it before the transfer
    assert anchor.host_ref == 0 and _states(a) == [((1,), "device_host_storing")]  # its own backup runs
    [transfer] = [s for s in a.storage_steps() if s.kind == "s2h"]
    a.complete_storage(transfer.id)  # the release queue frees the reserved pages when the transfer ends
    _ok(a, [(1, 2, 3)])
    assert a.cache.storage.runtime.occupied_tokens == 0


def test_short_transfer_inserts_only_the_pages_that_landed():
    a = HiCacheAdapter(device_pages=4, host_pages=6, storage=True, batch_pages=2)
    p = (1, 2, 3, 1)
    assert a.store_remote(p) == 4
    rid = a.prefetch(p)
    a.complete_storage(a.storage_steps()[0].id)
    a.storage_fault(StorageFault("short", call="get"))  # the first batch returns one page of two
    a.complete_storage(a.storage_steps()[0].id)
    assert a.cache.storage.runtime.active[rid].state == "partial"
    assert a.prefetch_ready(rid)
    assert _states(a) == [((1,), "host_stored")]
    _ok(a, [p])


@pytest.mark.parametrize("when", ["admitted", "transferring"])
def test_abort_releases_every_slot(when):
    a = HiCacheAdapter(device_pages=4, host_pages=6, storage=True)
    p = (1, 2, 3)
    a.store_remote(p)
    free = a.host_pool.allocator.free_pages
    rid = a.prefetch(p)
    if when == "transferring":
        a.complete_storage(a.storage_steps()[0].id)
    assert a.abort(rid) and not a.prefetching()
    _ok(a, [p])
    for step in a.storage_steps():  # a transfer still queued ends without writing anything
        a.complete_storage(step.id)
    _ok(a, [p])
    assert a.host_pool.allocator.free_pages == free and _states(a) == []


def test_storage_operations_need_storage():
    a = HiCacheAdapter()
    assert not a.supports("prefetch") and not a.supports("complete_storage") and a.storage_steps() == []
    assert perform(a, Step("prefetch", ((1,),))).skipped
    b = HiCacheAdapter(storage=True)
    assert b.supports("prefetch") and b.supports("fail_storage") and b.supports("store_remote")


# ------------------------------------------------------------------ explorer support


def test_clone_with_storage_is_independent():
    a = HiCacheAdapter(device_pages=3, host_pages=5, storage=True)
    a.insert((1, 2))
    _ack_all(a)
    a.store_remote((3, 1))
    rid = a.prefetch((3, 1))
    before = (_states(a), a.state_key(), [s.id for s in a.storage_steps()])
    b = a.clone()
    assert b.state_key() == a.state_key()
    for step in b.storage_steps():
        b.complete_storage(step.id)
    b.complete_storage(b.storage_steps()[0].id)  # the transfer queued by the hit query
    assert b.prefetch_ready(rid) and ((3, 1), "host_stored") in _states(b)
    _ok(b, [(1, 2), (3, 1)])
    assert (_states(a), a.state_key(), [s.id for s in a.storage_steps()]) == before
    assert a.stored_prefix((1, 2)) == 0 and b.stored_prefix((1, 2)) == 2  # b's backup went to b's storage
    for step in a.storage_steps():
        a.fail_storage(step.id)
    _ok(a, [(1, 2), (3, 1)])


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete"])
def test_explorer_with_storage_finds_no_violation(policy):
    result = explore(Bounds(nodes=2, device_pages=2, host_pages=2, storage=True, stop_policy=policy,
                            max_states=600))
    assert not result.violations, result.violations[0].format()
    assert result.states >= 600 and result.max_depth >= 3


# ------------------------------------------------------------------ the fuzzer and engine-like workloads

STORAGE_VARIANTS = [v for v in HICACHE_VARIANTS if v.get("storage")]
HiCacheStorageProtocol = hicache_machine(STORAGE_VARIANTS, name="HiCacheStorageProtocol", examples=60, steps=40)
TestHiCacheStorageProtocol = HiCacheStorageProtocol.TestCase


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(workload=multi_turn_workloads(), schedule=fault_schedules(), store_first=st.booleans())
def test_multi_turn_workloads_prefetch_from_storage(workload, schedule, store_first):
    """Serve a workload like an engine with L3: match, prefetch what is missing, let storage and the
    executor progress, wait for the prefetch, load back, insert; storage faults as the schedule arms them."""
    a = HiCacheAdapter(device_pages=6, host_pages=8, storage=True)
    for fault in schedule.storage:
        a.storage_fault(fault)
    prompts = []
    for n, req in enumerate(workload.requests):
        if store_first and n % 2:
            a.store_remote(req.tokens)
        rid = a.prefetch(req.tokens)
        _ok(a, prompts)
        for step in a.storage_steps():  # queued storage work, oldest first (the hit query among it)
            if step.id in {s.id for s in a.storage_steps()}:
                a.complete_storage(step.id)
                _ok(a, prompts)
        if rid is not None:
            for _ in range(3):
                if a.prefetch_ready(rid):
                    break
                for step in a.storage_steps():
                    a.complete_storage(step.id)
            else:
                a.abort(rid)
            _ok(a, prompts)
        for op, arg in (("load_back", req.tokens), ("insert", req.tokens)):
            out = perform(a, Step(op, (arg,)), catch=False)
            assert not out.problems, out.problems
        prompts.append(req.tokens)
        _ok(a, prompts)
        if n % schedule.ack_every == 0:
            _ack_all(a)
            _ok(a, prompts)
    for _ in range(4):  # drain: every job and storage step ends exactly once
        _ack_all(a)
        for step in a.storage_steps():
            if step.id in {s.id for s in a.storage_steps()}:
                a.complete_storage(step.id)
    for rid in [r.id for r in a.prefetching()]:
        a.abort(rid)
    _ok(a, prompts)
    a.close()
