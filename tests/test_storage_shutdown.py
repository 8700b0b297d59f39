"""Ending without ``close``: a process whose backups still run exits cleanly; a closed backend answers nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from hicache_fsm.storage import open_backend
from hicache_fsm.storage.base import StorageUnavailable
from hicache_fsm.storage.keys import KeyNamespace
from hicache_fsm.storage.keys_only import KeysOnlyBackend

# Backs up a few pages to storage and ends while the backups run: no close, no wait.
SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from hicache_fsm.cache import HiCache
    from hicache_fsm.config import CacheConfig
    from hicache_fsm.pools import DeviceKVPool, HostKVPool, KVShape

    shape = KVShape(layers=4, heads=8, head_dim=64, dtype=torch.float32)
    device = DeviceKVPool(shape, 16 * 64, 64, "cpu")
    host = HostKVPool(shape, 32 * 64, 64, pin_memory=False)
    cache = HiCache(device, host, CacheConfig(write_policy="write_through"))
    cache.attach_storage(sys.argv[1], model="shutdown-test")
    for j in range(8):
        slots = cache.alloc_device(64)
        device.write(slots, None, torch.randn(4, 64, 8, 64), torch.randn(4, 64, 8, 64))
        cache.insert([1000 * j + t for t in range(64)], slots)
    cache.poll()
    cache.poll()
    print("storage transfers in flight:", cache.storage_transfers_in_flight(), flush=True)
""")


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_a_process_that_ends_while_storage_backups_run_exits_cleanly(tmp_path, scheme):
    # Before the exit hook, a storage thread inside a torch call while the interpreter
    # finalized aborted the process (SIGABRT) in most runs: four runs make a pass by chance unlikely.
    url = "memory://" if scheme == "memory" else f"file://{tmp_path}/store"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    runs = [subprocess.Popen([sys.executable, "-c", SCRIPT, url], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env) for _ in range(4)]
    for proc in runs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"exit status {proc.returncode}; stderr: {err[-2000:]}"
        assert "storage transfers in flight" in out
        assert "Traceback" not in err and "terminate called" not in err, err[-2000:]
        assert "still running" not in err, err[-2000:]  # every thread stopped within its join timeout


def _closed_backends(tmp_path, redis_url):
    namespace = KeyNamespace(model="shutdown-test")
    file_dir = tmp_path / "store"
    backends = {
        "file": open_backend(f"file://{file_dir}", namespace=namespace),
        "memory": open_backend("memory://", namespace=namespace),
        "redis": open_backend(redis_url, namespace=namespace),
        "keys only": KeysOnlyBackend(namespace),
    }
    for backend in backends.values():
        backend.data_epoch()
        backend.close()
    return backends, file_dir


def test_a_closed_backend_refuses_data_epoch_like_every_other_call(tmp_path, redis_server):
    backends, file_dir = _closed_backends(tmp_path, redis_server.url)
    for name, backend in backends.items():
        with pytest.raises(StorageUnavailable, match="closed"):
            backend.data_epoch()
        with pytest.raises(StorageUnavailable, match="closed"):
            backend.batch_exists(["k"])
    # a closed file:// store whose directory was wiped writes nothing again
    for root, dirs, files in os.walk(file_dir, topdown=False):
        for f in files:
            os.unlink(os.path.join(root, f))
        os.rmdir(root)
    with pytest.raises(StorageUnavailable):
        backends["file"].data_epoch()
    assert not file_dir.exists()


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_a_cache_dropped_without_close_is_collected_and_its_storage_threads_end(tmp_path, scheme):
    # The storage threads held their tier (and through it the cache and its host pool) for good:
    # every cache an engine or a notebook dropped unclosed kept two threads, its pools and its backend.
    import gc
    import threading
    import time
    import weakref

    import torch

    from hicache_fsm.cache import HiCache
    from hicache_fsm.config import CacheConfig
    from hicache_fsm.pools import DeviceKVPool, HostKVPool, KVShape
    from hicache_fsm.storage.link import THREAD_PREFIX

    before = set(threading.enumerate())
    url = "memory://" if scheme == "memory" else f"file://{tmp_path}/store"
    backend = open_backend(url, namespace=KeyNamespace(model="drop-test"))
    shape = KVShape(layers=2, heads=2, head_dim=8, dtype=torch.float32)
    host = HostKVPool(shape, 32 * 16, 16, pin_memory=False)
    cache = HiCache(DeviceKVPool(shape, 16 * 16, 16, "cpu"), host, CacheConfig(write_policy="write_through"))
    cache.attach_storage(backend, model="drop-test")
    for j in range(4):
        cache.insert([100 * j + t for t in range(32)], cache.alloc_device(32))
        cache.poll()  # backups to storage queued and running as the cache is dropped
    threads = [t for t in threading.enumerate() if t not in before and t.name.startswith(THREAD_PREFIX)]
    assert len(threads) == 2
    dropped, dropped_host = weakref.ref(cache), weakref.ref(host)
    del cache, host
    deadline = time.monotonic() + 60  # a bound for a hung run, not a timing: collection needs no wait
    while dropped() is not None and time.monotonic() < deadline:
        gc.collect()  # the cache and its tier refer to each other: a cycle for the collector
        time.sleep(0.01)  # a thread in the middle of a backup holds the tier until the backup ends
    assert dropped() is None and dropped_host() is None
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive()
    with pytest.raises(StorageUnavailable, match="closed"):  # the tier's finalizer closed the backend
        backend.data_epoch()
