"""Replay a production trace (Mooncake format) through ``HiCache`` in metadata mode.

Metadata mode: no model and one element of K and of V per token, so the pools
are tiny, while every residency transition, transfer job, executor copy,
completion and storage backend runs for real. Each request is served as an
engine's step loop would (see ``hicache_fsm.simulate``): ``match_prefix``;
with storage, ``prefetch`` of the part beyond the in-memory hit, polled until
ready, and a second match; ``load_back`` of the host part; ``lock``; the
per-layer waits; ``alloc_device`` for the input tokens not served; ``insert``
of the input cut to whole pages; ``unlock``; ``poll``; with storage, a wait
for the request's storage writes to land (requests in a trace are seconds
apart; back to back, the machine's load would decide the hit rate). Only input
tokens are cached: the next turn's input carries the answer under its own hash
ids. Storage waits are I/O time, not controller time.

The same four configurations as ``simulate`` (device only, device + host,
device + host + storage, infinite) replay in step, request by request, and
the infinite one is
checked against :func:`hicache_fsm.trace.prefix_bound`, the bound computed from
the hash ids alone. ``run_trace(..., sweep=sizes)`` also replays device-only
caches of several sizes for a hit-rate-against-capacity curve.
"""

from __future__ import annotations

import sys
import time
import uuid
from typing import Callable, Sequence, TextIO

import attrs
import torch

from hicache_fsm.cache import HiCache
from hicache_fsm.errors import ConfigError, StorageTimeout
from hicache_fsm.executors import TorchExecutor
from hicache_fsm.pools import LAYOUTS, KVShape, default_device
from hicache_fsm.simulate import (
    DEVICE,
    DEVICE_HOST,
    FULL,
    INFINITE,
    STORAGE_OPTIONS,
    Tier,
    TierResult,
    TimedExecutor,
    device_only,
    fetch_prefix,
    prefetch_and_wait,
    storage_available,
)
from hicache_fsm.simulate_engine import SETTLE_SAFETY_S
from hicache_fsm.trace import BlockTokens, PrefixBound, Trace, prefix_bound

METADATA_SHAPE = KVShape(1, 1, 1, torch.float16)  # one element of K and one of V per token
DEFAULT_STORAGE_URL = "memory://"
PREFETCH_POLL_S = 0.0001


# ====================================================================== options


