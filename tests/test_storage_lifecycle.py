"""Who completes storage jobs, and how storage work ends: drain, fail-fast, bounded detach, stats, temp files."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from storage_util import PAGE, make_cache, path_nodes, prompt, put, settle, storage_threads, wait_until
from test_storage_tier import FAST, GatedBackend, seed, slow

from hicache_fsm.errors import JobOwnerError, UnknownJob
from hicache_fsm.jobs import Completion, JobKind
from hicache_fsm.storage import KeyNamespace, open_backend, page_keys
from hicache_fsm.storage.base import STAT_FIELDS
from hicache_fsm.storage.tier import COUNTERS

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "storage.md")


@pytest.fixture
def cache():
    c = make_cache()
    yield c
    c.close()
    assert not storage_threads()


def storage_jobs(cache, kind: JobKind):
    return [j for j in cache.pending_jobs() if j.kind is kind]


def picture(cache):
    return ([(n.id, n.state, sorted(n.pending_jobs)) for n in cache.tree.nodes()], sorted(cache.pending_job_ids()),
            cache.host_allocator.used_pages)


# ====================================================================== one owner per completion


def test_engine_cannot_complete_or_fail_a_backup(cache):
    gate = GatedBackend(writes=True)  # the backup stays running until the test lets it through
    cache.attach_storage(gate, **FAST)
    t = prompt(16)
    put(cache, t)
    wait_until(cache, lambda: storage_jobs(cache, JobKind.H2S), what="a backup")
    [job] = storage_jobs(cache, JobKind.H2S)
    before = picture(cache)
    for ok in (True, False):
        with pytest.raises(JobOwnerError, match="storage tier"):
            cache.complete(Completion(job.id, ok))
        assert picture(cache) == before  # nothing changed
    assert issubclass(JobOwnerError, UnknownJob)
    gate.let_through(16 // PAGE)
    settle(cache)  # the tier completes it itself
    assert path_nodes(cache, t)[0][-1].state == "device_host_stored"
    with pytest.raises(UnknownJob):
        cache.complete(Completion(job.id, True))
    cache.check_invariants()


def test_engine_cannot_complete_a_prefetch_transfer(cache):
    gate = GatedBackend()  # the transfer stays running until the test lets it through
    cache.attach_storage(gate, stop_policy="wait_complete", **FAST)
    t = prompt(32, seed=2)
    seed(cache, t)
    assert cache.prefetch("r", t, cache.match_prefix(t))
    wait_until(cache, lambda: storage_jobs(cache, JobKind.S2H), what="a prefetch transfer")
    [job] = storage_jobs(cache, JobKind.S2H)
    before = picture(cache)
    with pytest.raises(JobOwnerError):
        cache.complete(Completion(job.id, True))
    assert picture(cache) == before
    gate.let_through(32 // PAGE)
    wait_until(cache, lambda: cache.prefetch_ready("r"), what="prefetch")
    assert cache.stats()["storage"]["prefetch_inserted_tokens"] == 32
    cache.check_invariants()


# ====================================================================== drain / close


def test_close_drain_finishes_queued_backups():
    cache = make_cache()
    cache.attach_storage(slow(0.05, "batch_set_from"), **FAST)
    for i in range(4):
        put(cache, prompt(16, seed=40 + i))
    cache.poll()
    assert len(storage_jobs(cache, JobKind.H2S)) == 4
    cache.close(drain=10.0)
    st = cache.stats()["storage"]
    assert st["backups_stored"] == 4 and st["backup_failures"] == 0
    assert not storage_threads()


def test_close_drain_is_bounded():
    cache = make_cache()
    cache.attach_storage(slow(0.5, "batch_set_from"), **FAST)
    for i in range(4):
        put(cache, prompt(16, seed=50 + i))
    cache.poll()
    cache.close(drain=0.2)
    st = cache.stats()["storage"]
    # the drain bound, not 4 x 0.5 s: at most the backup running when it ended (and one more) got stored
    assert st["backups_stored"] + st["backup_failures"] == 4 and st["backup_failures"] >= 2
    assert not storage_threads()


def test_drain_while_attached_keeps_the_link(cache):
    cache.attach_storage(slow(0.02, "batch_set_from"), **FAST)
    put(cache, prompt(16, seed=60))
    cache.poll()
    assert cache.storage.drain(10.0)
    assert cache.storage.state == "attached" and cache.storage_transfers_in_flight() == 0


# ====================================================================== a frozen Redis


@pytest.mark.redis
def test_frozen_redis_fails_queued_jobs_fast_then_retries_and_detaches_in_bounded_time(cache, redis_server):
    timeout = 1.0
    cache.attach_storage(redis_server.url, socket_timeout=timeout, connect_timeout=0.3,
                         **{**FAST, "retry_interval": 0.05, "probe_interval": 0.1})
    put(cache, prompt(16, seed=70))
    settle(cache)
    redis_server.pause()  # SIGSTOP: connections stay open, nothing answers
    prompts = [prompt(16, seed=71 + i) for i in range(5)]
    for t in prompts:
        put(cache, t)
    cache.poll()
    wait_until(cache, lambda: cache.stats()["storage"]["backup_failures"] >= 5, what="five failed backups")
    st = cache.stats()["storage"]
    assert st["jobs_failed_fast"] >= 3 and not cache.storage.healthy  # not timed out one by one
    for t in prompts:  # nothing lost: every node keeps its host copy
        assert path_nodes(cache, t)[0][-1].state == "device_host"

    cache.detach_storage()  # storage frozen: bounded by the socket timeout, not refused
    assert cache.storage.state == "detached" and not storage_threads()

    redis_server.resume()
    cache.attach_storage(redis_server.url, socket_timeout=timeout, **{**FAST, "retry_interval": 0.05})
    wait_until(cache, lambda: all(path_nodes(cache, t)[0][-1].state == "device_host_stored" for t in prompts),
               what="backups retried after recovery")
    cache.check_invariants()


@pytest.mark.redis
def test_frozen_redis_while_attached_recovers_and_retries(cache, redis_server):
    cache.attach_storage(redis_server.url, socket_timeout=0.5, **{**FAST, "retry_interval": 0.05})
    redis_server.pause()
    t = prompt(16, seed=80)
    put(cache, t)
    wait_until(cache, lambda: cache.stats()["storage"]["backup_failures"] >= 1, what="a failed backup")
    redis_server.resume()
    wait_until(cache, lambda: path_nodes(cache, t)[0][-1].state == "device_host_stored", what="retried backup")
    assert cache.stats()["storage"]["storage_recoveries"] >= 1


# ====================================================================== stats


def test_stats_carry_every_documented_counter(cache):
    cache.attach_storage("memory://", **FAST)
    for snapshot in (cache.stats()["storage"],):
        assert set(COUNTERS) <= set(snapshot) and all(snapshot[c] == 0 for c in COUNTERS if c != "attaches")
        assert set(STAT_FIELDS) <= set(snapshot["backend_stats"])
    cache.detach_storage()
    st = cache.stats()["storage"]
    assert set(COUNTERS) <= set(st) and set(STAT_FIELDS) <= set(st["backend_stats"])
    with open(DOCS) as f:
        docs = f.read()
    missing = [c for c in (*COUNTERS, *STAT_FIELDS) if f"`{c}`" not in docs]
    assert not missing, f"docs/storage.md does not document {missing}"


# ====================================================================== orphan temp files


def test_orphan_temp_files_are_removed_when_a_file_store_opens(tmp_path):
    url = f"file://{tmp_path}"
    b = open_backend(url, namespace=KeyNamespace("m"))
    key = page_keys(prompt(PAGE, seed=1), PAGE)[0]
    assert b.set(key, b"page")
    shard = os.path.dirname(b.path_for(key))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    name = os.path.basename(b.path_for(key))
    crashed = os.path.join(shard, f".{name}.{dead_pid}.1.0.tmp")  # its writer exited mid-write
    live = os.path.join(shard, f".{name}.{os.getpid()}.1.7.tmp")  # a writer of this process, still writing
    stale = os.path.join(shard, f".{name}.{os.getpid()}.1.8.tmp")
    for path in (crashed, live, stale):
        with open(path, "wb") as f:
            f.write(b"partial")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    again = open_backend(url, namespace=KeyNamespace("m"))
    assert not os.path.exists(crashed) and not os.path.exists(stale) and os.path.exists(live)
    assert again.stats()["orphans_removed"] == 2
    assert again.get(key) == b"page"
    b.close()
    again.close()


def test_one_backend_object_serves_one_cache_and_a_refusal_leaves_it_open():
    """A tier closes its backend when it detaches: shared, one cache's detach broke the other's storage."""
    from hicache_fsm.errors import StorageLinkError
    from hicache_fsm.storage.memory import MemoryBackend

    backend = MemoryBackend()
    first, second = make_cache(), make_cache()
    first.attach_storage(backend)
    with pytest.raises(StorageLinkError, match="attached to another cache's storage"):
        second.attach_storage(backend)
    assert not backend.closed and second.storage_transfers_in_flight() == 0  # the refusal closed nothing
    second.attach_storage(MemoryBackend())  # a backend of its own is fine
    put(first, prompt(2 * PAGE))
    settle(first)
    assert first.stats()["storage"]["backups_stored"] == 1
    first.detach_storage()
    assert backend.closed
    first.close()
    second.close()


def test_a_misspelt_option_names_the_tier_s_options_and_the_backend_s():
    """It named the backend's options only, though a tier option (prefetch_threshold) was the one misspelt."""
    from hicache_fsm.errors import StorageLinkError

    cache = make_cache()
    expected = ("unknown option.s. prefetch_thresold; attach_storage takes the tier's prefetch_threshold, .* "
                "and the memory:// backend's namespace, max_bytes")
    with pytest.raises(StorageLinkError, match=expected):
        cache.attach_storage("memory://", prefetch_thresold=1)
    assert cache.storage_transfers_in_flight() == 0
    cache.attach_storage("memory://", prefetch_threshold=1)  # the refused attach left nothing behind
    cache.close()
