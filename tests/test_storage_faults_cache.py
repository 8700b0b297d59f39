"""Storage failures seen from a live cache.

Every case checks the same outcome: no device or host data is lost (the KV the
cache holds is exactly what was written), no slot leaks (``check_invariants``),
a prefetch ends with the pages that arrived and the request proceeds, the
failure shows in ``stats()`` and in the logs, and backups resume once storage
answers again.
"""

from __future__ import annotations

import errno
import logging

import pytest
import torch
from storage_util import (
    PAGE,
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

from hicache_fsm.storage import KeyNamespace, open_backend, page_keys
from hicache_fsm.storage.faults import Fault, FaultyBackend
from hicache_fsm.storage.memory import MemoryBackend

OPTS = {"prefetch_threshold": 8, "stop_policy": "wait_complete", "batch_pages": 1, "retry_interval": 0.01,
        "probe_interval": 0.02, "join_timeout": 5.0}


@pytest.fixture
def cache(caplog):
    caplog.set_level(logging.INFO, logger="hicache_fsm")
    c = make_cache()
    yield c
    c.close()
    assert not storage_threads()


def is_stored(cache, tokens) -> bool:
    path, matched = path_nodes(cache, tokens)
    return matched == len(tokens) and all(n.state.endswith("stored") for n in path)


def seed(cache, tokens) -> None:
    put(cache, tokens)
    wait_until(cache, lambda: is_stored(cache, tokens), what="backup")
    evict_all(cache, tokens)
    assert len(cache.tree) == 0


def prefetch_and_proceed(cache, tokens) -> int:
    """Prefetch ``tokens``; once ready, load what arrived and compute the rest (the request proceeds)."""
    assert cache.prefetch("r", tokens, cache.match_prefix(tokens))
    ready(cache, "r")
    cache.check_invariants()
    k, v, n = load_and_read(cache, tokens)
    rk, rv = kv(tokens)
    assert torch.equal(k, rk[:, :n]) and torch.equal(v, rv[:, :n]), "prefetched KV differs from what was stored"
    put(cache, tokens)  # the engine computes the tokens that did not arrive
    settle(cache)
    cache.check_invariants()
    assert_kv_intact(cache, tokens, len(tokens))
    return n


def logged(caplog, text: str) -> bool:
    return any(text in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def test_backend_raising_on_get(cache, caplog):
    backend = FaultyBackend(MemoryBackend(), [Fault("error", method="batch_get_into", calls=2)])
    cache.attach_storage(backend, **OPTS)
    t = prompt(48, seed=1)
    seed(cache, t)
    assert prefetch_and_proceed(cache, t) == 2 * PAGE  # the two pages before the failed batch
    st = cache.stats()["storage"]
    assert st["prefetch_short_batches"] == 1 and st["prefetch_partial"] == 1 and st["storage_errors"] >= 1
    assert logged(caplog, "short")
    wait_until(cache, lambda: cache.storage.healthy, what="recovery")


def test_backend_raising_on_hit_query(cache, caplog):
    backend = FaultyBackend(MemoryBackend(), [Fault("unavailable", method="batch_exists", calls=1)])
    cache.attach_storage(backend, **OPTS)  # call 0 is the attach probe
    t = prompt(32, seed=2)
    seed(cache, t)
    assert prefetch_and_proceed(cache, t) == 0
    st = cache.stats()["storage"]
    assert st["prefetch_query_failures"] == 1 and st["storage_outages"] >= 1
    assert logged(caplog, "hit query failed")


def test_backend_raising_on_backup_then_resumes(cache, caplog):
    backend = FaultyBackend(MemoryBackend(), [Fault("error", method="batch_set_from", times=2)])
    cache.attach_storage(backend, **OPTS)
    t = prompt(32, seed=3)
    put(cache, t)
    wait_until(cache, lambda: cache.stats()["storage"].get("backup_failures", 0) >= 1, what="a failed backup")
    assert_kv_intact(cache, t, 32)  # the device and host copies are untouched
    cache.check_invariants()
    wait_until(cache, lambda: is_stored(cache, t), what="the retried backup")
    st = cache.stats()["storage"]
    assert st["backup_retries"] >= 1 and st["backups_stored"] >= 1
    assert logged(caplog, "backup")
    evict_all(cache, t)
    assert prefetch_and_proceed(cache, t) == 32


def test_backend_timing_out(cache, caplog):
    backend = FaultyBackend(MemoryBackend(), [
        Fault("timeout", method="batch_get_into", calls=1, delay=0.05),
        Fault("timeout", method="batch_set_from", calls=[0], delay=0.05),
    ])
    cache.attach_storage(backend, **OPTS)
    t = prompt(32, seed=4)
    put(cache, t)
    wait_until(cache, lambda: is_stored(cache, t), what="backup after a timed-out write")
    assert cache.stats()["storage"]["backup_failures"] == 1
    evict_all(cache, t)
    assert prefetch_and_proceed(cache, t) == PAGE
    assert logged(caplog, "StorageTimeout")


def test_partial_batch(cache):
    backend = FaultyBackend(MemoryBackend(), [Fault("partial", method="batch_get_into", calls=0, keep=2)])
    cache.attach_storage(backend, **{**OPTS, "batch_pages": 4})
    t = prompt(48, seed=5)
    seed(cache, t)
    assert prefetch_and_proceed(cache, t) == 2 * PAGE
    assert cache.stats()["storage"]["prefetch_short_batches"] == 1


def test_corrupt_page(cache, caplog):
    backend = MemoryBackend()
    cache.attach_storage(backend, **{**OPTS, "batch_pages": 4})
    t = prompt(48, seed=6)
    seed(cache, t)
    assert backend.debug_corrupt(page_keys(t, PAGE)[3])
    assert prefetch_and_proceed(cache, t) == 3 * PAGE  # never the corrupt page or anything after it
    assert cache.stats()["storage"]["backend_stats"]["corrupt"] == 1
    assert logged(caplog, "corrupt")


def _redis(server, schedule):
    inner = open_backend(server.url, namespace=KeyNamespace("default"), socket_timeout=1.0, connect_timeout=0.3)
    return FaultyBackend(inner, schedule)


def test_redis_killed_mid_prefetch_then_restarted(cache, redis_server, caplog):
    def schedule(method, index, keys):
        if method == "batch_get_into" and index == 2:
            redis_server.kill()

    cache.attach_storage(_redis(redis_server, schedule), **OPTS)
    t = prompt(48, seed=7)
    seed(cache, t)
    assert prefetch_and_proceed(cache, t) == 2 * PAGE
    assert not cache.storage.healthy and cache.stats()["storage"]["storage_outages"] >= 1
    assert logged(caplog, "unavailable")
    other = prompt(32, seed=8)
    put(cache, other)  # storage is down: no backup starts, the host copy is kept
    wait_until(cache, lambda: path_nodes(cache, other)[0][-1].state == "device_host", what="host backup")
    redis_server.restart()
    wait_until(cache, lambda: is_stored(cache, other) and is_stored(cache, t), what="backups after restart")
    assert cache.stats()["storage"]["storage_recoveries"] >= 1
    assert_kv_intact(cache, other, 32)
    cache.check_invariants()


def test_redis_killed_mid_backup_then_restarted(cache, redis_server, caplog):
    def schedule(method, index, keys):
        if method == "batch_set_from" and index == 2:
            redis_server.kill()

    cache.attach_storage(_redis(redis_server, schedule), **{**OPTS, "batch_pages": 2})
    t = prompt(48, seed=9)
    put(cache, t)
    wait_until(cache, lambda: cache.stats()["storage"].get("backup_failures", 0) >= 1, what="failed backup")
    node = path_nodes(cache, t)[0][-1]
    assert node.state == "device_host"  # store_failed: back to device + host, nothing lost
    assert_kv_intact(cache, t, 48)
    cache.check_invariants()
    assert logged(caplog, "failed")
    redis_server.restart()
    wait_until(cache, lambda: is_stored(cache, t), what="backup after restart")
    evict_all(cache, t)
    assert prefetch_and_proceed(cache, t) == 48  # every page reached the restarted server


def test_disk_full(cache, tmp_path, monkeypatch, caplog):
    import hicache_fsm.storage.file as file_backend

    def full(fd, parts):
        raise OSError(errno.ENOSPC, "No space left on device")

    cache.attach_storage(f"file://{tmp_path}/l3", **OPTS)
    before = prompt(32, seed=11)
    seed(cache, before)
    monkeypatch.setattr(file_backend, "_writev_all", full)
    t = prompt(32, seed=10)
    put(cache, t)
    wait_until(cache, lambda: cache.stats()["storage"].get("backup_failures", 0) >= 2, what="failed, retried backup")
    assert path_nodes(cache, t)[0][-1].state in ("device_host", "device_host_storing")
    assert_kv_intact(cache, t, 32)
    assert logged(caplog, "No space left")
    assert not list((tmp_path / "l3").rglob("*.tmp")), "a failed write leaves no temporary file"
    assert cache.storage.healthy  # a full disk still serves reads: prefetches go on
    assert prefetch_and_proceed(cache, before) == 32
    monkeypatch.undo()
    wait_until(cache, lambda: is_stored(cache, t), what="backup once space is back")
    assert_kv_intact(cache, t, 32)
    cache.check_invariants()
    evict_all(cache, t)
    assert prefetch_and_proceed(cache, t) == 32
