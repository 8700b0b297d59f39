"""Promises of the embedding surface that an outside probe found broken: key namespaces of an open backend,
short page files, ``close(drain)`` right after an insert, observers from another thread, and ``poll`` after
``reset``."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from storage_util import PAGE, kv, make_cache, prompt, put, settle, storage_threads, wait_until
from test_storage_tier import cache  # noqa: F401 - the fixture: a cache whose storage threads end with it

from hicache_fsm.errors import StorageLinkError, StorageTimeout, WrongThread
from hicache_fsm.executors import ManualExecutor
from hicache_fsm.storage import KeyNamespace, open_backend
from hicache_fsm.storage.memory import MemoryBackend

FAST = {"prefetch_threshold": 4, "retry_interval": 0.01, "probe_interval": 0.02, "join_timeout": 5.0,
        "stop_policy": "wait_complete"}


def _stored(cache, tokens):
    node = put(cache, tokens)
    wait_until(cache, lambda: node.state.endswith("stored"), what="the backup to reach storage")
    return node


# ====================================================================== an open backend's keys


@pytest.mark.parametrize("options", [{"model": "m"}, {"tp_rank": 1, "tp_size": 2}, {"tenant": "t"},
                                     {"is_mla": True}, {"namespace": KeyNamespace("m")}])
def test_open_backend_refuses_key_options_it_would_not_follow(cache, options):
    backend = MemoryBackend(store=f"keys-{sorted(options)}")  # opened with the default namespace
    with pytest.raises(StorageLinkError, match="an open backend keeps its keys"):
        cache.attach_storage(backend, **options, **FAST)
    assert cache.storage is None or cache.storage.state == "detached"
    assert not backend.closed  # refused before the tier took it: still the caller's


def test_open_backend_with_matching_key_options_attaches(cache):
    backend = MemoryBackend(KeyNamespace("m", tp_rank=1, tp_size=2), store="keys-matching")
    cache.attach_storage(backend, model="m", tp_rank=1, tp_size=2, **FAST)
    assert cache.storage.backend is backend


def test_open_backend_without_key_options_keys_as_opened(cache):
    """No key options: the backend's own namespace holds, and the tier's MLA rule reads it."""
    mla_rank_1 = MemoryBackend(KeyNamespace("m", tp_rank=1, tp_size=2, is_mla=True), store="keys-mla")
    cache.attach_storage(mla_rank_1, **FAST)
    put(cache, prompt(16))
    settle(cache)
    st = cache.stats()["storage"]
    assert st["backups_skipped_mla"] == 1 and st["backend_stats"]["sets"] == 0


def test_ranks_on_one_store_read_their_own_kv():
    """Two ranks share a store through open backends keyed per rank: each reads back its own shard's bytes,
    never the other's (the bug: both wrote under rank 0 of 1 and rank 1 read rank 0's KV)."""
    tokens = prompt(16)
    written = {}
    for rank in (0, 1):
        c = make_cache()
        c.attach_storage(MemoryBackend(KeyNamespace("m", tp_rank=rank, tp_size=2), store="ranks-shared"), **FAST)
        k, v = kv(tokens)
        k, v = k + rank, v - rank  # each rank holds other heads: other bytes for the same tokens
        idx = c.alloc_device(len(tokens))
        c.device_pool.write(idx, None, k, v)
        node = c.insert(tokens, idx).node
        wait_until(c, lambda: node.state.endswith("stored"), what="rank's backup")
        written[rank] = (k, v)
        c.close()
    reader = make_cache()
    try:
        reader.attach_storage(MemoryBackend(KeyNamespace("m", tp_rank=1, tp_size=2), store="ranks-shared"), **FAST)
        m = reader.match_prefix(tokens)
        reader.prefetch("r", tokens, m)
        wait_until(reader, lambda: reader.prefetch_ready("r"), what="the prefetch")
        m = reader.match_prefix(tokens)
        assert m.host_hit_length == len(tokens)
        got_k, got_v = reader.host_pool.read(m.last_host_node.host_indices)
        assert got_k.equal(written[1][0]) and got_v.equal(written[1][1])
    finally:
        reader.close()


# ====================================================================== file:// short page files


def _one_stored_page(tmp_path, url: str, tokens) -> tuple[str, str]:
    """Store ``tokens`` (one page) through a cache at ``url``, closed after: the page's key and its file."""
    writer = make_cache()
    writer.attach_storage(url, **FAST)
    (key,) = writer.storage.keys_for(_stored(writer, tokens))
    writer.close()
    (path,) = [os.path.join(d, f) for d, _, files in os.walk(tmp_path) for f in files if f.endswith(".kv")]
    return key, path


