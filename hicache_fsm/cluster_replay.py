"""Replay a trace through a cluster: N caches behind a KV-aware router, sharing one L3.

Each instance is a :class:`hicache_fsm.trace_replay.TraceReplayer` (its own
device and host pools, metadata mode) with KV events enabled
(:func:`hicache_fsm.events.enable_kv_events`). With storage, every instance
attaches the same ``memory://NAME`` store under one key namespace, so a page
one instance backed up is a storage hit for all. The router sees the cluster
only through the events: after each request every instance's queued events
are flushed into one stream, and the router's :class:`PrefixIndex` applies the
batches published at least ``event_lag`` requests ago (0: the router is
current). For each request the router computes the page hashes, picks an
instance and predicts the cached prefix it will find there (device or host
of that instance, or the shared L3); the prediction against what the instance
then served is how stale the router's view was.

Every ``verify_every`` requests (at the end too), with ``event_lag`` 0, the
index is compared with each instance's actual device and host contents
(:func:`hicache_fsm.events.contents.cache_contents`).
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from typing import Sequence

import attrs

from hicache_fsm.errors import ConfigError
from hicache_fsm.events.contents import MEMORY_TIERS, cache_contents
from hicache_fsm.events.hashes import request_hashes
from hicache_fsm.events.hook import KVEventHook, enable_kv_events
from hicache_fsm.pools import default_device
from hicache_fsm.router.index import PrefixIndex
from hicache_fsm.router.names import DEFAULT_LOAD_CAP, MAX_INSTANCES, POLICIES
from hicache_fsm.router.policies import Router, check_load_cap
from hicache_fsm.simulate import Tier, TierResult, storage_available
from hicache_fsm.simulate_config import check_pool_options
from hicache_fsm.trace import BlockTokens, Trace, check_page_size
from hicache_fsm.trace_replay import ReplayProgress, TraceReplayer, replayed_dict

DEFAULT_VERIFY_EVERY = 25


@attrs.frozen
class ClusterOptions:
    """A cluster replay: the trace, N instances of one size, the router's policy, the shared L3."""

    trace: Trace
    instances: int = 4
    policy: str = "prefix_aware"
    device_tokens: int = 1 << 20
    host_tokens: int = 1 << 22
    storage_url: str | None = None  # None: a fresh shared memory://NAME
    storage: bool = True
    page_size: int = 16
    layout: str = "page_first"
    device: str | None = None
    load_cap: float = DEFAULT_LOAD_CAP
    event_lag: int = 0
    verify_every: int = DEFAULT_VERIFY_EVERY

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.trace, Trace):
            raise ConfigError(f"trace must be a Trace (hicache_fsm.trace.load_trace), got {type(self.trace).__name__}")
        if isinstance(self.instances, int) and self.instances > MAX_INSTANCES:  # the router's bound, said up front
            raise ConfigError(f"instances must be an int from 1 to {MAX_INSTANCES}, got {self.instances!r}")
        for name in ("instances", "verify_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be a positive int, got {value!r}")
        lag = self.event_lag
        if isinstance(lag, bool) or not isinstance(lag, int) or lag < 0:
            raise ConfigError(f"event-lag must be a non-negative int, got {lag!r}")
        if self.policy not in POLICIES:
            raise ConfigError(f"router policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        check_load_cap(self.load_cap)  # refused here, before a replay starts (the router checks it again)
        ps = check_page_size(self.page_size, self.trace.block_size)
        check_pool_options(self.device_tokens, self.host_tokens, ps, self.layout, self.device)
        if self.storage_url is not None and not (isinstance(self.storage_url, str) and self.storage_url.startswith(
                ("memory://", "file://", "redis://", "mooncake://"))):
            raise ConfigError(f"storage URL {self.storage_url!r}: a cluster shares one L3, so it needs a shared "
                              "backend URL (memory://NAME, file://DIR, redis://..., mooncake://...)")
        if self.storage_url == "memory://":
            raise ConfigError("memory:// is private to one cache: give the cluster's L3 a name, memory://NAME")


@attrs.define
class Staleness:
    """The router's prediction (tokens cached on the chosen instance) against what that instance served."""

    decisions: int = 0
    exact: int = 0
    abs_error_tokens: int = 0
    over_tokens: int = 0  # predicted cached, but recomputed (the view was ahead of reality or too old)
    under_tokens: int = 0  # served from cache though the router did not know
    batches_behind: int = 0  # batches published but not yet applied, summed over decisions

    def add(self, predicted: int, actual: int, behind: int) -> None:
        self.decisions += 1
        self.exact += predicted == actual
        self.abs_error_tokens += abs(predicted - actual)
        self.over_tokens += max(0, predicted - actual)
        self.under_tokens += max(0, actual - predicted)
        self.batches_behind += behind

    def as_dict(self) -> dict:
        n = max(1, self.decisions)
        return {"decisions": self.decisions, "exact_share": round(self.exact / n, 4),
                "mean_abs_error_tokens": round(self.abs_error_tokens / n, 2),
                "over_predicted_tokens": self.over_tokens, "under_predicted_tokens": self.under_tokens,
                "mean_batches_behind": round(self.batches_behind / n, 3)}


@attrs.define
class ClusterResult:
    """Per-instance results, the cluster's totals, the router's staleness and the index checks."""

    instances: int
    policy: str
    storage_url: str | None
    results: list[TierResult]
    staleness: Staleness
    index_checks: int = 0
    index_agreements: int = 0
    events: int = 0
    batches: int = 0
    wall_s: float = 0.0

    def _sum(self, field: str) -> int:
        return sum(getattr(r, field) for r in self.results)

    @property
    def prompt_tokens(self) -> int:
        return self._sum("prompt_tokens")

    def rate(self, tokens: int) -> float:
        return tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def hit_rate(self) -> float:
        return self.rate(sum(r.hit_tokens for r in self.results))

    def spread(self, field: str) -> tuple[int, float]:
        """(max, mean) of ``field`` over the instances."""
        values = [getattr(r, field) for r in self.results]
        return max(values), sum(values) / len(values)

    def as_dict(self) -> dict:
        req_max, req_mean = self.spread("requests")
        tok_max, tok_mean = self.spread("prompt_tokens")
        return {
            "instances": self.instances,
            "policy": self.policy,
            "storage": self.storage_url is not None,
            "hit_rate": round(self.hit_rate, 4),
            "hit_rate_device": round(self.rate(self._sum("device_hit_tokens")), 4),
            "hit_rate_host": round(self.rate(self._sum("host_hit_tokens")), 4),
            "hit_rate_storage": round(self.rate(self._sum("storage_hit_tokens")), 4),
            "requests": self._sum("requests"),
            "prompt_tokens": self.prompt_tokens,
            "requests_per_instance": {"max": req_max, "mean": round(req_mean, 2)},
            "tokens_per_instance": {"max": tok_max, "mean": round(tok_mean, 2)},
            "staleness": self.staleness.as_dict(),
            "index_checks": self.index_checks,
            "index_agreements": self.index_agreements,
            "events": self.events,
            "event_batches": self.batches,
            "per_instance": [replayed_dict(r) for r in self.results],
            "wall_s": round(self.wall_s, 2),
        }


class _EventStream:
    """Every instance's batches in publication order, held back ``lag`` requests before the router sees them."""

    def __init__(self, index: PrefixIndex, lag: int) -> None:
        self.index = index
        self.lag = lag
        self.request = 0
        self.pending: deque[tuple[int, int, object]] = deque()
        self.batches = 0

    def sink(self, instance: int):
        def publish(batch) -> None:
            self.pending.append((self.request, instance, batch))
            self.batches += 1
        return publish

    def deliver(self) -> None:
        """Apply every batch published more than ``lag`` requests before the current one.

        The current request has published nothing yet: with ``lag`` 0 the router
        sees every batch so far, with ``lag`` K it misses those of the last K requests.
        """
        pending = self.pending
        while pending and pending[0][0] < self.request - self.lag:
            _, instance, batch = pending.popleft()
            self.index.apply(instance, batch)


def _agrees(index: PrefixIndex, instance: int, replayer: TraceReplayer) -> bool:
    actual = cache_contents(replayer.cache)
    return all(index.blocks(instance, tier) == actual[tier] for tier in MEMORY_TIERS)


def run_cluster(options: ClusterOptions, progress: ReplayProgress | None = None) -> ClusterResult:
    """Serve every request of the trace on the instance the router picks (see module docstring)."""
    if not isinstance(options, ClusterOptions):
        raise ConfigError(f"run_cluster takes ClusterOptions, got {type(options).__name__}")
    start = time.perf_counter()
    trace, ps, n = options.trace, options.page_size, options.instances
    device = options.device or str(default_device())
    storage_url = None
    if options.storage and storage_available():
        storage_url = options.storage_url or f"memory://cluster-{uuid.uuid4().hex[:12]}"
    namespace = f"cluster-{uuid.uuid4().hex[:12]}"  # one key space shared by the instances, fresh per run
    index = PrefixIndex()
    stream = _EventStream(index, options.event_lag)
    router = Router(n, options.policy, index, options.load_cap)
    staleness = Staleness()
    progress = progress or ReplayProgress(enabled=False)
    progress.total = max(progress.total, progress.done + len(trace.requests))  # a sweep planned its runs already
    replayers: list[TraceReplayer] = []
    hooks: list[KVEventHook] = []
    checks = agreements = 0
    try:
        for i in range(n):
            tier = Tier(f"instance-{i}", options.device_tokens, options.host_tokens, storage_url)
            replayers.append(TraceReplayer(tier, ps, options.layout, device, namespace))
            hooks.append(enable_kv_events(replayers[i].cache, stream.sink(i)))
        tokens_of = BlockTokens(trace.block_size)
        for number, r in enumerate(trace.requests, 1):
            tokens = tokens_of.tokens(r.hash_ids, r.input_length - r.input_length % ps)
            stream.deliver()
            hashes = request_hashes(tokens, ps)
            choice = router.place(hashes)
            predicted = index.prefix_pages(choice, hashes, MEMORY_TIERS, shared_storage=storage_url is not None)
            replayer = replayers[choice]
            before = replayer.result.hit_tokens
            replayer.serve(tokens, r.input_length)
            staleness.add(predicted * ps, replayer.result.hit_tokens - before, len(stream.pending))
            for hook in hooks:
                hook.flush()
            stream.request += 1
            if options.event_lag == 0 and (number % options.verify_every == 0 or number == len(trace.requests)):
                stream.deliver()
                for i, rep in enumerate(replayers):
                    checks += 1
                    agreements += _agrees(index, i, rep)
            progress.step()
        results = [rep.finish() for rep in replayers]
    finally:
        progress.close()
        for rep in replayers:
            rep.close()
    return ClusterResult(n, options.policy, storage_url, results, staleness, checks, agreements,
                         sum(h.events for h in hooks), stream.batches, time.perf_counter() - start)


def sweep_cluster(options: ClusterOptions, counts: Sequence[int], policies: Sequence[str] = POLICIES,
                  progress: ReplayProgress | None = None) -> list[ClusterResult]:
    """One cluster replay per (instance count, policy), each with a fresh shared L3.

    One count or one policy alone (``4``, ``"round_robin"``) is a list of one, not its letters.
    """
    counts = (counts,) if isinstance(counts, int) else tuple(counts)
    policies = (policies,) if isinstance(policies, str) else tuple(policies)
    out = []
    if progress is not None:  # every run's requests: the count never passes the total
        progress.total = progress.done + len(options.trace.requests) * len(counts) * len(policies)
    for count in counts:
        for policy in policies:
            if progress is not None:
                progress.set_label(f"{count} instances, {policy}")
            out.append(run_cluster(attrs.evolve(options, instances=count, policy=policy), progress))
    return out
