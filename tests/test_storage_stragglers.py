"""Storage under a backend that answers late or wrongly, and the pools a closed cache hands on.

A backend call may outlive ``join_timeout``: until it returns, the host
slots it reads or writes stay the transfer's (a reset is refused, a closed
cache keeps its pools). A backend that answers for other pages than it was
asked about is not trusted with any of them. A node of another cache is
refused by the calls that take nodes.
"""

from __future__ import annotations

import threading

import pytest
from storage_util import WAIT, assert_kv_intact, make_cache, prompt, put, ready, settle, storage_threads, wait_until
from test_storage_tier import FAST

from hicache_fsm.cache import HiCache
from hicache_fsm.config import CacheConfig
from hicache_fsm.errors import BadIndices, ConfigError, StorageLinkError, UnknownNode
from hicache_fsm.storage.memory import MemoryBackend

STRAGGLING = dict(FAST, join_timeout=0.05)  # a blocked call outlives it: the gate, not the clock, decides


class GatedBackend(MemoryBackend):
    """``memory://`` whose page reads (or writes) wait for ``gate``: a backend call that outlives ``join_timeout``."""

    def __init__(self, *, reads: bool = False, writes: bool = False, **options) -> None:
        super().__init__(**options)
        self.reads, self.writes = reads, writes
        self.gate, self.entered = threading.Event(), threading.Event()

    def _wait(self) -> None:
        self.entered.set()
        assert self.gate.wait(WAIT), "the test never opened the gate"

    def batch_get_into(self, keys, host_pool, page_ids):
        if self.reads:
            self._wait()
        return super().batch_get_into(keys, host_pool, page_ids)

    def batch_set_from(self, keys, host_pool, page_ids):
        if self.writes:
            self._wait()
        return super().batch_set_from(keys, host_pool, page_ids)


def stored(tokens, store: str) -> None:
    """``tokens``' KV stored in the shared ``memory://`` store ``store`` by a cache closed since."""
    writer = make_cache()
    writer.attach_storage(MemoryBackend(store=store), **FAST)
    put(writer, tokens)
    settle(writer)
    writer.close()


def blocked_prefetch(store: str):
    """A cache whose prefetch of a stored prompt is inside a gated page read; (cache, backend, tokens)."""
    tokens = prompt(16, seed=11)
    stored(tokens, store)
    cache = make_cache()
    backend = GatedBackend(reads=True, store=store)
    cache.attach_storage(backend, **STRAGGLING)
    assert cache.prefetch("r", tokens, cache.match_prefix(tokens))
    wait_until(cache, backend.entered.is_set, what="the prefetch to reach the backend")
    return cache, backend, tokens


def test_reset_is_refused_while_a_backup_write_outlives_join_timeout():
    cache = make_cache()
    backend = GatedBackend(writes=True)
    cache.attach_storage(backend, **STRAGGLING)
    tokens = prompt(16, seed=1)
    put(cache, tokens)
    wait_until(cache, backend.entered.is_set, what="the backup to reach the backend")
    with pytest.raises(StorageLinkError, match="still runs"):
        cache.reset()  # its host slots would be handed out while the write still reads them
    assert_kv_intact(cache, tokens, min_tokens=16)
    backend.gate.set()
    settle(cache)
    cache.reset()
    assert cache.match_prefix(tokens).device_hit_length == 0
    assert cache.invariant_violations() == []
    cache.close()
    assert not storage_threads()


def test_reset_is_refused_while_a_prefetch_read_outlives_join_timeout():
    cache, backend, tokens = blocked_prefetch("straggler-reset")
    with pytest.raises(StorageLinkError, match="still runs"):
        cache.reset()  # the read would land in host slots the cache hands out next
    assert cache.invariant_violations() == []
    backend.gate.set()
    settle(cache)
    cache.reset()
    assert cache.host_allocator.available_tokens == cache.host_pool.size_tokens
    cache.close()
    assert not storage_threads()


