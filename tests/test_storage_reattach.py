"""Storage detached and attached again: nodes marked stored hold pages of the store they were stored in.

Another store (another directory, a private store a detach cleared) never had those pages: the marks go and the
pages are stored again; the same store keeps them. And a detach or reset ends a running multi-batch backup at its
next batch instead of waiting for all of it.
"""

from __future__ import annotations

import torch
from storage_util import (evict_all, kv, load_and_read, make_cache, path_nodes, prompt, put, ready, storage_threads,
                          wait_until)

from hicache_fsm.storage.faults import Fault, FaultyBackend
from hicache_fsm.storage.memory import MemoryBackend

OPTIONS = {"prefetch_threshold": 4, "stop_policy": "wait_complete"}


def stored(cache, tokens) -> bool:
    return all(n.state.endswith("_stored") for n in path_nodes(cache, tokens)[0])


def fetched_back(cache, tokens) -> int:
    """Drop ``tokens`` from memory, prefetch them from storage, load them; the tokens whose KV came back exact."""
    evict_all(cache, tokens)
    m = cache.match_prefix(tokens)
    assert m.device_hit_length == 0 and m.host_hit_length == 0
    assert cache.prefetch("r", tokens, m)
    ready(cache, "r")
    k, v, n = load_and_read(cache, tokens)
    rk, rv = kv(tokens)
    assert torch.equal(k, rk[:, :n]) and torch.equal(v, rv[:, :n])
    return n


def test_marks_an_earlier_store_left_are_dropped_and_the_pages_stored_again(tmp_path):
    cache = make_cache()
    try:
        cache.attach_storage(f"file://{tmp_path / 'a'}", **OPTIONS)
        tokens = prompt(32, seed=1)
        put(cache, tokens)
        wait_until(cache, lambda: stored(cache, tokens), what="the backup to the first store")
        cache.detach_storage()
        cache.attach_storage(f"file://{tmp_path / 'b'}", **OPTIONS)  # empty: it never had those pages
        assert not stored(cache, tokens) and cache.stats()["storage"]["storage_lost_nodes"] >= 1
        wait_until(cache, lambda: stored(cache, tokens), what="the backup to the second store")
        assert fetched_back(cache, tokens) == 32  # was 0: the KV was gone from every tier
    finally:
        cache.close()


def test_a_private_memory_store_cleared_by_the_detach_drops_the_marks():
    cache = make_cache()
    try:
        cache.attach_storage("memory://", **OPTIONS)
        tokens = prompt(32, seed=2)
        put(cache, tokens)
        wait_until(cache, lambda: stored(cache, tokens), what="the backup")
        cache.detach_storage()
        cache.attach_storage("memory://", **OPTIONS)
        wait_until(cache, lambda: stored(cache, tokens), what="the backup again")
        assert fetched_back(cache, tokens) == 32
    finally:
        cache.close()


def test_the_same_store_keeps_the_marks(tmp_path):
    cache = make_cache()
    try:
        url = f"file://{tmp_path / 'a'}"
        cache.attach_storage(url, **OPTIONS)
        tokens = prompt(32, seed=3)
        put(cache, tokens)
        wait_until(cache, lambda: stored(cache, tokens), what="the backup")
        cache.detach_storage()
        cache.attach_storage(url, **OPTIONS)
        assert stored(cache, tokens) and cache.stats()["storage"]["storage_lost_nodes"] == 0
        assert fetched_back(cache, tokens) == 32
    finally:
        cache.close()


def test_a_detach_ends_a_running_backup_at_its_next_batch():
    """A page a call, each call half a second: the detach was refused (transfers in flight) until every page was
    written, 8 s here, far past its join_timeout; now the backup ends at its next batch, well within it."""
    backend = FaultyBackend(MemoryBackend(), [Fault("slow", method="batch_set_from", delay=0.5)])
    cache = make_cache()
    try:
        cache.attach_storage(backend, batch_pages=1, join_timeout=3.0)
        tokens = prompt(64, seed=4)  # 16 pages
        put(cache, tokens)
        wait_until(cache, lambda: backend.inner.stats()["sets"] >= 1, what="the backup's first page")  # running
        cache.detach_storage()  # raised StorageLinkError: 1 storage transfers in flight
        assert not cache.storage_attached and not stored(cache, tokens)
        assert not storage_threads()
    finally:
        cache.close()


def test_a_page_path_that_loops_or_crosses_a_file_is_a_miss_for_that_page_only(tmp_path):
    """A symlink to itself in a page's place raised StorageError (ELOOP): the whole file tier went unhealthy."""
    import os

    from hicache_fsm.storage import KeyNamespace
    from hicache_fsm.storage.file import FileBackend

    backend = FileBackend(tmp_path, KeyNamespace("m"))
    try:
        keys = [f"{i:064x}" for i in range(3)]
        assert backend.batch_set(keys, [bytes([i]) * 64 for i in range(3)]) == [True] * 3
        looped = backend.path_for(keys[1])
        os.unlink(looped)
        os.symlink(looped, looped)
        assert backend.batch_exists(keys) == 1
        got = backend.batch_get(keys)
        assert got[0] == bytes(64) and got[1] is None and got[2] == bytes([2]) * 64
        assert backend.batch_exists(keys[2:]) == 1  # the store still answers
    finally:
        backend.close()


def test_a_namespace_with_a_model_or_tenant_beside_it_is_refused():
    """The namespace is the whole key prefix: the model given beside it was ignored without a word."""
    import pytest

    from hicache_fsm.errors import ConfigError
    from hicache_fsm.storage import KeyNamespace

    cache = make_cache()
    try:
        with pytest.raises(ConfigError, match="give namespace or model, tenant, not both"):
            cache.attach_storage("memory://", namespace=KeyNamespace("a"), model="b", tenant="t")
        assert not cache.storage_attached
    finally:
        cache.close()