@pytest.mark.parametrize("size", [0, 50])
def test_file_page_shorter_than_a_header_is_corrupt_and_stored_again(tmp_path, size):
    """A cut-short page file is a miss counted corrupt and removed, and the next backup writes it whole."""
    url = f"file://{tmp_path}/l3"
    tokens = prompt(PAGE)
    key, path = _one_stored_page(tmp_path, url, tokens)
    with open(path, "r+b") as f:
        f.truncate(size)
    backend = open_backend(url)
    assert backend.batch_exists([key]) == 0
    assert backend.stats()["corrupt"] == 1 and backend.stats()["corrupt_removed"] == 1
    assert not os.path.exists(path)
    backend.close()
    with open(path, "wb") as f:  # cut short again: a backup writes over it instead of skipping it as stored
        f.write(b"x" * size)
    again = make_cache()
    try:
        again.attach_storage(url, **FAST)
        _stored(again, tokens)
        assert os.path.getsize(path) > 92 and again.storage.backend.batch_exists([key]) == 1
        assert again.storage.verify_stored() == 0
    finally:
        again.close()


def test_file_a_directory_in_a_pages_place_is_counted_where_a_query_stops(tmp_path):
    """An existence query (what a prefetch asks first) counts the entry corrupt, as a read does, and leaves it."""
    url = f"file://{tmp_path}/l3"
    key, path = _one_stored_page(tmp_path, url, prompt(PAGE, seed=3))
    os.unlink(path)
    os.mkdir(path)
    backend = open_backend(url)
    try:
        assert backend.batch_exists([key]) == 0
        assert backend.stats()["corrupt"] == 1 and backend.stats()["corrupt_removed"] == 0
        assert os.path.isdir(path)  # not ours to delete
    finally:
        backend.close()


# ====================================================================== close(drain) right after an insert


def test_close_with_drain_stores_what_was_just_inserted(tmp_path):
    url = f"file://{tmp_path}/l3"
    cache = make_cache()
    cache.attach_storage(url, **FAST)
    tokens = prompt(4 * PAGE, seed=5)
    put(cache, tokens)  # no poll: the device-to-host copy has not been applied yet
    cache.close(drain=60)
    reader = open_backend(url)
    try:
        from hicache_fsm.storage import page_keys
        assert reader.batch_exists(page_keys(tokens, PAGE)) == 4
    finally:
        reader.close()


# ====================================================================== threads and reset


def _refused_elsewhere(call) -> bool:
    """Whether ``call()`` on another thread raised ``WrongThread``."""
    errors = []

    def other():
        try:
            call()
        except WrongThread as exc:
            errors.append(exc)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    return len(errors) == 1


def test_observers_are_added_and_removed_by_the_owning_thread_only(cache):
    cache.poll()  # this thread owns the cache
    seen = []
    assert _refused_elsewhere(lambda: cache.add_observer(seen.append))
    put(cache, prompt(PAGE))
    assert seen == []  # nothing was added
    cache.add_observer(seen.append)
    assert _refused_elsewhere(lambda: cache.remove_observer(seen.append))
    put(cache, prompt(PAGE, seed=9))
    assert seen  # still observing


