"""The storage tier on a live cache: attach/detach, backups, prefetch lifecycle, L3 round trip."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch
from storage_util import (
    PAGE,
    WAIT,
    assert_kv_intact,
    evict_all,
    kv,
    load_and_read,
    make_cache,
    path_nodes,
    prompt,
    put,
    ready,
    settle,
    storage_threads,
    wait_until,
)

from hicache_fsm.errors import BadIndices, ConfigError, StorageLinkError
from hicache_fsm.storage import KeyNamespace, page_keys
from hicache_fsm.storage.faults import Fault, FaultyBackend
from hicache_fsm.storage.memory import MemoryBackend
from hicache_fsm.storage.prefetch import PrefetchError

FAST = {"prefetch_threshold": 8, "retry_interval": 0.01, "probe_interval": 0.02, "join_timeout": 5.0}


def opts(**kw):
    return {**FAST, **kw}


@pytest.fixture
def cache():
    c = make_cache()
    yield c
    c.close()
    assert not storage_threads(), "storage threads outlived close()"


@pytest.fixture(params=["file", "memory", "redis"])
def url(request, tmp_path):
    if request.param == "file":
        return f"file://{tmp_path}/l3"
    if request.param == "memory":
        return f"memory://tier-{abs(hash(request.node.nodeid))}"
    return request.getfixturevalue("redis_server").url


def slow(delay: float, method: str = "batch_get_into") -> FaultyBackend:
    return FaultyBackend(MemoryBackend(), [Fault("slow", method=method, delay=delay)])


class GatedBackend(MemoryBackend):
    """Reads (or writes) wait for permits the test hands out: how far a transfer got depends on the test only."""

    def __init__(self, writes: bool = False) -> None:
        super().__init__()
        self.permits = threading.Semaphore(0)
        self.writes = writes

    def _gated(self, gated: bool, call, keys, pool, page_ids) -> list[bool]:
        if not gated:
            return call(keys, pool, page_ids)
        out = []
        for key, page in zip(keys, page_ids):
            assert self.permits.acquire(timeout=WAIT), "the test never let this page through"
            out.extend(call([key], pool, [page]))
        return out

    def batch_get_into(self, keys, host_pool, page_ids) -> list[bool]:
        return self._gated(not self.writes, super().batch_get_into, keys, host_pool, page_ids)

    def batch_set_from(self, keys, host_pool, page_ids) -> list[bool]:
        return self._gated(self.writes, super().batch_set_from, keys, host_pool, page_ids)

    def let_through(self, pages: int) -> None:
        self.permits.release(pages)


def stored(cache, tokens) -> None:
    """Insert ``tokens`` with real KV and wait until storage acknowledged every page."""
    put(cache, tokens)
    wait_until(cache, lambda: all(n.state.endswith("stored") for n in path_nodes(cache, tokens)[0]),
               what="backup to storage")


def seed(cache, tokens) -> None:
    """Pages of ``tokens`` in storage only: stored, then evicted from device and host."""
    stored(cache, tokens)
    evict_all(cache, tokens)
    assert len(cache.tree) == 0


def baseline_host(cache) -> int:
    return cache.host_allocator.used_pages


# ====================================================================== attach / detach


def test_attach_detach_idempotent(cache, tmp_path):
    assert not cache.storage_attached
    cache.detach_storage()  # never attached: nothing to do
    cache.attach_storage(f"file://{tmp_path}", **FAST)
    assert cache.storage.state == "attached" and cache.storage_attached
    assert len(storage_threads()) == 2
    cache.check_invariants()
    cache.detach_storage()
    assert cache.storage.state == "detached" and not storage_threads()
    assert cache.storage.backend is None
    cache.detach_storage()  # idempotent
    cache.check_invariants()
    cache.attach_storage("memory://", **FAST)  # re-attach works
    assert cache.storage.state == "attached"
    cache.detach_storage()
    assert cache.stats()["storage"]["attaches"] == 2


def test_attach_twice_refused(cache):
    cache.attach_storage("memory://", **FAST)
    with pytest.raises(StorageLinkError):
        cache.attach_storage("memory://")
    assert cache.storage.state == "attached" and len(storage_threads()) == 2


def test_attach_bad_url_rolls_back(cache):
    with pytest.raises(StorageLinkError):
        cache.attach_storage("redis://127.0.0.1:1/0", connect_timeout=0.2, socket_timeout=0.2)
    assert cache.storage.state == "detached" and cache.storage.backend is None
    assert not storage_threads()
    with pytest.raises(StorageLinkError):
        cache.attach_storage("nosuch://x")
    cache.check_invariants()
    cache.attach_storage("memory://", **FAST)  # a later attach still works
    assert cache.storage.state == "attached"


def test_attach_failure_after_threads_started_rolls_back(cache):
    inner = MemoryBackend()
    bad = FaultyBackend(inner, [Fault("unavailable", method="batch_exists")])
    with pytest.raises(StorageLinkError, match="attaching storage failed"):
        cache.attach_storage(bad, **FAST)
    assert cache.storage.state == "detached"
    assert bad.closed and inner.closed, "rollback closes what the attach opened"
    assert not storage_threads(), "rollback stops the threads the attach started"
    assert cache.stats()["storage"]["attach_failures"] == 1
    cache.check_invariants()


def test_attach_bad_options_change_nothing(cache):
    with pytest.raises(ConfigError):
        cache.attach_storage("memory://", stop_policy="sometimes")
    with pytest.raises(ConfigError):
        cache.attach_storage("memory://", batch_pages=0)
    assert cache.storage is None or cache.storage.state == "detached"
    assert not storage_threads()


def test_detach_with_work_in_flight_ends_it_within_the_bound(cache):
    cache.attach_storage(slow(0.3, "batch_set_from"), **FAST)
    t = prompt(16)
    put(cache, t)
    wait_until(cache, lambda: cache.storage_transfers_in_flight() > 0, what="a backup to start")
    cache.detach_storage()  # the running backup ends (or fails), nothing waits on a timeout per job
    assert cache.storage.state == "detached" and not storage_threads()
    assert cache.storage_transfers_in_flight() == 0
    assert path_nodes(cache, t)[0][-1].state in ("device_host", "device_host_stored")
    cache.check_invariants()


def test_mla_non_zero_rank_skips_writes(cache):
    backend = MemoryBackend(KeyNamespace("m", tp_rank=1, tp_size=2, is_mla=True))
    cache.attach_storage(backend, is_mla=True, tp_rank=1, tp_size=2, **FAST)
    stored(cache, prompt(16))
    st = cache.stats()["storage"]
    assert st["backups_skipped_mla"] == 1 and st["backend_stats"]["sets"] == 0


def test_keys_chain_and_namespaces(cache):
    cache.attach_storage("memory://", **FAST)
    t = prompt(16)
    node = put(cache, t)
    assert cache.storage.keys_for(node) == tuple(page_keys(t, PAGE))  # SGLang-compatible chain
    lora = cache.insert(t, cache.alloc_device(16), namespace="lora-1").node
    assert set(cache.storage.keys_for(lora)).isdisjoint(cache.storage.keys_for(node))
    settle(cache)


# ====================================================================== round trip


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_l3_round_trip_bit_identical(url, layout):
    cache = make_cache(layout=layout)
    try:
        cache.attach_storage(url, stop_policy="wait_complete", batch_pages=3, **FAST)
        t = prompt(64, seed=1)
        seed(cache, t)
        cache.check_invariants()
        m = cache.match_prefix(t)
        assert m.device_hit_length == m.host_hit_length == 0
        assert cache.prefetch("r1", t, m)
        cache.check_invariants()
        ready(cache, "r1")
        cache.check_invariants()
        assert cache.stats()["storage"]["prefetch_inserted_tokens"] == 64
        k, v, n = load_and_read(cache, t)
        rk, rv = kv(t)
        assert n == 64 and torch.equal(k, rk) and torch.equal(v, rv)
        settle(cache)
        cache.check_invariants()
        assert cache.host_allocator.used_pages == len(t) // PAGE  # only the inserted node's pages
        cache.detach_storage()
    finally:
        cache.close()


def test_prefetch_under_host_anchor_pins_it(cache):
    cache.attach_storage(slow(0.05), stop_policy="wait_complete", batch_pages=1, **FAST)
    head = prompt(16, seed=2)
    t = head + prompt(32, seed=3)
    seed(cache, t)
    stored(cache, head)  # head back in memory, then only on host
    path, _ = path_nodes(cache, head)
    cache.evict_node(path[-1])
    anchor = path[-1]
    assert anchor.state == "host_stored"
    m = cache.match_prefix(t)
    assert m.host_hit_length == 16 and m.last_host_node is anchor
    assert cache.prefetch("r", t, m)
    assert anchor.host_ref == 1
    assert cache.evict_host(10_000) == 0  # the pinned anchor stays
    cache.check_invariants()
    ready(cache, "r")
    assert anchor.host_ref == 0
    k, v, n = load_and_read(cache, t)
    assert n == 48
    rk, rv = kv(t)
    assert torch.equal(k, rk) and torch.equal(v, rv)
    cache.check_invariants()


def test_prefetch_under_device_only_anchor_locks_it():
    cache = make_cache(write_policy="write_back")  # inserted nodes stay device-only
    try:
        cache.attach_storage(slow(0.03), stop_policy="wait_complete", batch_pages=1, **FAST)
        t = prompt(48, seed=4)
        node = put(cache, t)
        assert cache.write_backup(node)
        wait_until(cache, lambda: node.state == "device_host_stored", what="backup")
        evict_all(cache, t)
        head = t[:16]
        anchor = put(cache, head)
        assert anchor.state == "device"
        m = cache.match_prefix(t)
        assert m.device_hit_length == 16
        assert cache.prefetch("r", t, m)
        assert anchor.lock_ref == 1
        cache.check_invariants()
        ready(cache, "r")
        assert anchor.lock_ref == 0
        cache.check_invariants()
        assert cache.stats()["storage"]["prefetch_inserted_tokens"] == 32
    finally:
        cache.close()


# ====================================================================== stop policies


def test_wait_complete_waits_for_every_page(cache):
    gate = GatedBackend()
    cache.attach_storage(gate, stop_policy="wait_complete", batch_pages=1, **FAST)
    t = prompt(48, seed=5)
    seed(cache, t)
    assert cache.prefetch("r", t, cache.match_prefix(t))
    gate.let_through(48 // PAGE - 1)
    wait_until(cache, lambda: cache.storage.runtime.active["r"].completed_tokens == 48 - PAGE, what="all but a page")
    assert not cache.prefetch_ready("r")  # one page still missing
    gate.let_through(1)
    ready(cache, "r")
    st = cache.stats()["storage"]
    assert st["prefetch_completed"] == 1 and st["prefetch_inserted_tokens"] == 48
    settle(cache)
    cache.check_invariants()
    assert_kv_intact(cache, t, 48)


def test_best_effort_ends_at_once_with_what_arrived(cache):
    gate = GatedBackend()
    cache.attach_storage(gate, stop_policy="best_effort", batch_pages=1, **FAST)
    t = prompt(64, seed=6)
    seed(cache, t)
    assert cache.prefetch("r", t, cache.match_prefix(t))
    gate.let_through(2)
    wait_until(cache, lambda: cache.storage.runtime.active["r"].completed_tokens >= 8, what="two pages")
    assert cache.prefetch_ready("r")
    cache.check_invariants()
    inserted = cache.stats()["storage"]["prefetch_inserted_tokens"]
    assert inserted == 8  # the two pages let through, nothing more
    assert_kv_intact(cache, t, inserted)
    gate.let_through(64 // PAGE)  # the I/O thread may be waiting on the next page
    settle(cache)  # the I/O thread finishes its batch, then the release queue is freed
    cache.check_invariants()
    assert cache.host_allocator.used_pages == inserted // PAGE
    assert cache.stats()["storage"]["prefetch_tokens_held"] == 0


def test_timeout_policy(cache):
    gate = GatedBackend()
    cache.attach_storage(gate, stop_policy="timeout", batch_pages=1, timeout_base=0.15,
                         timeout_per_1k_tokens=0.0, **FAST)
    t = prompt(64, seed=7)
    seed(cache, t)
    t0 = time.monotonic()
    assert cache.prefetch("r", t, cache.match_prefix(t))
    gate.let_through(2)
    assert not cache.prefetch_ready("r") or time.monotonic() - t0 >= 0.15
    ready(cache, "r")
    assert time.monotonic() - t0 >= 0.15  # never before the timeout
    inserted = cache.stats()["storage"]["prefetch_inserted_tokens"]
    assert inserted <= 2 * PAGE  # stopped at the timeout with at most the pages let through
    gate.let_through(64 // PAGE)  # the I/O thread may be waiting on the next page
    settle(cache)
    cache.check_invariants()
    assert_kv_intact(cache, t, inserted)


def test_timeout_policy_ends_early_when_complete(cache):
    cache.attach_storage("memory://", stop_policy="timeout", timeout_base=30.0, **FAST)
    t = prompt(32, seed=8)
    seed(cache, t)
    assert cache.prefetch("r", t, cache.match_prefix(t))
    ready(cache, "r")
    assert cache.stats()["storage"]["prefetch_inserted_tokens"] == 32


def test_timeout_formula(cache):
    cache.attach_storage("memory://", stop_policy="timeout", timeout_base=1.0, timeout_per_1k_tokens=0.5,
                         timeout_max=2.0, **FAST)
    rt = cache.storage.runtime

    class Op:
        hit_tokens = 1024
        num_tokens = 4096

    assert rt.timeout_for(Op()) == pytest.approx(1.5)
    Op.hit_tokens = 0  # before the hit query: requested tokens, capped
    assert rt.timeout_for(Op()) == pytest.approx(2.0)


# ====================================================================== abort, revoke, admission


def test_abort_mid_transfer_releases_everything(cache):
    cache.attach_storage(slow(0.05), stop_policy="wait_complete", batch_pages=1, **FAST)
    t = prompt(64, seed=9)
    seed(cache, t)
    before = baseline_host(cache)
    assert cache.prefetch("r", t, cache.match_prefix(t))
    wait_until(cache, lambda: cache.storage.runtime.active["r"].state == "transferring", what="transfer")
    assert cache.abort_prefetch("r")
    assert not cache.abort_prefetch("r")
    assert cache.prefetch_ready("r")  # nothing left to wait for
    cache.check_invariants()
    settle(cache)
    cache.check_invariants()
    assert baseline_host(cache) == before and len(cache.tree) == 0
    st = cache.stats()["storage"]
    assert st["prefetch_aborted"] == 1 and st["prefetch_tokens_held"] == 0


def test_abort_while_querying(cache):
    cache.attach_storage(slow(0.2, "batch_exists"), stop_policy="wait_complete", **FAST)
    t = prompt(32, seed=10)
    before = baseline_host(cache)
    assert cache.prefetch("r", t, cache.match_prefix(t))
    assert cache.abort_prefetch("r")
    cache.check_invariants()
    assert baseline_host(cache) == before
    settle(cache)
    cache.check_invariants()


def test_threshold_revokes_and_releases(cache):
    cache.attach_storage("memory://", **opts(stop_policy="wait_complete", prefetch_threshold=24))
    t = prompt(64, seed=11)
    seed(cache, t[:16])  # storage holds 4 pages in a row, fewer than 24 tokens
    before = baseline_host(cache)
    assert cache.prefetch("r", t, cache.match_prefix(t))
    ready(cache, "r")
    st = cache.stats()["storage"]
    assert st["prefetch_revoked"] == 1 and st.get("prefetch_inserted_tokens", 0) == 0
    assert baseline_host(cache) == before and len(cache.tree) == 0
    cache.check_invariants()


def test_a_second_prefetch_of_a_request_is_refused_until_the_first_is_consumed(cache):
    """Whether the first was revoked meanwhile or not: the refusal does not depend on the storage thread's timing,
    and applies none of its answers (they wait for the engine's own call)."""
    answered = threading.Event()

    class Answering(MemoryBackend):
        def batch_exists(self, keys, *args, **kwargs):
            try:
                return super().batch_exists(keys, *args, **kwargs)
            finally:
                answered.set()

    cache.attach_storage(Answering(), **opts(stop_policy="wait_complete", prefetch_threshold=24))
    t = prompt(64, seed=11)
    seed(cache, t[:16])  # the hit query finds 16 tokens, fewer than 24: the prefetch will be revoked
    answered.clear()
    assert cache.prefetch("r", t, cache.match_prefix(t))
    assert answered.wait(WAIT)  # the answer is queued (or about to be): a drain now would revoke the prefetch
    for _ in range(3):
        with pytest.raises(PrefetchError, match="already has a prefetch running"):
            cache.prefetch("r", t, cache.match_prefix(t))
    ready(cache, "r")
    assert cache.stats()["storage"]["prefetch_revoked"] == 1
    assert cache.prefetch("r", t, cache.match_prefix(t))  # consumed: the id is free again
    ready(cache, "r")
    cache.check_invariants()


def test_admission_threshold_and_page_multiples(cache):
    cache.attach_storage("memory://", **opts(prefetch_threshold=32))
    t = prompt(30, seed=12)  # 7 whole pages = 28 tokens < 32
    assert not cache.prefetch("r", t, cache.match_prefix(t))
    assert cache.stats()["storage"]["prefetch_rejected_below_threshold"] == 1
    t = prompt(34, seed=12)  # 8 whole pages; the 2-token tail is not fetched
    assert cache.prefetch("r", t, cache.match_prefix(t))
    assert cache.storage.runtime.active["r"].num_tokens == 32
    with pytest.raises(PrefetchError):
        cache.prefetch("r", t, cache.match_prefix(t))
    ready(cache, "r")
    cache.check_invariants()


def test_capacity_limit(cache):
    cache.attach_storage(slow(0.2, "batch_exists"), prefetch_capacity_tokens=48, stop_policy="wait_complete",
                         **FAST)
    a, b = prompt(32, seed=13), prompt(32, seed=14)
    assert cache.prefetch("a", a, cache.match_prefix(a))
    assert not cache.prefetch("b", b, cache.match_prefix(b))
    st = cache.stats()["storage"]
    assert st["prefetch_rejected_capacity"] == 1 and st["prefetch_tokens_held"] == 32
    cache.check_invariants()
    assert cache.abort_prefetch("a")
    assert cache.prefetch("b", b, cache.match_prefix(b))
    cache.abort_prefetch("b")
    settle(cache)
    cache.check_invariants()


def test_prefetch_not_attached_and_bad_input(cache):
    t = prompt(32)
    assert not cache.prefetch("r", t, cache.match_prefix(t))
    assert cache.prefetch_ready("r") and not cache.abort_prefetch("r")
    cache.attach_storage("memory://", **FAST)
    with pytest.raises(BadIndices):
        cache.prefetch("r", t, "not a match")
    put(cache, t)
    with pytest.raises(BadIndices):
        cache.prefetch("r", prompt(64, seed=99), cache.match_prefix(t))  # a match of other tokens
    settle(cache)
    cache.detach_storage()
    assert not cache.prefetch("r", t, cache.match_prefix(t))
    assert cache.stats()["storage"]["prefetch_rejected_detached"] >= 1


def test_pages_cached_meanwhile_are_freed_not_duplicated(cache):
    cache.attach_storage(slow(0.02), stop_policy="wait_complete", batch_pages=1, **FAST)
    t = prompt(48, seed=15)
    seed(cache, t)
    assert cache.prefetch("r", t, cache.match_prefix(t))
    put(cache, t[:24])  # the engine computed part of it meanwhile
    ready(cache, "r")
    st = cache.stats()["storage"]
    assert st["prefetch_duplicate_tokens"] == 24 and st["prefetch_inserted_tokens"] == 24
    settle(cache)
    cache.check_invariants()
    k, v, n = load_and_read(cache, t)
    head, full = kv(t[:24]), kv(t)  # the engine's own pages, then the fetched ones
    assert n == 48
    assert torch.equal(k[:, :24], head[0]) and torch.equal(v[:, :24], head[1])
    assert torch.equal(k[:, 24:], full[0][:, 24:]) and torch.equal(v[:, 24:], full[1][:, 24:])


def test_close_with_work_in_flight_leaks_no_thread():
    cache = make_cache()
    cache.attach_storage(slow(0.05), stop_policy="wait_complete", batch_pages=1, **FAST)
    t = prompt(64, seed=16)
    seed(cache, t)
    assert cache.prefetch("r", t, cache.match_prefix(t))
    put(cache, prompt(16, seed=17))
    cache.poll()
    cache.close()
    assert cache.storage.state == "detached" and not storage_threads()


def test_reset_drops_storage_work(cache):
    cache.attach_storage(slow(0.05), stop_policy="wait_complete", batch_pages=1, **FAST)
    t = prompt(64, seed=18)
    seed(cache, t)
    assert cache.prefetch("r", t, cache.match_prefix(t))
    put(cache, prompt(16, seed=19))
    cache.poll()
    cache.reset()
    cache.check_invariants()
    assert cache.storage_transfers_in_flight() == 0 and cache.prefetch_ready("r")
    cache.detach_storage()


def test_invariants_catch_a_leaked_prefetch_slot(cache):
    cache.attach_storage(slow(0.2, "batch_exists"), **FAST)
    t = prompt(32, seed=20)
    assert cache.prefetch("r", t, cache.match_prefix(t))
    op = cache.storage.runtime.active["r"]
    stolen, op.host_indices = op.host_indices[:PAGE], op.host_indices[PAGE:]
    problems = cache.invariant_violations()
    assert any("leak" in p or "accounted" in p for p in problems), problems
    op.host_indices = torch.cat([stolen, op.host_indices])
    cache.check_invariants()
    cache.abort_prefetch("r")


def test_storage_waits_are_bounded(cache):
    """A wait is a safety stop: one whose condition never holds fails loudly instead of hanging the suite."""
    assert math.isfinite(WAIT)
    with pytest.raises(AssertionError, match="timed out after"):
        wait_until(cache, lambda: False, timeout=0.01, what="nothing")
