"""Pages a backend evicts on its own reach the tree: stored nodes go back to "not stored" through the
spec's ``storage_lost`` transition, which publishes ``removed:storage`` (BlockRemoved, medium CPU_TIER2)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("msgspec")

from cache_helpers import make_cache, pages, put  # noqa: E402
from hicache_fsm.config import CacheConfig  # noqa: E402
from hicache_fsm.errors import StorageKeyError  # noqa: E402
from hicache_fsm.events.contents import MEMORY_TIERS, cache_contents  # noqa: E402
from hicache_fsm.events.hashes import int64_hash  # noqa: E402
from hicache_fsm.events.hook import enable_kv_events  # noqa: E402
from hicache_fsm.events.schema import BlockRemoved, KVEventBatch  # noqa: E402
from hicache_fsm.router import PrefixIndex  # noqa: E402
from hicache_fsm.storage.faults import FaultyBackend  # noqa: E402
from hicache_fsm.storage.file import FileBackend  # noqa: E402
from hicache_fsm.storage.keys import KeyNamespace  # noqa: E402
from hicache_fsm.storage.keys_only import KeysOnlyBackend  # noqa: E402
from hicache_fsm.storage.memory import MemoryBackend  # noqa: E402
from hicache_fsm.storage.stepped import SteppedStorageTier  # noqa: E402

PAGE_BYTES = 100


def _keys(n: int, tag: str = "a") -> list[str]:
    return [f"{tag}{i:063x}" for i in range(n)]


# ------------------------------------------------------------------ backends report what they evict


def test_a_capped_memory_backend_reports_the_pages_it_evicts_oldest_first():
    backend = MemoryBackend(max_bytes=2 * PAGE_BYTES)
    heard: list[list[str]] = []
    backend.add_eviction_listener(heard.append)
    keys = _keys(4)
    for key in keys:
        assert backend.set(key, bytes(PAGE_BYTES))
    assert [k for batch in heard for k in batch] == keys[:2]
    assert backend.batch_exists(keys[2:]) == 2 and backend.batch_exists(keys[:1]) == 0
    backend.remove_eviction_listener(heard.append)  # a bound method made again is the same listener
    backend.set(_keys(1, "b")[0], bytes(PAGE_BYTES))
    assert len(heard) == 2


def test_every_backend_on_a_shared_store_hears_an_eviction_of_its_namespace():
    name = "evictions-shared"
    try:
        ns_a, ns_b = KeyNamespace(model="m"), KeyNamespace(model="other")
        evicting = MemoryBackend(ns_a, store=name, max_bytes=2 * PAGE_BYTES)
        same_ns, other_ns = MemoryBackend(ns_a, store=name), MemoryBackend(ns_b, store=name)
        heard = {b: [] for b in ("evicting", "same", "other")}
        evicting.add_eviction_listener(heard["evicting"].extend)
        same_ns.add_eviction_listener(heard["same"].extend)
        other_ns.add_eviction_listener(heard["other"].extend)
        keys = _keys(3)
        for key in keys:
            evicting.set(key, bytes(PAGE_BYTES))
        assert heard["evicting"] == heard["same"] == keys[:1]
        assert heard["other"] == []
        assert not same_ns.exists(keys[0])
    finally:
        MemoryBackend.drop_shared(name)


def test_a_capped_file_backend_reports_evicted_keys_read_from_the_files(tmp_path):
    backend = FileBackend(str(tmp_path), max_bytes=3 * PAGE_BYTES)
    heard: list[str] = []
    backend.add_eviction_listener(heard.extend)
    keys = _keys(5)
    for key in keys:
        backend.set(key, bytes(PAGE_BYTES))
    assert heard and heard == keys[: len(heard)]  # oldest first, named by the keys they were stored under
    assert backend.batch_exists(heard) == 0
    assert backend.stats()["evictions"] == len(heard)


def test_a_fault_wrapper_passes_the_inner_backends_evictions_on():
    inner = MemoryBackend(max_bytes=PAGE_BYTES)
    wrapped = FaultyBackend(inner)
    heard: list[str] = []
    wrapped.add_eviction_listener(heard.extend)
    assert wrapped.reports_evictions
    keys = _keys(2)
    for key in keys:
        wrapped.set(key, bytes(PAGE_BYTES))
    assert heard == keys[:1]


def test_a_listener_must_be_callable_and_a_failing_one_does_not_fail_the_write():
    backend = MemoryBackend(max_bytes=PAGE_BYTES)
    with pytest.raises(StorageKeyError):
        backend.add_eviction_listener("not callable")  # type: ignore[arg-type]

    def broken(keys: list[str]) -> None:
        raise RuntimeError("listener bug")

    backend.add_eviction_listener(broken)
    assert all(backend.set(k, bytes(PAGE_BYTES)) for k in _keys(3))


# ------------------------------------------------------------------ the cache: storage_lost, removed:storage


class Sink:
    """An in-process subscriber: every batch kept, and folded into a router's index."""

    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []
        self.index = PrefixIndex()

    def __call__(self, batch: KVEventBatch) -> None:
        self.batches.append(batch)
        self.index.apply(0, batch)

    def removed(self, medium: str) -> set[int]:
        return {h for b in self.batches for e in b.events
                if isinstance(e, BlockRemoved) and e.medium == medium for h in e.block_hashes}