def test_pools_wait_for_a_storage_thread_that_outlives_close():
    cache, backend, _ = blocked_prefetch("straggler-close")
    device_pool, host_pool = cache.device_pool, cache.host_pool
    cache.close()
    with pytest.raises(ConfigError, match="storage thread"):
        HiCache(device_pool, host_pool, CacheConfig(write_policy="write_through"))
    backend.gate.set()
    for thread in storage_threads():
        thread.join(WAIT)
    fresh = HiCache(device_pool, host_pool, CacheConfig(write_policy="write_through"))
    assert fresh.invariant_violations() == []
    fresh.close()


def test_a_new_cache_over_a_closed_caches_pools_starts_with_every_slot_free():
    first = make_cache()
    put(first, prompt(16, seed=2))
    first.close()
    second = HiCache(first.device_pool, first.host_pool, CacheConfig(write_policy="write_through"))
    assert second.device_allocator.available_tokens == first.device_pool.size_tokens
    assert second.host_allocator.available_tokens == first.host_pool.size_tokens
    assert second.invariant_violations() == []
    tokens = prompt(16, seed=3)
    put(second, tokens)
    assert_kv_intact(second, tokens, min_tokens=16)
    second.close()


def test_storage_lost_and_verify_stored_refuse_another_caches_nodes():
    mine, theirs = make_cache(), make_cache()
    for cache in (mine, theirs):
        cache.attach_storage(MemoryBackend(), **FAST)
    node = put(theirs, prompt(16, seed=4))
    settle(theirs)
    state = node.state
    for call in (lambda: mine.storage.storage_lost([node]), lambda: mine.storage.verify_stored([node]),
                 lambda: mine.storage.storage_lost(node)):
        with pytest.raises(UnknownNode):
            call()
    assert node.state == state and mine.storage.counters["storage_lost_nodes"] == 0
    assert mine.invariant_violations() == [] and theirs.invariant_violations() == []
    mine.close()
    theirs.close()


class ExtraAnswer(MemoryBackend):
    """Answers one page more than it was asked about."""

    def batch_get_into(self, keys, host_pool, page_ids):
        return super().batch_get_into(keys, host_pool, page_ids) + [True]


class ShortAnswer(MemoryBackend):
    """Stores the first page of a batch and answers for it alone."""

    def batch_set_from(self, keys, host_pool, page_ids):
        return super().batch_set_from(keys[:1], host_pool, page_ids[:1])


def test_a_read_answered_for_more_pages_than_asked_lands_nothing():
    tokens = prompt(16, seed=5)
    stored(tokens, "extra-answer")
    cache = make_cache()
    cache.attach_storage(ExtraAnswer(store="extra-answer"), **FAST, stop_policy="wait_complete")
    assert cache.prefetch("r", tokens, cache.match_prefix(tokens))
    ready(cache, "r")
    stats = cache.stats()["storage"]
    assert stats["prefetch_fetched_tokens"] == 0 and stats["storage_errors"] >= 1
    assert_kv_intact(cache, tokens)
    assert cache.invariant_violations() == []
    cache.close()


def test_a_backup_answered_for_fewer_pages_than_asked_is_not_stored():
    cache = make_cache()
    cache.attach_storage(ShortAnswer(), **FAST)
    node = put(cache, prompt(16, seed=6))
    wait_until(cache, lambda: cache.stats()["storage"]["backup_failures"] >= 1, what="the backup to fail")
    stats = cache.stats()["storage"]
    assert stats["backups_stored"] == 0 and not node.state.endswith("_stored")
    cache.close()


def test_prefetch_calls_and_drain_refuse_bad_arguments_with_typed_errors():
    cache = make_cache()
    cache.attach_storage(MemoryBackend(), **FAST)
    for call in (lambda: cache.prefetch_ready(["r"]), lambda: cache.abort_prefetch(["r"])):
        with pytest.raises(BadIndices, match="hashable"):
            call()
    for timeout in ("5", None, float("nan"), -1.0, True):
        with pytest.raises(ConfigError):
            cache.storage.drain(timeout)
    cache.close()
