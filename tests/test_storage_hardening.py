"""The storage tier under hostile use: foreign threads, bad close arguments, lost keys, short prefetches."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from cache_helpers import in_thread
from storage_util import make_cache, prompt, put, settle, storage_threads
from test_storage_tier import FAST

from hicache_fsm.errors import ConfigError, WrongThread
from hicache_fsm.storage.memory import MemoryBackend


# ====================================================================== thread confinement


def test_every_mutating_storage_call_is_refused_from_another_thread_and_changes_nothing():
    cache = make_cache()
    cache.attach_storage(MemoryBackend(), **FAST)
    tier = cache.storage
    tokens = prompt(16, seed=1)
    put(cache, tokens)  # a backup now queued / running on the storage threads
    m = cache.match_prefix(prompt(32, seed=2))
    counters = dict(tier.counters)
    calls = {
        "poll": tier.poll,
        "reset": tier.reset,
        "attach": lambda: tier.attach(MemoryBackend()),
        "detach": tier.detach,
        "prefetch": lambda: tier.prefetch("r", prompt(32, seed=2), m),
        "prefetch_ready": lambda: tier.prefetch_ready("r"),
        "abort_prefetch": lambda: tier.abort_prefetch("r"),
        "drain": lambda: tier.drain(0.0),
        "close": tier.close,
        "run_queued": lambda: tier.run_queued("h2s", 0),
        "probe_now": tier.probe_now,
        "wind_down": lambda: tier.wind_down("intruder"),
        "storage_lost": lambda: tier.storage_lost(list(cache.tree.nodes())),
    }
    for name, call in calls.items():
        out = in_thread(call)
        assert isinstance(out.get("error"), WrongThread), (name, out)
        assert tier.link.state == "attached" and not tier.closed, name
    assert dict(tier.counters) == counters
    settle(cache)  # the owner still gets every completion: the backup lands
    assert tier.stats()["backups_stored"] == 1
    cache.detach_storage()
    cache.close()
    assert not storage_threads()


def test_storage_threads_keep_working_when_the_cache_moves_to_another_thread():
    cache = make_cache()
    cache.attach_storage(MemoryBackend(), **FAST)
    cache.release_thread()

    def serve():
        put(cache, prompt(16, seed=3))
        settle(cache)
        st = cache.storage.stats()
        cache.close()
        return st

    out = in_thread(serve)
    assert out["value"]["backups_stored"] == 1
    assert not storage_threads()


# ====================================================================== close(drain=...)


@pytest.mark.parametrize("drain", ["5", None, [1], -1.0, float("nan"), float("inf"), True])
def test_close_with_a_bad_drain_is_refused_before_anything_changes(drain):
    cache = make_cache()
    cache.attach_storage(MemoryBackend(), **FAST)
    with pytest.raises(ConfigError):
        cache.close(drain=drain)
    with pytest.raises(ConfigError):
        cache.storage.close(drain=drain)
    assert not cache.closed and not cache.storage.closed
    assert cache.storage.link.state == "attached" and len(storage_threads()) == 2
    put(cache, prompt(16, seed=4))
    settle(cache)  # still serving
    cache.close()
    assert cache.closed and cache.storage.closed and cache.storage.backend is None
    assert not storage_threads()


def test_close_stops_threads_and_closes_the_backend_even_when_a_step_fails(monkeypatch):
    cache = make_cache()
    backend = MemoryBackend()
    cache.attach_storage(backend, **FAST)
    tier = cache.storage

    def broken(*a, **k):
        raise TypeError("boom")

    monkeypatch.setattr(tier, "_fail_queued", broken)
    cache.close()
    assert tier.closed and tier.backend is None and cache.closed
    assert not storage_threads()


# ====================================================================== hits are pages inserted


def test_a_prefetch_one_page_short_reports_the_pages_it_inserted_as_hits():
    from storage_util import ready
    from test_storage_tier import seed

    from hicache_fsm.storage.faults import Fault, FaultyBackend

    cache = make_cache()
    backend = FaultyBackend(MemoryBackend(), [Fault("partial", method="batch_get_into", keep=7)])
    cache.attach_storage(backend, **FAST, stop_policy="wait_complete")
    t = prompt(32, seed=5)
    seed(cache, t)
    assert cache.prefetch("r", t, cache.match_prefix(t))
    ready(cache, "r")
    st = cache.stats()["storage"]
    assert st["prefetch_found_tokens"] == 32  # the query found every page
    assert st["prefetch_inserted_tokens"] == 28  # one page never arrived
    assert st["prefetch_hit_tokens"] == 28  # hits are what the tree got, not what was asked for
    m = cache.match_prefix(t)
    assert m.host_hit_length == st["prefetch_hit_tokens"]
    cache.check_invariants()
    cache.close()


# ====================================================================== a reader of another page format


@pytest.mark.parametrize("url", ["file", "memory"])
def test_pages_stored_in_another_format_are_not_hits_and_not_readmitted_until_the_next_attach(tmp_path, caplog, url):
    from storage_util import ready

    opts = {**FAST, "stop_policy": "wait_complete"}
    shared = f"file://{tmp_path}/shared" if url == "file" else f"memory://format-{tmp_path.name}"
    t = prompt(128, seed=21)
    writer = make_cache(layout="page_first")
    reader = make_cache(layout="layer_first")
    try:
        writer.attach_storage(shared, **opts)
        put(writer, t)
        settle(writer)
        assert writer.stats()["storage"]["backup_tokens_stored"] == 128
        reader.attach_storage(shared, **opts)
        assert reader.prefetch("r", t, reader.match_prefix(t))
        ready(reader, "r")
        st = reader.stats()["storage"]
        assert st["prefetch_inserted_tokens"] == 0 and st["prefetch_hit_tokens"] == 0
        assert st["backend_stats"]["format_mismatch"] >= 1
        assert "stats()['storage']['backend_stats']['format_mismatch']" in caplog.text
        for i in range(3):  # every retry is refused before it reserves or queries anything
            assert not reader.prefetch(f"again{i}", t, reader.match_prefix(t))
        st2 = reader.stats()["storage"]
        assert st2["prefetch_rejected_format_mismatch"] == 3 and st2["prefetch_admitted"] == 1
        assert st2["prefetch_found_tokens"] == st["prefetch_found_tokens"] and st2["prefetch_hit_tokens"] == 0
        reader.detach_storage()
        reader.attach_storage(shared, **opts)  # the stored format may have changed: asked again
        assert reader.prefetch("later", t, reader.match_prefix(t))
        ready(reader, "later")
        reader.check_invariants()
    finally:
        writer.close()
        reader.close()


# ====================================================================== pages a backend lost are stored again


def _all_stored(cache, tokens) -> bool:
    from storage_util import path_nodes

    return all(n.state.endswith("stored") for n in path_nodes(cache, tokens)[0])


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_nodes_whose_pages_the_backend_lost_are_stored_again(tmp_path, kind):
    import shutil

    from storage_util import evict_all, wait_until

    from hicache_fsm.storage import open_backend

    cache = make_cache()
    url = f"memory://lost-{tmp_path.name}" if kind == "memory" else f"file://{tmp_path}/store"
    cache.attach_storage(url, **FAST, stop_policy="wait_complete")
    t = prompt(32, seed=7)
    put(cache, t)
    wait_until(cache, lambda: _all_stored(cache, t), what="first backup")
    stored_before = cache.stats()["storage"]["backup_tokens_stored"]
    if kind == "memory":  # the backend restarts empty (another handle on the same store flushes it)
        other = open_backend(url)
        other.clear()
        other.close()
    else:  # the directory is wiped (a restart on fresh disk)
        shutil.rmtree(tmp_path / "store")
    wait_until(cache, lambda: cache.stats()["storage"]["storage_lost_nodes"] >= 1, what="the loss noticed")
    wait_until(cache, lambda: _all_stored(cache, t)
               and cache.stats()["storage"]["backup_tokens_stored"] >= stored_before + 32, what="stored again")
    st = cache.stats()["storage"]
    assert st["data_epoch_changes"] == 1
    evict_all(cache, t)  # only storage holds the pages now: a prefetch brings them back
    assert len(cache.tree) == 0
    assert cache.prefetch("r", t, cache.match_prefix(t))
    from storage_util import ready

    ready(cache, "r")
    assert cache.stats()["storage"]["prefetch_inserted_tokens"] == 32
    cache.check_invariants()
    cache.close()


def test_a_deleted_page_file_is_found_missing_and_its_node_stored_again(tmp_path):
    import os

    from storage_util import wait_until

    cache = make_cache()
    cache.attach_storage(f"file://{tmp_path}/store", **FAST)
    a, b = prompt(16, seed=8), prompt(16, seed=9)
    for t in (a, b):
        put(cache, t)
    wait_until(cache, lambda: _all_stored(cache, a) and _all_stored(cache, b), what="backups")
    assert cache.storage.verify_stored() == 0  # every page still there
    key = cache.storage.keys_for(cache.tree.walk(a)[0][-1])[-1]
    os.unlink(cache.storage.backend.path_for(key))
    assert cache.storage.verify_stored() == 1  # only a's node lost a page
    assert not _all_stored(cache, a) and _all_stored(cache, b)
    wait_until(cache, lambda: _all_stored(cache, a), what="stored again")
    assert cache.storage.backend.exists(key)
    assert cache.storage.verify_stored() == 0
    out = in_thread(cache.storage.verify_stored)
    assert isinstance(out.get("error"), WrongThread)
    cache.check_invariants()
    cache.close()


@given(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=4),
                 st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=2), st.integers(), max_size=1)))
def test_drain_is_accepted_exactly_when_it_is_a_finite_number_of_seconds_at_least_zero(value):
    import math

    from hicache_fsm.storage.tier import drain_seconds

    from hicache_fsm.config import MAX_SECONDS

    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and 0 <= value <= MAX_SECONDS)
    if ok:
        assert drain_seconds(value) == float(value)
    else:
        with pytest.raises(ConfigError):
            drain_seconds(value)
