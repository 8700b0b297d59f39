"""The Prometheus collector: scraped over real HTTP on 127.0.0.1, the values equal ``stats()``."""

from __future__ import annotations

import threading
import urllib.request
from collections import Counter

import pytest

prometheus_client = pytest.importorskip("prometheus_client", reason="the metrics extra (prometheus_client) is not installed")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from prometheus_client import CollectorRegistry, generate_latest, start_http_server  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from hicache_fsm.errors import ConfigError  # noqa: E402
from hicache_fsm.metrics import OWN_LABELS, HiCacheCollector  # noqa: E402
from hicache_fsm.simulate import FULL, Options, Workload, run_simulation  # noqa: E402
from hicache_fsm.spec import load_builtin  # noqa: E402

WORKLOAD = Workload(clients=3, rounds=3, request_length=16, output_length=4, system_prompt_length=16)


@pytest.fixture(scope="module")
def ran_cache():
    """The device+host+storage cache of a small simulate run (storage attached, prefetches, evictions).

    Settled storage: every backup lands before the next request, so the storage hits the
    test asserts do not depend on how fast the storage threads ran.
    """
    caches = {}
    sim = run_simulation(Options(WORKLOAD, device_tokens=80, host_tokens=128, page_size=8, device="cpu",
                                 storage_url="memory://"),
                         observe=lambda name, cache: caches.__setitem__(name, cache), settle_storage=True)
    assert sim.kv_mismatches == 0
    return caches[FULL]


def scrape(collector: HiCacheCollector) -> dict[tuple[str, tuple], float]:
    """Serve ``collector`` on 127.0.0.1 (a free port), fetch /metrics over HTTP, stop the server."""
    registry = CollectorRegistry()
    registry.register(collector)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        port = server.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            assert response.status == 200
            text = response.read().decode("utf-8")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in samples, f"sample {key} exported twice"
            samples[key] = s.value
    return samples


def test_scraped_metrics_equal_stats(ran_cache):
    cache = ran_cache
    samples = scrape(HiCacheCollector(cache))
    stats = cache.stats()
    storage = stats["storage"]

    def value(name, **labels):
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("hicache_match_requests_total") == stats["match_requests"] > 0
    assert value("hicache_hit_tokens_total", tier="device") == stats["device_hit_tokens"] > 0
    assert value("hicache_hit_tokens_total", tier="host") == stats["host_hit_tokens"] > 0
    assert value("hicache_hit_tokens_total", tier="storage") == storage["prefetch_inserted_tokens"] > 0
    assert value("hicache_miss_tokens_total") == stats["miss_tokens"]
    for kind in ("d2h", "h2d", "h2s", "s2h"):
        assert value("hicache_jobs_total", kind=kind) == stats.get(f"jobs_{kind}", 0)
        assert value("hicache_jobs_failed_total", kind=kind) == stats.get(f"failed_{kind}", 0)
    for kind in ("d2h", "h2d", "h2s"):
        assert value("hicache_transfer_bytes_total", kind=kind) == stats[f"bytes_{kind}"] > 0
    assert value("hicache_transfer_bytes_total", kind="s2h") == storage["backend_stats"]["bytes_read"] > 0
    assert value("hicache_evicted_tokens_total", tier="device") == stats["evicted_device_tokens"] > 0
    assert value("hicache_jobs_in_flight") == stats["pending_jobs"]
    for tier in ("device", "host"):
        for use in ("used", "free"):
            assert value("hicache_pool_tokens", tier=tier, use=use) == stats[f"{tier}_{use}_tokens"]
    states = Counter(n.state for n in cache.tree.nodes() if n.state != "root")
    for state in load_builtin("residency").state_names:
        assert value("hicache_nodes", state=state) == states.get(state, 0)
    assert sum(value("hicache_nodes", state=s) for s in states) == stats["nodes"] > 0
    for outcome, key in (("completed", "prefetch_completed"), ("revoked", "prefetch_revoked")):
        assert value("hicache_prefetches_total", outcome=outcome) == storage.get(key, 0)
    assert value("hicache_prefetches_admitted_total") == storage["prefetch_admitted"] > 0
    assert value("hicache_prefetch_tokens_total", stage="fetched") == storage["prefetch_fetched_tokens"] > 0
    for key, count in storage.items():
        if key.startswith("prefetch_rejected_"):
            assert value("hicache_prefetches_rejected_total", reason=key.removeprefix("prefetch_rejected_")) == count
    assert value("hicache_storage_backups_total", outcome="stored") == storage["backups_stored"] > 0
    assert value("hicache_storage_healthy") == (1 if storage["healthy"] else 0)
    assert value("hicache_storage_link_state", state=storage["link"]) == 1
    assert sum(v for (n, _), v in samples.items() if n == "hicache_storage_link_state") == 1
    # counters without a name of their own are still exported
    for key, count in stats.items():
        if key in ("backup_host_full", "inserted_tokens", "loaded_back_tokens"):
            assert any(n == f"hicache_{key}_total" and v == count for (n, _), v in samples.items())


