"""Storage that lost or damaged pages heals, and one bad entry or a read-only store is no outage.

Real backends only: a private redis-server (flushed, restarted empty, a key of
another type), a real directory (a flipped byte, a directory or FIFO where a
page file should be, a tree made read-only with the process's DAC override
dropped through ``setpriv``). Waits are bounded by a count of polls; the wall
clock only stops a hang (``hang_guard``).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from hang_guard import HANG_GUARD_S
from storage_util import PAGE, evict_all, make_cache, path_nodes, prompt, put
from test_storage_backends import FakeHostPool
from test_storage_faults_cache import OPTS, is_stored, prefetch_and_proceed, seed

from hicache_fsm.errors import StorageFull
from hicache_fsm.storage import KeyNamespace, open_backend, page_keys
from hicache_fsm.storage.file import FileBackend
from hicache_fsm.storage.page_format import PageFormat, page_format_of

POLLS = 10_000  # polls, each after a 2 ms sleep: far more than any check here needs
KINDS = ["memory", "file", "redis"]
NS = KeyNamespace("heal")
_UNPRIVILEGED = "HICACHE_TEST_NO_DAC_OVERRIDE"  # set in the child that runs without CAP_DAC_OVERRIDE
_NO_DAC = "-dac_override,-dac_read_search,-fowner"


def poll_until(cache, cond: Callable[[], bool], what: str) -> None:
    """Poll ``cache`` until ``cond()``; fail after POLLS polls (the wall clock is only a hang guard)."""
    guard = time.monotonic() + HANG_GUARD_S
    for _ in range(POLLS):
        cache.poll()
        if cond():
            return
        assert time.monotonic() < guard, f"still waiting for {what} after {HANG_GUARD_S} s"
        time.sleep(0.002)
    raise AssertionError(f"no {what} after {POLLS} polls; storage stats {cache.stats()['storage']}")


def guarded(fn: Callable, *args: object) -> object:
    """``fn(*args)`` on a daemon thread: a call that blocks for good fails the test instead of stalling it."""
    outcome: list[tuple[bool, object]] = []

    def target() -> None:
        try:
            outcome.append((True, fn(*args)))
        except BaseException as exc:  # noqa: BLE001 - raised again on the test's thread
            outcome.append((False, exc))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(HANG_GUARD_S)
    assert outcome, f"{getattr(fn, '__name__', fn)} still running after {HANG_GUARD_S} s"
    ok, value = outcome[0]
    if not ok:
        raise value  # type: ignore[misc]
    return value


def storage_stats(cache) -> dict:
    return cache.stats()["storage"]


def host_page_bytes(cache, tokens, page: int) -> bytes:
    """The bytes of page ``page`` of ``tokens`` in the cache's host pool (what a backup stores)."""
    path, _ = path_nodes(cache, tokens)
    token = page * PAGE
    for node in path:
        if token < len(node.key):
            return cache.host_pool.read_page(int(node.host_indices[token]) // PAGE).numpy().tobytes()
        token -= len(node.key)
    raise AssertionError(f"page {page} is not cached")


def url_of(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if kind == "memory":
        return "memory://"
    if kind == "file":
        return f"file://{tmp_path}/store"
    return request.getfixturevalue("redis_server").url


@pytest.fixture
def cache():
    c = make_cache()
    yield c
    c.close()


@pytest.fixture
def backend(request, tmp_path):
    """A backend of the parametrized ``kind`` on namespace NS, closed at teardown."""
    b = open_backend(url_of(request.param, tmp_path, request), namespace=NS)
    yield b
    b.close()


def pages(n: int, seed: int = 0) -> tuple[list[str], list[bytes]]:
    """``n`` page keys and distinct 64-byte values."""
    return page_keys(prompt(n * PAGE, seed=seed), PAGE), [bytes([seed + i]) * 64 for i in range(n)]


# ====================================================================== finding 2: redis data epoch


@pytest.mark.redis
@pytest.mark.parametrize("loss", ["flushall", "restart_empty"])
def test_redis_that_lost_every_page_gets_its_nodes_stored_again(cache, redis_server, loss):
    cache.attach_storage(redis_server.url, **OPTS)
    t = prompt(48, seed=21)
    keys = page_keys(t, PAGE)
    put(cache, t)
    poll_until(cache, lambda: is_stored(cache, t), "first backup")
    nodes = len(path_nodes(cache, t)[0])
    stored_before = storage_stats(cache)["backup_tokens_stored"]
    if loss == "flushall":
        client = redis.Redis.from_url(redis_server.url)
        client.flushall()
        client.close()
    else:
        redis_server.restart()  # no persistence: it comes back empty on the same port
    assert cache.storage.backend.batch_exists(keys) == 0
    poll_until(cache, lambda: storage_stats(cache)["storage_lost_nodes"] >= nodes, "the loss noticed")
    stored_again = stored_before + 48
    poll_until(cache, lambda: is_stored(cache, t) and storage_stats(cache)["backup_tokens_stored"] >= stored_again,
               "the nodes stored again")
    assert storage_stats(cache)["data_epoch_changes"] == 1
    assert cache.storage.backend.batch_exists(keys) == len(keys)
    evict_all(cache, t)  # only redis holds the KV now: every page comes back, bit for bit
    assert prefetch_and_proceed(cache, t) == 48


@pytest.mark.redis
def test_redis_data_epoch_is_shared_by_clients_and_renewed_when_the_pages_go(redis_server):
    one = open_backend(redis_server.url, namespace=NS, ttl=30)
    two = open_backend(redis_server.url, namespace=NS)
    client = redis.Redis.from_url(redis_server.url)
    try:
        epoch = one.data_epoch()
        assert two.data_epoch() == epoch == one.data_epoch()  # a second client reads the same token
        assert client.ttl(f"{NS.prefix}/data-epoch") == -1  # never expires, even on a backend with a ttl
        keys, values = pages(2)
        one.batch_set(keys, values)
        assert one.data_epoch() == epoch  # storing pages loses nothing
        two.clear()
        renewed = one.data_epoch()
        assert renewed != epoch and two.data_epoch() == renewed
        client.flushdb()
        assert two.data_epoch() not in (epoch, renewed)
    finally:
        client.close()
        one.close()
        two.close()


# ====================================================================== finding 3: a corrupt page is replaced


@pytest.mark.parametrize("kind", KINDS)
def test_a_corrupt_page_is_removed_and_the_next_backup_stores_a_good_one(cache, kind, tmp_path, request):
    cache.attach_storage(url_of(kind, tmp_path, request), **{**OPTS, "batch_pages": 4})
    t = prompt(48, seed=22)
    seed(cache, t)
    backend = cache.storage.backend
    key = page_keys(t, PAGE)[3]
    assert backend.debug_corrupt(key)
    assert prefetch_and_proceed(cache, t) == 3 * PAGE  # never the corrupt page or anything after it
    bs = storage_stats(cache)["backend_stats"]
    assert bs["corrupt"] == 1 and bs["corrupt_removed"] == 1
    poll_until(cache, lambda: is_stored(cache, t), "the recomputed node stored")
    good = host_page_bytes(cache, t, 3)
    assert backend.batch_get([key], page_format=page_format_of(cache.host_pool)) == [good]
    evict_all(cache, t)
    assert prefetch_and_proceed(cache, t) == 48  # the whole prefix again, bit for bit
    assert storage_stats(cache)["backend_stats"]["corrupt"] == 1


@pytest.mark.parametrize("backend", KINDS, indirect=True)
def test_a_page_of_another_format_is_left_alone_and_only_a_corrupt_one_removed(backend):
    mine = PageFormat("layer_major", 2, 2, 8, "float32", PAGE)
    theirs = PageFormat("token_major", 2, 2, 8, "float32", PAGE)
    keys, values = pages(2, seed=3)
    assert backend.batch_set(keys, values, page_format=mine) == [True, True]
    assert backend.debug_corrupt(keys[1])
    assert backend.batch_get(keys, page_format=theirs) == [None, None]  # another reader's pages: a miss ...
    s = backend.stats()
    assert s["format_mismatch"] == 2 and s["corrupt"] == 0 and s["corrupt_removed"] == 0
    assert backend.batch_exists(keys) == 2  # ... left in place
    assert backend.batch_get(keys, page_format=mine) == [values[0], None]
    s = backend.stats()
    assert s["corrupt"] == 1 and s["corrupt_removed"] == 1
    assert backend.batch_exists(keys) == 1  # the corrupt one is gone, the intact one stays
    assert backend.batch_set(keys, values, page_format=mine) == [True, True]
    assert backend.stats()["skipped_existing"] == 1  # only the intact page was skipped: the other was written
    assert backend.batch_get(keys, page_format=mine) == values


@pytest.mark.parametrize("backend", KINDS, indirect=True)
def test_a_page_another_library_version_wrote_is_a_miss_left_in_place(backend, monkeypatch):
    """Two versions sharing one store during a rolling upgrade must not delete each other's pages."""
    from hicache_fsm.storage import blob

    keys, values = pages(1, seed=5)
    monkeypatch.setattr(blob, "FORMAT_VERSION", blob.FORMAT_VERSION + 1)  # the next version writes ...
    assert backend.batch_set(keys, values) == [True]
    monkeypatch.undo()  # ... this one reads
    assert backend.batch_get(keys) == [None]
    s = backend.stats()
    assert s["format_mismatch"] == 1 and s["corrupt"] == 0 and s["corrupt_removed"] == 0
    assert backend.batch_exists(keys) == 1


@pytest.mark.parametrize("backend", KINDS, indirect=True)
def test_an_intact_page_of_another_size_is_a_miss_left_alone(backend):
    keys, values = pages(1, seed=4)  # untyped 64-byte pages: only their size tells them from a 128-byte reader's
    backend.batch_set(keys, values)
    assert backend.batch_get_into(keys, FakeHostPool(1, 128), [0]) == [False]
    s = backend.stats()
    assert s["corrupt"] == 1 and s["corrupt_removed"] == 0
    assert backend.batch_get(keys) == values


# ====================================================================== finding 4: one bad entry is no outage


@pytest.mark.parametrize("entry", ["directory", "fifo"])
def test_file_something_else_in_a_pages_place_is_a_corrupt_miss_left_alone(tmp_path, entry):
    b = FileBackend(tmp_path / "store", NS)
    try:
        keys, values = pages(3, seed=5)
        b.batch_set(keys, values)
        victim = b.path_for(keys[1])
        os.unlink(victim)
        os.mkdir(victim) if entry == "directory" else os.mkfifo(victim)
        assert b.batch_exists(keys) == 1  # not a stored page: counted corrupt where the query stops
        assert guarded(b.batch_get, keys) == [values[0], None, values[2]]  # a FIFO must not block the read either
        assert guarded(b.batch_get_into, keys[1:], FakeHostPool(2, 64), [0, 1]) == [False, True]
        s = b.stats()
        assert s["corrupt"] == 3 and s["corrupt_removed"] == 0 and s["errors"] == 0
        mode = os.lstat(victim).st_mode
        assert stat.S_ISDIR(mode) if entry == "directory" else stat.S_ISFIFO(mode)  # not ours: still there
        assert b.batch_set(keys[1:2], values[1:2]) == [True]  # reported as present, nothing raised
    finally:
        b.close()


def test_file_a_directory_in_a_pages_place_is_no_outage(cache, tmp_path):
    cache.attach_storage(f"file://{tmp_path}/store", **OPTS)
    victim, other = prompt(40, seed=6), prompt(32, seed=7)
    seed(cache, victim)
    seed(cache, other)
    path = cache.storage.backend.path_for(page_keys(victim, PAGE)[2])
    os.unlink(path)
    os.mkdir(path)
    for _ in range(3):
        assert prefetch_and_proceed(cache, victim) == 2 * PAGE  # the pages before the directory
        evict_all(cache, victim)
    assert prefetch_and_proceed(cache, other) == 32  # other pages still read
    st = storage_stats(cache)
    assert st["storage_outages"] == 0 and st["storage_errors"] == 0 and cache.storage.healthy
    assert os.path.isdir(path)


@pytest.mark.redis
def test_redis_a_key_of_another_type_is_a_corrupt_miss_for_that_key_only(redis_server):
    b = open_backend(redis_server.url, namespace=NS)
    client = redis.Redis.from_url(redis_server.url)
    try:
        keys, values = pages(3, seed=8)
        b.batch_set(keys, values)
        skey = NS.storage_key(keys[1])
        client.delete(skey)
        client.rpush(skey, b"not a page")
        assert b.batch_get(keys) == [values[0], None, values[2]]
        assert b.batch_get_into(keys[1:], FakeHostPool(2, 64), [0, 1]) == [False, True]
        s = b.stats()
        assert s["corrupt"] == 2 and s["corrupt_removed"] == 0 and s["errors"] == 0
        assert b.batch_exists(keys) == 3  # EXISTS sees the key ...
        assert b.batch_set(keys[1:2], values[1:2]) == [True]  # ... and so does a set: present, nothing raised
        assert b.stats()["skipped_existing"] == 1
        assert client.type(skey) == b"list"  # not ours: left alone
    finally:
        client.close()
        b.close()


@pytest.mark.redis
def test_redis_a_key_of_another_type_is_no_outage(cache, redis_server):
    cache.attach_storage(redis_server.url, **OPTS)
    t = prompt(40, seed=9)
    seed(cache, t)
    skey = cache.storage.backend.namespace.storage_key(page_keys(t, PAGE)[2])
    client = redis.Redis.from_url(redis_server.url)
    client.delete(skey)
    client.rpush(skey, b"not a page")
    client.close()
    for _ in range(3):
        assert prefetch_and_proceed(cache, t) == 2 * PAGE
        evict_all(cache, t)
    st = storage_stats(cache)
    assert st["storage_outages"] == 0 and st["storage_errors"] == 0 and cache.storage.healthy
    assert st["backend_stats"]["corrupt"] == 3


# ====================================================================== finding 5: a read-only store backs off


def _chmod_dirs(root: Path, mode: int) -> None:
    for dirpath, _, _ in os.walk(root):
        os.chmod(dirpath, mode)


def _run_without_dac_override(test_id: str, tmp_path: Path) -> None:
    """Run ``test_id`` in a child pytest whose root has no CAP_DAC_OVERRIDE (chmod binds it); pass or skip with it."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: file modes cannot make the store read-only")
    drop = [setpriv, f"--bounding-set={_NO_DAC}", f"--inh-caps={_NO_DAC}"]
    probe = subprocess.run([*drop, "true"], capture_output=True, text=True, timeout=HANG_GUARD_S)
    if probe.returncode != 0:  # e.g. a container without CAP_SETPCAP
        pytest.skip(f"setpriv cannot drop CAP_DAC_OVERRIDE here: {probe.stderr.strip()}")
    repo = Path(__file__).resolve().parents[1]
    child = subprocess.run(
        [*drop, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={tmp_path / 'child'}",
         f"{Path(__file__).resolve()}::{test_id}"],
        cwd=repo, env={**os.environ, _UNPRIVILEGED: "1"}, capture_output=True, text=True, timeout=10 * HANG_GUARD_S)
    report = child.stdout + child.stderr
    if child.returncode == 0 and "1 skipped" in child.stdout:
        pytest.skip(f"the child could not drop CAP_DAC_OVERRIDE: {report[-500:]}")
    assert child.returncode == 0 and "1 passed" in child.stdout, report[-4000:]


def test_a_read_only_file_store_backs_off_backups_without_an_outage(tmp_path):
    if os.geteuid() == 0 and not os.environ.get(_UNPRIVILEGED):
        _run_without_dac_override("test_a_read_only_file_store_backs_off_backups_without_an_outage", tmp_path)
        return
    store = tmp_path / "store"
    cache = make_cache()
    try:
        cache.attach_storage(f"file://{store}", **OPTS)
        before = prompt(32, seed=11)
        seed(cache, before)
        _chmod_dirs(store, 0o555)
        try:
            if os.access(cache.storage.backend.ns_dir, os.W_OK):
                pytest.skip("this process writes through file modes (CAP_DAC_OVERRIDE)")
            with pytest.raises(StorageFull, match="writing page"):
                cache.storage.backend.batch_set(*pages(1, seed=12))
            t = prompt(32, seed=10)
            put(cache, t)
            poll_until(cache, lambda: storage_stats(cache).get("backup_failures", 0) >= 2, "failed, retried backups")
            assert path_nodes(cache, t)[0][-1].state in ("device_host", "device_host_storing")
            assert prefetch_and_proceed(cache, before) == 32  # reads and prefetches go on
            st = storage_stats(cache)
            assert st["storage_outages"] == 0 and st["prefetch_rejected_unhealthy"] == 0 and cache.storage.healthy
        finally:
            _chmod_dirs(store, 0o755)
        poll_until(cache, lambda: is_stored(cache, t), "the backup once the store is writable again")
    finally:
        cache.close()
