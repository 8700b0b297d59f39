"""Prometheus metrics of a ``HiCache``, read when scraped (optional: ``pip install 'hicache_fsm[metrics]'``).

Why a collector and not instrumented counters: the cache already counts what it
does in ``stats()``; ``HiCacheCollector`` turns that dict into metric families
only when Prometheus scrapes, so a request pays nothing for metrics. A scrape
costs one ``stats()`` call and a copy of the residency driver's per-state node
counts (kept as nodes change state, so no pass over the tree); ``bench
controller`` reports it against the controller's time per request.

Names follow Prometheus conventions: a ``hicache_`` prefix, counters end in
``_total``, units in the name (``_tokens``, ``_bytes``), what varies in labels
(``tier``, ``kind``, ``state``, ``outcome``). Every counter of ``stats()`` is
exported: the ones below under their own names, any other as
``hicache_<name>_total`` (``hicache_storage_<name>_total`` for the storage tier's).
Storage families appear once a storage tier exists (``attach_storage``).

Usage::

    from prometheus_client import REGISTRY, start_http_server
    from hicache_fsm.metrics import HiCacheCollector

    REGISTRY.register(HiCacheCollector(cache))
    start_http_server(9400)

A scrape runs on the HTTP server's thread while the engine changes the cache:
the collector reads again when the tree changed under it, or holds ``lock``
(a lock the engine holds around its cache calls) when one is given.
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

try:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "hicache_fsm.metrics needs prometheus_client: pip install 'hicache_fsm[metrics]'") from exc

from hicache_fsm.cache import HiCache
from hicache_fsm.errors import ConfigError
from hicache_fsm.jobs import JobKind
from hicache_fsm.spec import load_builtin

__all__ = ["HiCacheCollector"]

Path = tuple[str, ...]  # a key in stats(): ("device_hit_tokens",) or ("storage", "backend_stats", "bytes_read")
S = "storage"
BACKEND = (S, "backend_stats")
KINDS = tuple(k.value for k in JobKind)

# name (without _total), help, label, {label value: path in stats()}; a label of None means one unlabelled sample.
COUNTERS: tuple[tuple[str, str, str | None, dict[str | None, Path]], ...] = (
    ("match_requests", "Prefix lookups (match_prefix calls).", None, {None: ("match_requests",)}),
    ("hit_tokens", "Prompt tokens the cache held, by the tier that held them (storage: prefetched and inserted).",
     "tier", {"device": ("device_hit_tokens",), "host": ("host_hit_tokens",),
              "storage": (S, "prefetch_inserted_tokens")}),
    ("miss_tokens", "Prompt tokens (whole pages) no tier held.", None, {None: ("miss_tokens",)}),
    ("inserted_tokens", "Tokens of new KV inserted by the engine.", None, {None: ("inserted_tokens",)}),
    ("loaded_back_tokens", "Tokens loaded back from host to device.", None, {None: ("loaded_back_tokens",)}),
    ("evicted_tokens", "Tokens evicted, by the tier they left.", "tier",
     {"device": ("evicted_device_tokens",), "host": ("evicted_host_tokens",)}),
    ("jobs", "Transfer jobs emitted, by kind.", "kind", {k: (f"jobs_{k}",) for k in KINDS}),
    ("jobs_failed", "Transfer jobs that failed, by kind.", "kind", {k: (f"failed_{k}",) for k in KINDS}),
    ("transfer_bytes", "Bytes moved by acknowledged jobs, by kind (s2h: bytes the storage backend read).", "kind",
     {**{k: (f"bytes_{k}",) for k in KINDS if k != "s2h"}, "s2h": (*BACKEND, "bytes_read")}),
)
STORAGE_COUNTERS: tuple[tuple[str, str, str | None, dict[str | None, Path]], ...] = (
    ("prefetches", "Prefetches that ended, by outcome.", "outcome",
     {o: (S, f"prefetch_{o}") for o in ("completed", "partial", "empty", "revoked", "aborted")}
     | {"query_failed": (S, "prefetch_query_failures")}),
    ("prefetches_admitted", "Prefetches admitted (host slots reserved).", None, {None: (S, "prefetch_admitted")}),
    ("prefetch_tokens", "Prefetch tokens by stage: asked for, found in storage, trimmed, fetched, inserted, "
     "hit (inserted: served to requests), duplicates dropped, slots released.", "stage",
     {st: (S, f"prefetch_{st}_tokens")
      for st in ("requested", "found", "hit", "trimmed", "fetched", "inserted", "duplicate", "released")}),
    ("storage_backups", "Host-to-storage backups, by outcome.", "outcome",
     {"stored": (S, "backups_stored"), "failed": (S, "backup_failures"), "skipped_mla": (S, "backups_skipped_mla")}),
    ("storage_backups_submitted", "Host-to-storage backups submitted.", None, {None: (S, "backups_submitted")}),
    ("storage_backup_tokens", "Tokens backed up to storage.", None, {None: (S, "backup_tokens_stored")}),
    ("storage_attaches", "Storage attach attempts, by outcome.", "outcome",
     {"ok": (S, "attaches"), "failed": (S, "attach_failures")}),
    ("storage_outages", "Times storage was found down.", None, {None: (S, "storage_outages")}),
    ("storage_recoveries", "Times storage came back after an outage.", None, {None: (S, "storage_recoveries")}),
    ("storage_errors", "Storage calls that raised.", None, {None: (S, "storage_errors")}),
    ("storage_backend_bytes", "Payload bytes the storage backend moved, by direction.", "direction",
     {"read": (*BACKEND, "bytes_read"), "written": (*BACKEND, "bytes_written")}),
)
# stats() keys that are gauges or text, never counters
GAUGE_KEYS = frozenset({"nodes", "device_used_tokens", "device_free_tokens", "host_used_tokens", "host_free_tokens",
                        "pending_jobs"})
STORAGE_GAUGE_KEYS = frozenset({"link", "healthy", "last_error", "backend", "backend_stats", "backend_totals",
                                "prefetch_running", "prefetch_tokens_held", "prefetch_capacity_tokens",
                                "transfers_in_flight"})
_REJECTED = re.compile(r"^prefetch_rejected_(\w+)$")
_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")
_METRIC_PREFIX = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")  # Prometheus's metric name syntax
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")  # and its label name syntax (``__`` first is reserved)
# the labels the collector sets itself: a constant label of the same name would repeat it in a sample
OWN_LABELS = frozenset({label for *_, label, _ in (*COUNTERS, *STORAGE_COUNTERS) if label}
                       | {"reason", "state", "tier", "use"})
READ_ATTEMPTS = 3


def _at(stats: dict, path: Path) -> Any:
    value: Any = stats
    for key in path:
        if not isinstance(value, dict):
            return 0
        value = value.get(key, 0)
    return value


def _is_count(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_names(labels: object, prefix: object) -> None:
    """Refuse, when the collector is made, names and values every scrape would fail on or expose as invalid."""
    if not isinstance(prefix, str) or not _METRIC_PREFIX.fullmatch(prefix):
        raise ConfigError(f"prefix must be a Prometheus metric name ([a-zA-Z_:][a-zA-Z0-9_:]*), got {prefix!r}")
    if labels is None:
        return
    if not isinstance(labels, Mapping):
        raise ConfigError(f"labels must be a mapping of label name to value, got {type(labels).__name__}")
    for name, value in labels.items():
        if not isinstance(name, str) or not _LABEL_NAME.fullmatch(name) or name.startswith("__"):
            raise ConfigError(f"label name {name!r} is not a Prometheus label name "
                              "([a-zA-Z_][a-zA-Z0-9_]*, not starting with __)")
        if name in OWN_LABELS:
            raise ConfigError(f"label {name!r} is one the collector sets itself ({', '.join(sorted(OWN_LABELS))})")
        if not isinstance(value, str):
            raise ConfigError(f"label {name!r} must have a str value, got {value!r}")


class HiCacheCollector:
    """A Prometheus collector over one cache; register it with a ``CollectorRegistry`` (see the module docstring).

    ``labels`` are added to every sample (say ``{"model": "llama"}`` when an
    engine runs several caches); ``prefix`` replaces ``hicache``.
    """

    def __init__(self, cache: HiCache, *, labels: Mapping[str, str] | None = None, prefix: str = "hicache",
                 lock: contextlib.AbstractContextManager | None = None) -> None:
        if not isinstance(cache, HiCache):
            raise ConfigError(f"HiCacheCollector reads a HiCache, got {type(cache).__name__}")
        _check_names(labels, prefix)
        if lock is not None and not (hasattr(lock, "__enter__") and hasattr(lock, "__exit__")):
            raise ConfigError(f"lock must be a context manager (a threading.Lock) or None, got {lock!r}")
        self.cache = cache
        self.prefix = prefix
        self.lock = lock
        self.const = dict(labels or {})
        self.residency_states = tuple(s for s in load_builtin("residency").state_names)
        self.link_states = tuple(load_builtin("storage_link").state_names)

    def describe(self) -> list[Metric]:
        """Nothing up front: the families depend on the cache's state (storage attached or not)."""
        return []

    def read(self) -> tuple[dict, Counter[str]]:
        """``stats()`` and the number of tree nodes per residency state, read together.

        The storage backend's counters come back as the tier's totals over every
        backend attached so far (``backend_totals``), so they never decrease.
        """
        for attempt in range(READ_ATTEMPTS):
            try:
                with self.lock if self.lock is not None else contextlib.nullcontext():
                    stats = self.cache.stats()
                    states = Counter(self.cache.driver.state_counts)
                storage = stats.get(S)
                if isinstance(storage, dict) and isinstance(storage.get("backend_totals"), dict):
                    stats[S] = {**storage, "backend_stats": {**storage.get("backend_stats", {}),
                                                             **storage["backend_totals"]}}
                return stats, states
            except RuntimeError:  # the engine changed a dict while this thread iterated it: read again
                if attempt == READ_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    def collect(self) -> Iterator[Metric]:
        stats, states = self.read()
        yield from self._counters(stats, COUNTERS)
        yield from self._gauges(stats, states)
        storage = stats.get(S)
        if isinstance(storage, dict):
            yield from self._counters(stats, STORAGE_COUNTERS)
            yield from self._rejections(storage)
            yield from self._storage_gauges(storage)
        yield from self._unnamed(stats, storage if isinstance(storage, dict) else {})

    # ------------------------------------------------------------------ families

    def _family(self, kind, name: str, doc: str, label: str | None):
        names = [*self.const, *([label] if label else [])]
        return kind(f"{self.prefix}_{name}", doc, labels=names)

    def _add(self, family, label_value: str | None, value: float) -> None:
        values = [*self.const.values(), *([label_value] if label_value is not None else [])]
        family.add_metric(values, value)

    def _counters(self, stats: dict, table) -> Iterator[Metric]:
        for name, doc, label, paths in table:
            family = self._family(CounterMetricFamily, name, doc, label)
            for value, path in paths.items():
                self._add(family, value, _at(stats, path))
            yield family

    def _rejections(self, storage: dict) -> Iterator[Metric]:
        family = self._family(CounterMetricFamily, "prefetches_rejected",
                              "Prefetches refused at admission, by reason.", "reason")
        for key in sorted(storage):
            m = _REJECTED.fullmatch(key)
            if m:
                self._add(family, m.group(1), storage[key])
        yield family

    def _gauges(self, stats: dict, states: Counter[str]) -> Iterator[Metric]:
        g = self._family(GaugeMetricFamily, "jobs_in_flight", "Transfer jobs emitted and not yet acknowledged.", None)
        self._add(g, None, stats.get("pending_jobs", 0))
        yield g
        g = self._family(GaugeMetricFamily, "nodes", "Radix tree nodes, by residency state.", "state")
        for state in self.residency_states:
            self._add(g, state, states.get(state, 0))
        yield g
        g = GaugeMetricFamily(f"{self.prefix}_pool_tokens", "KV pool token slots, by tier and use.",
                              labels=[*self.const, "tier", "use"])
        for tier in ("device", "host"):
            for use in ("used", "free"):
                g.add_metric([*self.const.values(), tier, use], stats.get(f"{tier}_{use}_tokens", 0))
        yield g

    def _storage_gauges(self, storage: dict) -> Iterator[Metric]:
        g = self._family(GaugeMetricFamily, "storage_healthy",
                         "1 while the storage backend answers, 0 after an error until a probe succeeds.", None)
        self._add(g, None, 1 if storage.get("healthy") else 0)
        yield g
        g = self._family(GaugeMetricFamily, "storage_link_state",
                         "1 for the storage link's current state, 0 for the others.", "state")
        for state in self.link_states:
            self._add(g, state, 1 if storage.get("link") == state else 0)
        yield g
        for name, key, doc in (
            ("prefetches_running", "prefetch_running", "Prefetches admitted and not yet ended."),
            ("prefetch_held_tokens", "prefetch_tokens_held", "Host token slots reserved by running prefetches."),
            ("prefetch_capacity_tokens", "prefetch_capacity_tokens", "Host token slots prefetches may reserve."),
            ("storage_transfers_in_flight", "transfers_in_flight",
             "Storage jobs not yet acknowledged plus prefetches a storage thread may still pick up."),
        ):
            g = self._family(GaugeMetricFamily, name, doc, None)
            self._add(g, None, storage.get(key, 0))
            yield g

    def _unnamed(self, stats: dict, storage: dict) -> Iterator[Metric]:
        """Every other counter, under its own name, so that nothing ``stats()`` counts goes missing."""
        named = {p for _, _, _, paths in (*COUNTERS, *STORAGE_COUNTERS) for p in paths.values()}
        sources = [((key,), f"{key}", value) for key, value in stats.items() if key not in GAUGE_KEYS]
        sources += [((S, key), f"storage_{key}", value) for key, value in storage.items()
                    if key not in STORAGE_GAUGE_KEYS and not _REJECTED.fullmatch(key)]
        sources += [((*BACKEND, key), f"storage_backend_{key}", value)
                    for key, value in (storage.get("backend_stats") or {}).items()]
        for path, name, value in sorted(sources):
            if path in named or not _is_count(value) or not _NAME.fullmatch(name):
                continue
            family = self._family(CounterMetricFamily, name, f"The cache's {'.'.join(path)} counter.", None)
            self._add(family, None, value)
            yield family