def _cache_with_capped_storage(capacity_pages: int, kind: str = "memory"):
    cache, ex = make_cache(device_pages=16, host_pages=32, config=CacheConfig(write_policy="write_through"))
    backend_class = MemoryBackend if kind == "memory" else KeysOnlyBackend
    backend = backend_class(max_bytes=capacity_pages * cache.host_pool.page_nbytes)
    tier = SteppedStorageTier.attach_to(cache, backend, retry_interval=0)
    sink = Sink()
    hook = enable_kv_events(cache, sink)
    return cache, ex, tier, backend, sink, hook


def _step(cache, ex, tier, hook, rounds: int = 3) -> None:
    """Run copies and storage work, then poll twice: every eviction reported so far is applied."""
    for _ in range(rounds):
        cache.poll()
        ex.complete_all()
        tier.run_all()
        cache.poll()
        cache.poll()
    hook.flush()


def _stored_nodes(cache):
    return [n for n in cache.tree.nodes() if n.parent is not None and n.state.endswith("_stored")]


def test_a_stored_node_whose_page_the_backend_evicted_publishes_removed_storage_and_is_stored_again():
    cache, ex, tier, backend, sink, hook = _cache_with_capped_storage(capacity_pages=2)
    try:
        first = put(cache, pages(2, start=0)).node
        _step(cache, ex, tier, hook)
        assert first.state.endswith("_stored")
        first_hashes = [int64_hash(k) for k in tier.keys_for(first)]
        assert set(first_hashes) <= sink.index.blocks(0, "storage")
        put(cache, pages(2, start=500))  # its backup evicts the first prefix's two pages
        _step(cache, ex, tier, hook)
        assert set(first_hashes) <= sink.removed("CPU_TIER2")
        assert tier.counters["storage_lost_nodes"] >= 1
        assert tier.evictions.reported >= 2
        for node in _stored_nodes(cache):  # whatever is stored now is really there
            keys = list(tier.keys_for(node))
            assert backend.batch_exists(keys) == len(keys)
    finally:
        cache.close()


OPS = st.one_of(
    st.tuples(st.just("put"), st.integers(0, 3), st.integers(1, 3)),
    st.tuples(st.just("step"), st.integers(1, 2)),
    st.tuples(st.just("evict"), st.integers(1, 8)),
    st.tuples(st.just("reset"), st.just(1)),  # node ids start again: nothing kept by id may outlive it
)


@pytest.mark.parametrize("kind", ["memory", "keys"])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(OPS, min_size=1, max_size=20), capacity=st.integers(1, 6))
def test_after_evictions_every_stored_node_is_in_storage_and_the_index_knows_it(kind, ops, capacity):
    """At every quiescent point: a node in a stored state has every page in the backend (an eviction moved
    it back), the router's index (built from events alone) holds its pages in storage, and the index equals
    the cache's device and host contents."""
    cache, ex, tier, backend, sink, hook = _cache_with_capped_storage(capacity, kind)
    try:
        for op in ops:
            if op[0] == "put":
                put(cache, pages(op[2], start=1000 * op[1]))
            elif op[0] == "evict":
                cache.evict(op[1] * cache.page_size)
            elif op[0] == "reset":
                cache.reset()
            _step(cache, ex, tier, hook, rounds=op[1] if op[0] == "step" else 1)
            stored_in_index = sink.index.blocks(0, "storage")
            for node in _stored_nodes(cache):
                keys = list(tier.keys_for(node))
                assert backend.batch_exists(keys) == len(keys), (op, node.state)
                assert {int64_hash(k) for k in keys} <= stored_in_index, op
            actual = cache_contents(cache)
            for t in MEMORY_TIERS:
                assert sink.index.blocks(0, t) == actual[t], (op, t)
    finally:
        cache.close()


