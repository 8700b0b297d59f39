"""The mooncake:// backend against a real ``mooncake_master`` on 127.0.0.1 (random ports).

Skipped, with the reason, when ``mooncake.store`` does not import or the
master binary is missing (``.ci/run`` installs both).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from mooncake_fixture import free_port
from storage_util import PAGE, evict_all, make_cache, prompt, put, wait_until
from test_storage_faults_cache import OPTS, is_stored, logged, prefetch_and_proceed, seed

from hicache_fsm.cli import main
from hicache_fsm.errors import StorageLinkError, StorageUnavailable, StorageURLError
from hicache_fsm.pools import LAYOUTS, HostKVPool, KVShape
from hicache_fsm.storage import KeyNamespace, open_backend, page_keys
from hicache_fsm.storage.faults import FaultyBackend

pytestmark = pytest.mark.mooncake
NS = KeyNamespace("mc-test")
SHAPE = KVShape(layers=3, heads=2, head_dim=8, dtype=torch.bfloat16)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pool(layout: str = "layer_first", seed: int | None = 0, pages: int = 8) -> HostKVPool:
    p = HostKVPool(SHAPE, pages * PAGE, PAGE, layout, pin_memory=False)
    if seed is not None:
        p.kv.copy_(torch.randn(p.kv.shape, generator=torch.Generator().manual_seed(seed)).to(p.kv.dtype))
    return p


def child(script: str, *args: str) -> subprocess.Popen:
    """A second process using the backend (same interpreter, this checkout's package)."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


WRITER = """
    import sys, time, torch
    from hicache_fsm.pools import HostKVPool, KVShape
    from hicache_fsm.storage import KeyNamespace, open_backend, page_keys
    shape = KVShape(layers=3, heads=2, head_dim=8, dtype=torch.bfloat16)
    pool = HostKVPool(shape, 8 * 4, 4, "layer_first", pin_memory=False)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(11)).to(pool.kv.dtype))
    backend = open_backend(sys.argv[1], namespace=KeyNamespace("mc-test"))
    keys = page_keys(list(range(1000, 1032)), 4)
    print(all(backend.batch_set_from(keys, pool, list(range(8)))), flush=True)
    if sys.argv[2] == "hold":
        time.sleep(120)
    backend.close()
"""


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_bit_exact(mooncake_master, layout):
    b = open_backend(mooncake_master.url, namespace=NS)
    try:
        src, dst = pool(layout, seed=1), pool(layout, seed=None)
        keys = page_keys(prompt(3 * PAGE, seed=hash(layout) % 1000), PAGE)
        assert b.batch_set_from(keys, src, [5, 0, 7]) == [True] * 3
        assert b.batch_set_from(keys, src, [1, 2, 3]) == [True] * 3  # already stored: skipped, not rewritten
        assert b.stats()["skipped_existing"] == 3
        assert b.batch_exists(keys) == 3
        assert b.batch_get_into(keys, dst, [1, 2, 3]) == [True] * 3
        for s, d in [(5, 1), (0, 2), (7, 3)]:
            assert torch.equal(dst.read_page(d), src.read_page(s))
        assert b.batch_set(["a" * 64], [b"bytes api"]) == [True]
        assert b.batch_get(["a" * 64, "b" * 64]) == [b"bytes api", None]
        b.clear()
        assert b.batch_exists(keys) == 0
    finally:
        b.close()


def test_a_checksummed_store_turns_a_damaged_page_into_a_miss(mooncake_master):
    b = open_backend(mooncake_master.url + "&checksum=wsum64", namespace=NS)
    try:
        src, dst = pool(seed=2), pool(seed=None)
        keys = page_keys(prompt(3 * PAGE, seed=5), PAGE)
        assert b.batch_set_from(keys, src, [0, 1, 2]) == [True] * 3
        assert b.debug_corrupt(keys[1])
        assert b.batch_get_into(keys, dst, [4, 5, 6]) == [True, False, True]
        assert b.stats()["corrupt"] == 1
        assert torch.equal(dst.read_page(4), src.read_page(0)) and torch.equal(dst.read_page(6), src.read_page(2))
    finally:
        b.close()


def test_a_value_of_another_size_is_a_miss(mooncake_master):
    b = open_backend(mooncake_master.url, namespace=NS)
    try:
        keys = page_keys(prompt(PAGE, seed=6), PAGE)
        small = HostKVPool(KVShape(layers=1, heads=2, head_dim=8, dtype=torch.bfloat16), 8 * PAGE, PAGE,
                           "layer_first", pin_memory=False)
        assert b.batch_set_from(keys, small, [0]) == [True]
        assert b.batch_get_into(keys, pool(seed=None), [0]) == [False]
        assert b.stats()["format_mismatch"] == 1
    finally:
        b.close()


def test_bad_urls_are_typed_errors():
    for url in ("mooncake://127.0.0.1", "mooncake://127.0.0.1:1/x", "mooncake://h:1?segment_mb=0",
                "mooncake://h:1?nope=1"):
        with pytest.raises(StorageURLError):
            open_backend(url)


def test_no_master_at_attach_fails_fast_and_typed(mooncake_master):
    url = f"mooncake://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(StorageUnavailable):
        open_backend(url)
    cache = make_cache()
    try:
        with pytest.raises(StorageLinkError):
            cache.attach_storage(url)
        assert cache.storage.state == "detached"
    finally:
        cache.close()


def test_two_processes_share_one_master(mooncake_master):
    writer = child(WRITER, mooncake_master.url, "hold")  # its pages live in its own segment while it runs
    b = open_backend(mooncake_master.url, namespace=NS)
    try:
        assert writer.stdout.readline().strip() == "True"
        src, dst = pool(seed=11), pool(seed=None)
        keys = page_keys(list(range(1000, 1032)), PAGE)
        assert b.batch_exists(keys) == 8
        assert b.batch_get_into(keys, dst, list(range(8))) == [True] * 8
        assert torch.equal(dst.kv, src.kv)
        assert b.batch_set_from(keys, pool(seed=99), list(range(8))) == [True] * 8  # stored already: kept
        assert b.stats()["skipped_existing"] == 8
    finally:
        b.close()
        writer.kill()
        writer.wait(timeout=10)


def test_dead_segment_holder_is_a_miss_never_wrong_bytes(tmp_path_factory):
    from mooncake_fixture import start_master

    master = start_master(tmp_path_factory.mktemp("mooncake"), client_ttl=2)
    holder = None
    b = open_backend(master.url, namespace=NS)
    try:
        holder = child(WRITER, master.url, "hold")
        assert holder.stdout.readline().strip() == "True"
        keys = page_keys(list(range(1000, 1032)), PAGE)
        src, dst = pool(seed=11), pool(seed=None)
        holder.kill()
        holder.wait(timeout=10)
        deadline = time.monotonic() + 120  # a safety stop only: the master drops it after client_ttl (2 s)
        lingering = keys
        while lingering and time.monotonic() < deadline:  # unreadable yet listed, until the master notices
            dst.kv.zero_()
            got = b.batch_get_into(keys, dst, list(range(8)))
            for page, hit in enumerate(got):  # pages that happened to land in our own segment stay readable
                if hit:
                    assert torch.equal(dst.read_page(page), src.read_page(page))
            lingering = [k for k, hit in zip(keys, got) if not hit and b.exists(k)]
            time.sleep(0.2)
        assert not lingering, "the master never dropped the dead holder's pages"
        ours = pool(seed=3)
        fresh = page_keys(prompt(4 * PAGE, seed=3), PAGE)
        assert b.batch_set_from(fresh, ours, [0, 1, 2, 3]) == [True] * 4
        assert b.batch_get_into(fresh, dst, [0, 1, 2, 3]) == [True] * 4
    finally:
        b.close()
        if holder is not None and holder.poll() is None:
            holder.kill()
        master.stop()


def _faulty(master, schedule):
    return FaultyBackend(open_backend(master.url, namespace=KeyNamespace("default")), schedule)


@pytest.fixture
def cache(caplog):
    caplog.set_level(logging.INFO, logger="hicache_fsm")
    c = make_cache()
    yield c
    c.close()


def test_master_killed_mid_prefetch_then_restarted(cache, mooncake_master, caplog):
    def schedule(method, index, keys):
        if method == "batch_get_into" and index == 2:
            mooncake_master.kill()

    cache.attach_storage(_faulty(mooncake_master, schedule), **OPTS)
    t = prompt(48, seed=7)
    seed(cache, t)
    assert prefetch_and_proceed(cache, t) == 2 * PAGE  # the pages before the outage, bit-exact
    assert not cache.storage.healthy and cache.stats()["storage"]["storage_outages"] >= 1
    assert logged(caplog, "not answering")
    other = prompt(32, seed=8)
    put(cache, other)
    mooncake_master.restart()  # every key is lost with it
    wait_until(cache, lambda: is_stored(cache, other), timeout=30, what="backup after restart")
    assert cache.stats()["storage"]["storage_recoveries"] >= 1
    cache.check_invariants()


def test_master_killed_mid_backup_then_restarted(cache, mooncake_master, caplog):
    def schedule(method, index, keys):
        if method == "batch_set_from" and index == 2:
            mooncake_master.kill()

    cache.attach_storage(_faulty(mooncake_master, schedule), **{**OPTS, "batch_pages": 2})
    t = prompt(48, seed=9)
    put(cache, t)
    wait_until(cache, lambda: cache.stats()["storage"]["backup_failures"] >= 1, timeout=30, what="failed backup")
    mooncake_master.restart()
    wait_until(cache, lambda: is_stored(cache, t), timeout=30, what="backup after restart")
    evict_all(cache, t)
    assert prefetch_and_proceed(cache, t) == 48  # every page reached the restarted master
    cache.check_invariants()


def test_bench_storage_compares_with_raw_mooncake_calls(mooncake_master, capsys):
    url = mooncake_master.url
    assert main(["bench", "storage", "--url", url, "--pages", "4", "--page-tokens", "4", "--layers", "2",
                 "--repeats", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["scheme"] == "mooncake" and result["raw_set_gbps"] > 0 and result["raw_get_gbps"] > 0
    assert result["set_ratio"] > 0 and result["get_ratio"] > 0
