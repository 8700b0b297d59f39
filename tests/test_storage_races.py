"""Races between the scheduler, the storage threads and other readers, each forced into its bad order.

Every test makes the interleaving happen (a backend call held until the
scheduler did something) rather than hoping for it; the waits are hang guards.
"""

from __future__ import annotations

import threading

from storage_util import WAIT, make_cache, prompt, put, settle, wait_until

from hicache_fsm.errors import StorageUnavailable, WrongThread
from hicache_fsm.storage.memory import MemoryBackend
from hicache_fsm.storage.threads import PROBE_KEY

FAST = dict(probe_interval=0.02, retry_interval=0.02)


class SwitchableBackend(MemoryBackend):
    """Down while ``down`` is set; a health probe waits for ``release`` while ``hold_probe`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.down = threading.Event()
        self.hold_probe = threading.Event()
        self.probe_entered = threading.Event()
        self.release = threading.Event()

    def batch_exists(self, keys):
        if list(keys) == [PROBE_KEY]:
            if self.down.is_set():
                raise StorageUnavailable("injected: down")
            if self.hold_probe.is_set():
                self.probe_entered.set()
                assert self.release.wait(WAIT)
        return super().batch_exists(keys)

    def batch_set_from(self, keys, host_pool, page_ids):
        if self.down.is_set():
            raise StorageUnavailable("injected: down")
        return super().batch_set_from(keys, host_pool, page_ids)


def test_a_health_verdict_given_across_a_reset_is_not_lost():
    # The probe that found the backend back answered after reset() had dropped the events of before it:
    # the verdict was dropped as stale, the threads saw no reason to probe again, and the tier stayed
    # unhealthy for good (no prefetch admitted, no backup started).
    cache = make_cache(host_pages=128)
    backend = SwitchableBackend()
    cache.attach_storage(backend, **FAST)
    tier = cache.storage
    backend.down.set()
    put(cache, prompt(32, seed=1))  # its backup fails: the link is down
    wait_until(cache, lambda: not tier.healthy, what="the tier to see the outage")
    backend.hold_probe.set()
    backend.down.clear()  # back: the next probe says so, once released
    assert backend.probe_entered.wait(WAIT)
    cache.reset()
    backend.hold_probe.clear()
    backend.release.set()
    wait_until(cache, lambda: tier.healthy, what="the tier to hear the backend answers again")
    cache.close()


class SlowStatsBackend(MemoryBackend):
    """``stats()`` at close waits until the test lets it go."""

    def __init__(self) -> None:
        super().__init__()
        self.closing = threading.Event()
        self.in_stats = threading.Event()
        self.release = threading.Event()

    def stats(self):
        if self.closing.is_set():
            self.in_stats.set()
            assert self.release.wait(WAIT)
        return super().stats()


def test_backend_totals_never_go_down_while_a_backend_detaches():
    # A scrape between the backend's leaving and its counts joining the closed totals saw them drop:
    # Prometheus reads a drop as a counter reset (a spike of the whole lifetime in rate()).
    cache = make_cache(host_pages=128)
    backend = SlowStatsBackend()
    cache.attach_storage(backend, **FAST)
    link = cache.storage.link
    put(cache, prompt(32, seed=2))
    settle(cache)
    before = link.totals()
    assert any(before.values())
    seen: list[dict] = []

    def scrape_while_closing() -> None:  # a metrics scrape on its own thread
        assert backend.in_stats.wait(WAIT)
        scrape = threading.Thread(target=lambda: seen.append(link.totals()))
        scrape.start()
        scrape.join(0.5)  # where the scrape could read between the two steps, it has read by now
        backend.release.set()
        scrape.join(WAIT)

    scraper = threading.Thread(target=scrape_while_closing)
    scraper.start()
    backend.closing.set()
    cache.detach_storage()
    scraper.join(WAIT)
    assert all(seen[0].get(key, 0) >= value for key, value in before.items()), (before, seen[0])
    cache.close()


def test_a_thread_that_inherits_a_dead_owners_ident_is_not_taken_for_the_owner():
    # Thread idents are reused: a thread with the dead owner's ident passed the check without adopting
    # the cache, and a third thread then adopted it while the second still drove it.
    cache = make_cache()

    def own() -> None:
        cache.match_prefix([1, 2, 3, 4])

    for _ in range(20):
        first = threading.Thread(target=own)
        first.start()
        first.join()
        second_in, second_go = threading.Event(), threading.Event()
        refused: list[BaseException] = []

        def second() -> None:
            own()
            second_in.set()
            assert second_go.wait(WAIT)

        def third() -> None:
            try:
                own()
            except WrongThread as exc:
                refused.append(exc)

        t2 = threading.Thread(target=second)
        t2.start()
        assert second_in.wait(WAIT)
        t3 = threading.Thread(target=third)
        t3.start()
        t3.join(WAIT)
        second_go.set()
        t2.join(WAIT)
        assert len(refused) == 1, "a third thread drove the cache while the second still did"
    cache.close()
