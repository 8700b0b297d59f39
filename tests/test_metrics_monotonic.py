"""Storage backend counters scraped as Prometheus counters never decrease across detach + attach.

Every backend counts from 0, so the storage tier keeps running totals over every
backend the cache attached (``stats()["storage"]["backend_totals"]``), and the
collector exports those.
"""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client", reason="the metrics extra (prometheus_client) is not installed")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from storage_util import prompt, put, settle  # noqa: E402
from storage_util import make_cache as storage_cache  # noqa: E402

from hicache_fsm.metrics import HiCacheCollector  # noqa: E402


def samples(collector: HiCacheCollector) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in collector.collect() for s in family.samples}


def backend_counters(scraped: dict) -> dict:
    return {key: value for key, value in scraped.items()
            if key[0].startswith("hicache_storage_backend") or key[0] == "hicache_transfer_bytes_total"}


def test_backend_counters_survive_detach_and_attach():
    cache = storage_cache()
    collector = HiCacheCollector(cache)
    try:
        cache.attach_storage("memory://")
        put(cache, prompt(16, seed=1))
        settle(cache)
        first = backend_counters(samples(collector))
        assert first[("hicache_storage_backend_bytes_total", (("direction", "written"),))] > 0
        cache.detach_storage()
        cache.attach_storage("memory://")
        samples(collector)  # the collector sees the second backend once ...
        put(cache, prompt(16, seed=2))
        settle(cache)
        cache.detach_storage()  # ... and counts what it did after that scrape too: its final counters
        cache.attach_storage("memory://")
        last = backend_counters(samples(collector))
        for key, value in first.items():
            assert last[key] >= value, f"{key} went from {value} down to {last[key]}"
        written = ("hicache_storage_backend_bytes_total", (("direction", "written"),))
        # the second private store never had the first prompt's pages: they are stored there again, beside the second
        assert last[written] == 3 * first[written]
    finally:
        cache.close()


WRITTEN = ("hicache_storage_backend_bytes_total", (("direction", "written"),))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(["grow", "scrape", "detach", "attach"]), max_size=14))
def test_totals_never_decrease_and_count_every_backend(steps):
    """Monotone, and exactly the bytes every backend wrote, also one attached and detached between two scrapes."""
    cache = storage_cache()
    collector = HiCacheCollector(cache)
    backends, shown_before, seed = [], {}, 0
    try:
        cache.attach_storage("memory://")
        backends.append(cache.storage.backend)
        for action in steps + ["scrape"]:
            attached = cache.storage.link.state == "attached"
            if action == "grow" and attached:
                seed += 1
                put(cache, prompt(16, seed=seed))
                settle(cache)
            elif action == "detach" and attached:
                cache.detach_storage()
            elif action == "attach" and not attached:
                cache.attach_storage("memory://")
                backends.append(cache.storage.backend)
            elif action == "scrape":
                shown = backend_counters(samples(collector))
                for key, value in shown_before.items():
                    assert shown[key] >= value, f"{key} went from {value} down to {shown[key]}"
                shown_before = shown
                assert shown[WRITTEN] == sum(b.stats()["bytes_written"] for b in backends)
    finally:
        cache.close()
