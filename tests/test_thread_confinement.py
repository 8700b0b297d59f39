"""A cache belongs to the thread that drives it: other threads get ``WrongThread`` and change nothing."""

from __future__ import annotations

import threading

import pytest
import torch

from cache_helpers import expected_kv, in_thread, make_cache, pages, put
from hicache_fsm.errors import HiCacheError, WrongThread


def test_another_thread_is_refused_and_changes_nothing():
    cache, ex = make_cache(manual=False)
    node = put(cache, pages(2)).node
    cache.poll()
    before = cache.snapshot()
    idx = cache.alloc_device(4)
    before = cache.snapshot()
    calls = [
        lambda: cache.match_prefix(pages(2)),
        lambda: cache.insert(pages(1, start=100), idx),
        lambda: cache.lock(node),
        lambda: cache.alloc_device(4),
        lambda: cache.poll(),
        lambda: cache.flush(),
        lambda: cache.evict(4),
        lambda: cache.reset(),
        lambda: cache.close(),
    ]
    for call in calls:
        out = in_thread(call)
        assert isinstance(out.get("error"), WrongThread), out
        assert "MainThread" in str(out["error"])
        assert cache.snapshot() == before
    assert isinstance(WrongThread("x"), HiCacheError)
    cache.free_device(idx)
    cache.check_invariants()
    cache.close()


def test_release_thread_hands_the_cache_over_and_a_dead_owner_owns_nothing():
    cache, ex = make_cache()
    put(cache, pages(1))
    cache.release_thread()
    assert "value" in in_thread(lambda: put(cache, pages(1, start=50)))  # adopted by that thread, which ended
    put(cache, pages(1, start=80))  # the owner ended: this thread adopts the cache again
    cache.check_invariants()


def test_racing_threads_get_typed_errors_and_never_corrupt_the_cache():
    """Several threads hammer one cache: one drives it, the rest are refused; state and KV stay intact."""
    cache, ex = make_cache(manual=False, device_pages=24, host_pages=48)
    start = threading.Barrier(4)
    end = threading.Barrier(4)  # no worker ends (letting another adopt the cache) while the others still call
    refused: list[int] = []
    untyped: list[BaseException] = []
    inserted: dict[int, list[tuple[int, ...]]] = {}

    def worker(w: int) -> None:
        start.wait()
        done = []
        for i in range(40):
            tokens = tuple(1000 * (w + 1) + 8 * i + t for t in range(8))
            try:
                res = put(cache, tokens)
                m = cache.match_prefix(tokens)
                cache.lock(m.last_device_node)
                cache.unlock(m.last_device_node)
                cache.poll()
                if res is not None:
                    done.append(tokens)
            except WrongThread:
                refused.append(w)
            except BaseException as exc:  # noqa: BLE001 - any other error is a failure of the test
                untyped.append(exc)
        inserted[w] = done
        end.wait()

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not untyped, untyped
    owners = [w for w, done in inserted.items() if done]
    assert len(owners) == 1 and len(refused) == 3 * 40  # one thread drove the cache, every other call was refused
    # the owner ended: this thread adopts the cache and checks what the owner did
    cache.flush()
    cache.executor.synchronize()
    cache.poll()
    cache.check_invariants()
    assert cache.snapshot() == cache.snapshot()
    checked = 0
    for tokens in inserted[owners[0]]:
        m = cache.match_prefix(tokens)
        if m.device_hit_length == len(tokens):
            k, v = cache.device_pool.read(m.device_indices)
            want_k, want_v = expected_kv(tokens)
            assert torch.equal(k, want_k) and torch.equal(v, want_v)
            checked += 1
    assert checked > 0
    cache.close()


@pytest.mark.parametrize("method", ["stats", "snapshot", "invariant_violations"])
def test_read_only_views_may_be_read_from_another_thread(method):
    """Metrics scrapes read ``stats()`` from the HTTP server's thread."""
    cache, ex = make_cache()
    put(cache, pages(1))
    assert "value" in in_thread(getattr(cache, method))