@attrs.frozen
class TraceOptions:
    """Everything ``hicache-fsm simulate --trace`` takes besides the output flags."""

    trace: Trace
    device_tokens: int = 1 << 20
    host_tokens: int = 1 << 22
    storage_url: str | None = None  # None: memory:// (a file a page is slow at trace scale)
    storage: bool = True
    page_size: int = 16
    layout: str = "page_first"
    device: str | None = None  # None: CUDA when present, else CPU

    def __attrs_post_init__(self) -> None:
        ps = self.page_size
        if isinstance(ps, bool) or not isinstance(ps, int) or ps < 1 or self.trace.block_size % ps:
            raise ConfigError(f"page size must divide the trace's block size {self.trace.block_size}, got {ps!r}")
        for name in ("device_tokens", "host_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < ps or value % ps:
                raise ConfigError(f"{name} must be a positive multiple of page size {ps}, got {value!r}")
        if self.host_tokens <= self.device_tokens:
            raise ConfigError(f"host_tokens {self.host_tokens} must be larger than device_tokens {self.device_tokens}: "
                              f"the host keeps a copy of everything on the device")
        if self.layout not in LAYOUTS:
            raise ConfigError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")

    def tiers(self, storage_url: str | None, bound: PrefixBound) -> list[Tier]:
        """The four configurations; the infinite one holds every page the trace caches, on the device."""
        ps = self.page_size
        out = [device_only(DEVICE, self.device_tokens, ps), Tier(DEVICE_HOST, self.device_tokens, self.host_tokens)]
        if storage_url is not None:
            out.append(Tier(FULL, self.device_tokens, self.host_tokens, storage_url))
        out.append(device_only(INFINITE, bound.unique_tokens + ps, ps))
        return out


# ====================================================================== timing


class _CallClock:
    """Seconds inside HiCache calls, and inside the executor (a part of them), split by call."""

    def __init__(self) -> None:
        self.controller = 0.0
        self.executor = 0.0
        self.by_call: dict[str, float] = {}

    def call(self, fn, *args):
        start, copies = time.perf_counter(), self.executor
        try:
            return fn(*args)
        finally:
            spent = time.perf_counter() - start
            self.controller += spent
            name = fn.__name__
            self.by_call[name] = self.by_call.get(name, 0.0) + spent - (self.executor - copies)


# ====================================================================== one configuration


class TraceReplayer:
    """Serves trace requests one at a time through one configuration's HiCache (metadata mode)."""

    def __init__(self, tier: Tier, page_size: int, layout: str = "page_first", device: str = "cpu",
                 storage_namespace: str = "trace-replay") -> None:
        self.tier = tier
        self.clock = _CallClock()
        device_pool, host_pool = tier.pools(METADATA_SHAPE, page_size, layout, device)
        self.layers = device_pool.layers
        executor = TimedExecutor(TorchExecutor(device_pool, host_pool), self.clock)
        self.cache = HiCache(device_pool, host_pool, tier.cache_config(), executor)
        self.result = TierResult(tier.name, tier.device_tokens, tier.host_tokens, tier.storage_url)
        self.storage = tier.storage_url is not None
        if self.storage:
            options = dict(STORAGE_OPTIONS, model=storage_namespace, prefetch_threshold=page_size)
            try:
                self.cache.attach_storage(tier.storage_url, **options)  # setup, not per-request time
            except BaseException:
                self.close()
                raise
        self._requests = 0
        self.storage_settle_s = 0.0

    def serve(self, tokens: tuple, input_length: int) -> None:
        """One request whose cacheable input (whole pages) is ``tokens`` out of ``input_length`` tokens."""
        call = self.clock.call
        cache, res = self.cache, self.result
        res.requests += 1
        res.prompt_tokens += input_length
        m, lb, served = fetch_prefix(call, cache, tokens, len(tokens), self._prefetch if self.storage else None, res)
        node = lb.last_node if lb is not None else m.last_device_node
        call(cache.lock, node)
        try:
            n_served = int(served.numel())
            res.computed_tokens += input_length - n_served
            if n_served:
                for layer in range(self.layers):  # a forward pass waits for each layer's loads
                    call(m.wait, layer)
                    if lb is not None:
                        call(lb.wait, layer)
            n_new = len(tokens) - n_served
            if n_new > 0:
                new = call(cache.alloc_device, n_new)
                if new is None:
                    res.alloc_failures += 1
                else:
                    call(cache.insert, tokens, new if not n_served else torch.cat([served, new]))
        finally:
            call(cache.unlock, node)
        call(cache.poll)
        if self.storage:
            self._settle()

    def _settle(self) -> None:
        """Let this request's storage writes land before the next request (untimed I/O wait).

        A trace's requests are seconds apart and a page write takes far less;
        replayed back to back, how far the storage threads lag would depend on
        the machine's load, and so would the hit rate. Writes still running after
        ``SETTLE_SAFETY_S`` are stuck: ``StorageTimeout``, never a silent go-on.
        """
        cache = self.cache
        start = time.perf_counter()
        while cache.storage_transfers_in_flight():
            if time.perf_counter() > start + SETTLE_SAFETY_S:
                raise StorageTimeout(f"storage writes still running after {SETTLE_SAFETY_S:.0f} s: "
                                     "the storage threads are stuck")
            time.sleep(PREFETCH_POLL_S)
            cache.poll()
        self.storage_settle_s += time.perf_counter() - start

    def _prefetch(self, tokens: tuple, m):
        rid = self._requests
        self._requests += 1
        return prefetch_and_wait(self.clock, self.cache, self.result, rid, tokens, m, poll_s=PREFETCH_POLL_S,
                                 settle=True)

    def finish(self) -> TierResult:
        """Let storage backups land (untimed), collect counters, check invariants, close."""
        cache, res = self.cache, self.result
        try:
            if self.storage:
                deadline = time.perf_counter() + 10.0
                while cache.pending_job_ids() and time.perf_counter() < deadline:
                    cache.poll()
                    time.sleep(0.001)
            counters = cache.stats()
            res.counters = {k: v for k, v in counters.items() if isinstance(v, (int, float))}
            if self.storage:
                res.counters["storage_settle_s"] = round(self.storage_settle_s, 3)
            res.bytes = {kind: int(counters.get(f"bytes_{kind}", 0)) for kind in ("d2h", "h2d")}
            storage = counters.get("storage")
            if isinstance(storage, dict):
                backend = storage.get("backend_stats") or {}
                res.bytes["h2s"] = int(backend.get("bytes_written", counters.get("bytes_h2s", 0)))
                res.bytes["s2h"] = int(backend.get("bytes_read", 0))
            res.controller_s = max(0.0, self.clock.controller - self.clock.executor)
            res.transfer_s = self.clock.executor
            res.controller_by_call = dict(self.clock.by_call)
            cache.check_invariants()
        finally:
            cache.close()
        return res

    def close(self) -> None:
        """Release the cache (a no-op after ``finish``)."""
        self.cache.close()


def replay(tiers: Sequence[Tier], trace: Trace, tokens: BlockTokens, page_size: int, layout: str = "page_first",
           device: str = "cpu", storage_namespace: str = "trace-replay",
           on_request: Callable[[], None] = lambda: None) -> list[TierResult]:
    """Serve every request of ``trace`` through each configuration, in step.

    Each request's tokens are derived once and served by every configuration
    before the next request (a 12k-token input costs tens of microseconds to
    build; the configurations share that). A configuration's ``wall_s`` counts
    only its own setup, requests and wrap-up. ``on_request()`` follows each
    request (served by all of them).
    """
    replayers: list[TraceReplayer] = []
    spent: list[float] = []
    try:
        for tier in tiers:
            start = time.perf_counter()
            replayers.append(TraceReplayer(tier, page_size, layout, device, storage_namespace))
            spent.append(time.perf_counter() - start)
        for r in trace.requests:
            cacheable = tokens.tokens(r.hash_ids, r.input_length - r.input_length % page_size)
            for i, replayer in enumerate(replayers):
                start = time.perf_counter()
                replayer.serve(cacheable, r.input_length)
                spent[i] += time.perf_counter() - start
            on_request()
        results = []
        for replayer, wall in zip(replayers, spent):
            start = time.perf_counter()
            result = replayer.finish()
            result.wall_s = wall + time.perf_counter() - start
            results.append(result)
        return results
    finally:
        for replayer in replayers:
            replayer.close()


# ====================================================================== progress


class ReplayProgress:
    """Trace requests replayed so far, on stderr: a redrawn line on a terminal, a line every few seconds otherwise.

    A pass serves each request to all its configurations; a sweep is a second pass.
    """

    def __init__(self, total: int = 0, stream: TextIO | None = None, enabled: bool = True,
                 every_s: float = 10.0) -> None:
        self.total = max(1, total)
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and self.stream.isatty()
        self.every_s = 0.1 if self.tty else every_s
        self.label = ""
        self._start = time.perf_counter()
        self._last = self._start
        self._drawn = False

    def step(self, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self._last < self.every_s:
            return
        self._last = now
        line = (f"{self.done}/{self.total} requests ({100 * self.done / self.total:.0f}%), "
                f"{now - self._start:.0f} s: {self.label}")
        if self.tty:
            self.stream.write(f"\r{line:<72}")
            self._drawn = True
        else:
            self.stream.write(f"replaying trace: {line}\n")
        self.stream.flush()

    def set_label(self, label: str) -> None:
        self.label = label

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\r" + " " * 72 + "\r")
            self.stream.flush()


# ====================================================================== the whole comparison


@attrs.define
class TraceSimulation:
    """Every configuration's result on one trace, with the analytic bound and an optional sweep."""

    trace: Trace
    page_size: int
    layout: str
    device: str
    bound: PrefixBound
    tiers: list[TierResult]
    wall_s: float
    storage_skipped: str | None = None
    sweep: list[tuple[int, float]] | None = None

    def tier(self, name: str) -> TierResult | None:
        return next((t for t in self.tiers if t.name == name), None)

    @property
    def hierarchy(self) -> TierResult:
        """The fullest real hierarchy of the run (with storage when it ran)."""
        return self.tier(FULL) or self.tier(DEVICE_HOST) or self.tiers[0]

    def as_dict(self) -> dict:
        full = self.hierarchy
        bound = self.tier(INFINITE)
        return {
            "hit_rate": round(full.hit_rate, 4),
            "hit_rate_bound": round(bound.hit_rate, 4) if bound else None,
            "hit_rate_analytic_bound": round(self.bound.hit_rate, 4),
            "hierarchy": full.name,
            "requests": len(self.trace.requests),
            "controller_us_per_request": round(full.controller_us_per_request, 1),
            "configs": {t.name: t.as_dict() for t in self.tiers},
            "trace": self.trace.summary(),
            "unique_tokens": self.bound.unique_tokens,
            "page_size": self.page_size,
            "layout": self.layout,
            "device": self.device,
            "storage_skipped": self.storage_skipped,
            "sweep": None if self.sweep is None else {
                "device_tokens": [c for c, _ in self.sweep], "hit_rate": [round(r, 4) for _, r in self.sweep]},
            "wall_s": round(self.wall_s, 3),
        }


def run_trace(options: TraceOptions, progress: ReplayProgress | None = None,
              sweep: Sequence[int] | None = None) -> TraceSimulation:
    """Replay the trace through every configuration (and a device-only cache of each ``sweep`` size)."""
    start = time.perf_counter()
    trace, ps = options.trace, options.page_size
    device = options.device or str(default_device())
    bound = prefix_bound(trace, ps)
    storage_skipped = None
    storage_url = None
    if options.storage:
        if storage_available():
            storage_url = options.storage_url or DEFAULT_STORAGE_URL
        else:
            storage_skipped = "this build of HiCache has no storage tier (attach_storage)"
    tiers = options.tiers(storage_url, bound)
    namespace = f"trace-replay-{uuid.uuid4().hex[:12]}"  # a fresh key space: no pages of an earlier run
    n = len(trace.requests)
    progress = progress or ReplayProgress(enabled=False)
    passes = 2 if sweep else 1
    progress.total = n * passes
    tokens = BlockTokens(trace.block_size)
    points = None
    try:
        progress.set_label(f"pass 1/{passes}: {len(tiers)} configurations")
        results = replay(tiers, trace, tokens, ps, options.layout, device, namespace, progress.step)
        if sweep:
            progress.set_label(f"pass 2/2: {len(sweep)} device sizes")
            swept = replay([device_only(f"sweep-{c}", c, ps) for c in sweep], trace, tokens, ps, options.layout,
                           device, namespace, progress.step)
            points = [(c, r.hit_rate) for c, r in zip(sweep, swept)]
    finally:
        progress.close()
    return TraceSimulation(trace, ps, options.layout, device, bound, results, time.perf_counter() - start,
                           storage_skipped, points)


def sweep_capacities(trace: Trace, page_size: int, bound: PrefixBound, points: int = 10) -> list[int]:
    """Device sizes from the longest input to everything the trace caches, evenly spaced on a log scale."""
    def pages(x: float) -> int:
        return max(page_size, -(-int(x) // page_size) * page_size)

    lo = pages(trace.max_input_length)
    hi = max(lo, pages(bound.unique_tokens + page_size))
    if points < 2 or hi == lo:
        return [hi]
    ratio = (hi / lo) ** (1 / (points - 1))
    return sorted({pages(lo * ratio ** i) for i in range(points - 1)} | {hi})


__all__ = [
    "DEFAULT_STORAGE_URL", "METADATA_SHAPE", "ReplayProgress", "TraceOptions", "TraceReplayer", "TraceSimulation",
    "replay", "run_trace", "sweep_capacities",
]