def test_poll_after_reset_reports_no_cancelled_job_as_applied():
    from hicache_fsm.cache import HiCache
    from hicache_fsm.config import CacheConfig

    base = make_cache()
    device, host = base.device_pool, base.host_pool
    base.close()
    executor = ManualExecutor(device, host)
    cache = HiCache(device, host, CacheConfig(write_policy="write_through"), executor=executor)
    try:
        put(cache, prompt(4 * PAGE))
        cache.flush()
        pending = executor.pending_job_ids()
        assert pending
        cache.reset()
        for job in pending:
            executor.complete(job)
        assert cache.poll() == []
        cache.check_invariants()
        assert cache.stats()["late_cancelled_completions"] == len(pending)
    finally:
        cache.close()


# ====================================================================== the data epoch off the scheduler's thread


class EpochWatch(MemoryBackend):
    """A memory store that records who reads its data epoch, and can stop answering."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.callers: list[threading.Thread] = []
        self.frozen = False

    def data_epoch(self) -> int:
        self.callers.append(threading.current_thread())
        self._answer()
        return super().data_epoch()

    def batch_exists(self, keys) -> int:  # the health probe's call
        self._answer()
        return super().batch_exists(keys)

    def _answer(self) -> None:
        if self.frozen:
            raise StorageTimeout("the server stopped answering")


def test_the_data_epoch_is_read_by_the_storage_thread_and_a_silent_store_is_an_outage(cache):
    """``poll`` never waits on the store: the epoch is read on the I/O thread, and a read that fails takes the
    link down (prefetches refused) until the store answers again."""
    backend = EpochWatch(store="epoch-watch")
    cache.attach_storage(backend, **{**FAST, "retry_interval": 0.0, "probe_interval": 0.01})
    backend.callers.clear()  # the attach's own read is the caller's
    wait_until(cache, lambda: len(backend.callers) >= 2, what="the epoch read by the storage thread")
    assert threading.main_thread() not in backend.callers
    backend.frozen = True
    wait_until(cache, lambda: not cache.storage.healthy, what="the silent store noticed")
    assert cache.stats()["storage"]["storage_outages"] == 1
    tokens = prompt(4 * PAGE, seed=11)
    assert not cache.prefetch("r", tokens, cache.match_prefix(tokens))
    backend.frozen = False
    wait_until(cache, lambda: cache.storage.healthy, what="the store answering again")
    assert threading.main_thread() not in backend.callers[2:]


class StuckQuery(MemoryBackend):
    """A store whose hit query hangs inside a lock its close also takes (as Mooncake's client lock)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.lock = threading.Lock()
        self.entered = threading.Event()
        self.release = threading.Event()
        self.hang = False

    def batch_exists(self, keys) -> int:
        with self.lock:
            if self.hang:
                self.entered.set()
                self.release.wait()  # the test (or its watchdog) releases it
            return super().batch_exists(keys)

    def _close(self) -> None:
        with self.lock:
            super()._close()


def test_close_does_not_wait_on_a_backend_call_that_hangs():
    """A thread stuck in a backend call past ``join_timeout`` closes the backend itself when the call returns;
    ``close`` neither waits for the call nor leaves the backend open."""
    cache = make_cache()
    backend = StuckQuery(store="stuck-query")
    cache.attach_storage(backend, **{**FAST, "join_timeout": 0.05})
    backend.hang = True
    tokens = prompt(4 * PAGE, seed=13)
    assert cache.prefetch("r", tokens, cache.match_prefix(tokens))
    assert backend.entered.wait(120)
    watchdog = threading.Timer(60, backend.release.set)  # a bound for a hung close, not a timing
    watchdog.start()
    try:
        cache.close()
        returned_while_stuck = not backend.release.is_set()
    finally:
        watchdog.cancel()
        backend.release.set()
    assert returned_while_stuck
    for thread in storage_threads():
        thread.join(120)
    assert not storage_threads() and backend.closed


# ====================================================================== redis URL parameters


@pytest.mark.parametrize("query", ["socket_timeout=inf", "socket_timeout=20", "socket_timeout=0",
                                   "socket_connect_timeout=nan", "max_connections=0", "timeout=-1",
                                   "health_check_interval=3", "retry_on_timeout=true", "db=0&socket_timeout=1"])
def test_redis_url_parameters_that_would_override_a_checked_option_are_refused(cache, query):
    from hicache_fsm.errors import StorageURLError
    from hicache_fsm.storage import check_url

    url = f"redis://127.0.0.1:1/0?{query}"
    with pytest.raises(StorageURLError, match="set by the backend"):
        check_url(url)
    with pytest.raises(StorageLinkError, match="set by the backend"):
        cache.attach_storage(url, **FAST)
    assert cache.storage is None or cache.storage.state == "detached"


def test_redis_url_parameters_the_backend_does_not_set_pass_the_form_check():
    from hicache_fsm.storage import check_url

    assert check_url("redis://127.0.0.1:6379/0?protocol=3").query == "protocol=3"


def test_a_backend_call_close_left_running_ends_before_the_interpreter_exits(tmp_path):
    """The exit waits for it (a native client torn down mid-call aborts the process), and the backend is
    closed by that thread as it leaves."""
    import subprocess
    import sys

    marker = tmp_path / "closed"
    script = tmp_path / "late_close.py"
    script.write_text(f"""
import sys, threading
sys.path.insert(0, {str(Path(__file__).parent)!r})
from storage_util import make_cache, prompt
from test_embedding_contracts import FAST, StuckQuery

class Marked(StuckQuery):
    def _close(self):
        super()._close()
        open({str(marker)!r}, "w").close()

cache = make_cache()
backend = Marked(store="late-close")
cache.attach_storage(backend, **{{**FAST, "join_timeout": 0.05}})
backend.hang = True
tokens = prompt(16, seed=13)
assert cache.prefetch("r", tokens, cache.match_prefix(tokens))
assert backend.entered.wait(120)
cache.close()
assert not backend.closed  # the call is still running: closed when it returns
answer = threading.Timer(0.2, backend.release.set)  # the server answers again, after the script's end
answer.daemon = True  # not waited for by the interpreter itself: only the storage link's exit hook waits
answer.start()
""")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert marker.exists()


# ====================================================================== eviction order with backups to make


@pytest.mark.parametrize("write_policy", ["write_back", "write_behind"])
@pytest.mark.parametrize("eviction_policy", ["lru", "lfu", "priority"])
def test_eviction_keeps_policy_order_when_the_first_candidates_need_a_backup(write_policy, eviction_policy):
    """The first candidate is backed up and then evicted; a later candidate that happens to have a host copy
    already is not evicted in its place (the reference's write_back evict counts the backup toward the goal)."""
    from hicache_fsm.cache import HiCache
    from hicache_fsm.config import CacheConfig
    from hicache_fsm.pools import KVShape, PoolConfig, build_pools

    pools = build_pools(PoolConfig(KVShape(1, 1, 1), device_tokens=3, page_size=1, host_tokens=50, device="cpu"))
    cache = HiCache(pools.device, pools.host, CacheConfig(write_policy=write_policy, eviction_policy=eviction_policy,
                                                          write_behind_idle_steps=1000))
    try:
        nodes = [cache.insert((t,), cache.alloc_device(1), priority=t).node for t in range(3)]  # 0: first to go
        for node in nodes[1:]:
            for _ in range(2 if node is nodes[2] else 1):  # lfu: more hits than node 0
                cache.match_prefix((nodes.index(node),))
        cache.write_backup(nodes[2])  # the hottest one has a host copy already
        cache.poll()
        assert [n.state for n in nodes] == ["device", "device", "device_host"]
        assert cache.evict(1) == 1
        cache.poll()
        assert [n.state for n in nodes] == ["host", "device", "device_host"]
    finally:
        cache.close()