def test_only_backends_that_can_evict_say_they_report_evictions(tmp_path):
    """An uncapped private store never evicts, so the tier need not index its stored nodes' keys."""
    assert not MemoryBackend().reports_evictions
    assert MemoryBackend(max_bytes=PAGE_BYTES).reports_evictions
    assert MemoryBackend(store="evictions-shared").reports_evictions  # a capped neighbour may evict our keys
    assert not KeysOnlyBackend().reports_evictions
    assert KeysOnlyBackend(max_bytes=PAGE_BYTES).reports_evictions
    assert not FileBackend(str(tmp_path / "a")).reports_evictions
    assert FileBackend(str(tmp_path / "b"), max_bytes=PAGE_BYTES).reports_evictions


def test_pages_of_a_prefix_stored_before_a_reset_are_not_lost_by_a_node_of_the_new_tree():
    # The tracker kept the old tree's keys (and node ids, which start again after a reset): an eviction of
    # an old page moved a dead node through storage_lost, miscounting the states of the tree.
    cache, ex, tier, backend, sink, hook = _cache_with_capped_storage(capacity_pages=2)
    try:
        put(cache, pages(2, start=0))
        _step(cache, ex, tier, hook)
        cache.reset()
        put(cache, pages(2, start=500))  # its backup evicts the old prefix's pages from the capped store
        _step(cache, ex, tier, hook)
        assert tier.evictions.reported >= 2
        assert tier.counters["storage_lost_nodes"] == 0
        counted = {state: n for state, n in cache.driver.state_counts.items() if n}
        live = {}
        for node in cache.tree.nodes():
            if not node.is_root:
                live[node.state] = live.get(node.state, 0) + 1
        assert counted == live
    finally:
        cache.close()


def test_a_store_whose_cap_is_below_the_host_set_settles_instead_of_evicting_at_every_poll():
    """Storing a node the backend evicted for room, at once, evicted another's pages, which were stored again at
    the next poll, and so on: with no request at all, thousands of writes a second. A node evicted for room now
    waits a retry interval (doubling per eviction) before it is stored again."""
    cache, ex = make_cache(device_pages=16, host_pages=32, config=CacheConfig(write_policy="write_through"))
    backend = MemoryBackend(max_bytes=2 * cache.host_pool.page_nbytes)
    tier = SteppedStorageTier.attach_to(cache, backend, retry_interval=1000.0)
    hook = enable_kv_events(cache, Sink())
    try:
        first = put(cache, pages(2, start=0)).node
        _step(cache, ex, tier, hook)
        second = put(cache, pages(2, start=500)).node  # its backup evicts the first prefix's two pages
        _step(cache, ex, tier, hook)
        evictions = backend.stats()["evictions"]
        assert evictions == 2 and tier.counters["storage_lost_nodes"] == 1
        _step(cache, ex, tier, hook, rounds=20)  # idle polls: nothing is stored, nothing evicted
        assert backend.stats()["evictions"] == evictions
        assert first.state == "device_host" and second.state.endswith("_stored")
        assert tier.retries.evictions == {first.id: 1}
    finally:
        cache.close()


def test_each_eviction_for_room_doubles_the_wait_and_a_store_does_not_reset_it():
    from hicache_fsm.storage.retry import BackupRetries

    retries = BackupRetries()
    for times, wait in ((1, 2.0), (2, 4.0), (3, 8.0)):
        retries.evicted([7], 2.0, now=100.0)
        assert retries.failures[7] == (100.0 + wait, 0) and retries.evictions[7] == times
        retries.stored([7])  # stored again in between: the next eviction still waits longer
    retries.evicted([7], 2.0, now=0.0)
    assert retries.failures[7][0] == 16.0
