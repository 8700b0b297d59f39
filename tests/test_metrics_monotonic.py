"""Storage backend counters scraped as Prometheus counters never decrease across detach + attach.

Every backend counts from 0, so the collector keeps running totals over every
backend the cache attached (``BackendTotals``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client", reason="the metrics extra (prometheus_client) is not installed")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from storage_util import prompt, put, settle  # noqa: E402
from storage_util import make_cache as storage_cache  # noqa: E402

from hicache_fsm.metrics import BackendTotals, HiCacheCollector  # noqa: E402


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
        assert last[written] == 2 * first[written]
    finally:
        cache.close()


class FakeBackend:
    def __init__(self) -> None:
        self.counts = {"bytes_read": 0, "gets": 0}

    def stats(self) -> dict:
        return dict(self.counts)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["grow", "scrape", "detach", "attach"]), st.integers(0, 5)), max_size=30))
def test_totals_never_decrease_and_count_every_backend_a_scrape_saw(steps):
    """Monotone; at most everything counted; at least the final counters of every backend a scrape saw."""
    totals, shown_before = BackendTotals(), {}
    backends, attached, scraped = [FakeBackend()], True, set()
    for action, n in steps:
        if action == "grow" and attached:
            backends[-1].counts["bytes_read"] += n
            backends[-1].counts["gets"] += 1
        elif action == "detach":
            attached = False  # stats() now shows the closed backend's final counters
        elif action == "attach" and not attached:
            backends.append(FakeBackend())
            attached = True
        elif action == "scrape":
            shown = totals.totals(backends[-1] if attached else None, backends[-1].stats())
            assert all(value >= shown_before.get(key, 0) for key, value in shown.items())
            shown_before = shown
            scraped.add(id(backends[-1]))
            everything = sum(b.counts["bytes_read"] for b in backends)
            seen = sum(b.counts["bytes_read"] for b in backends[:-1] if id(b) in scraped)
            assert seen + backends[-1].counts["bytes_read"] <= shown["bytes_read"] <= everything