def test_labels_and_prefix_are_applied(ran_cache):
    samples = scrape(HiCacheCollector(ran_cache, labels={"model": "tiny"}, prefix="engine_cache"))
    assert samples
    assert all(name.startswith("engine_cache_") for name, _ in samples)
    assert all(dict(labels).get("model") == "tiny" for _, labels in samples)


def test_a_cache_without_storage_has_no_storage_families():
    from cache_helpers import make_cache, put

    cache, ex = make_cache(manual=False)
    put(cache, range(16))
    cache.poll()
    samples = scrape(HiCacheCollector(cache))
    assert not any(name.startswith("hicache_storage") for name, _ in samples)
    assert samples[("hicache_hit_tokens_total", (("tier", "storage"),))] == 0
    assert samples[("hicache_inserted_tokens_total", ())] == cache.stats()["inserted_tokens"] == 16
    cache.close()


def test_scraping_while_the_engine_runs_does_not_fail():
    """The HTTP thread reads while this thread inserts and evicts."""
    from cache_helpers import make_cache, put

    cache, ex = make_cache(manual=False, device_pages=8, host_pages=8)
    collector = HiCacheCollector(cache)
    stop = threading.Event()
    errors = []

    def engine():
        i = 0
        while not stop.is_set():
            put(cache, range(i * 8, i * 8 + 8))
            cache.poll()
            i += 1

    t = threading.Thread(target=engine)
    t.start()
    try:
        for _ in range(50):
            try:
                list(collector.collect())
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
    finally:
        stop.set()
        t.join()
        cache.close()
    assert not errors


@pytest.mark.parametrize("arguments, named", [
    ({"labels": {"model": 7}}, "'model' must have a str value"),  # every scrape failed in the text format
    ({"labels": {"model name": "tiny"}}, "label name"),  # exposed, then refused by Prometheus
    ({"labels": {"__name__": "x"}}, "label name"),
    ({"labels": {"tier": "gpu"}}, "sets itself"),  # a sample with two tier labels
    ({"labels": [("model", "tiny")]}, "mapping"),
    ({"prefix": "engine cache"}, "prefix"),
    ({"prefix": ""}, "prefix"),
    ({"prefix": 3}, "prefix"),
    ({"lock": "mutex"}, "lock"),
])
def test_names_and_values_a_scrape_could_not_expose_are_refused_when_the_collector_is_made(arguments, named):
    from cache_helpers import make_cache

    cache, _ = make_cache()
    with pytest.raises(ConfigError, match=named):
        HiCacheCollector(cache, **arguments)
    with pytest.raises(ConfigError, match="reads a HiCache"):
        HiCacheCollector(cache.stats())
    cache.close()


LABEL_NAMES = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,8}", fullmatch=True).filter(
    lambda name: not name.startswith("__") and name not in OWN_LABELS)


@settings(max_examples=25, deadline=None)
@given(labels=st.dictionaries(LABEL_NAMES, st.text(max_size=6), max_size=3),
       prefix=st.from_regex(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,8}", fullmatch=True))
def test_every_accepted_name_and_value_reads_back_from_the_text_format(labels, prefix):
    """Whatever the collector accepts, Prometheus's parser reads back: quotes, newlines and all."""
    from cache_helpers import make_cache, put

    cache, _ = make_cache()
    put(cache, range(8))
    registry = CollectorRegistry()
    registry.register(HiCacheCollector(cache, labels=labels, prefix=prefix))
    families = list(text_string_to_metric_families(generate_latest(registry).decode("utf-8")))
    cache.close()
    samples = [sample for family in families for sample in family.samples]
    assert samples and all(sample.name.startswith(prefix + "_") for sample in samples)
    assert all(sample.labels.items() >= labels.items() for sample in samples)
