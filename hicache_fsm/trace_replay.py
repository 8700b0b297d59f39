"""Replay a production trace (Mooncake format) through ``HiCache`` in metadata mode.

Metadata mode: no model and one element of K and of V per token, so the pools
are tiny, while every residency transition, transfer job, completion and
storage call runs for real. KV bytes mean nothing without a model, so none is
moved: the executor completes each device/host batch at the next poll without
copying (:class:`hicache_fsm.executors.AckExecutor`), and an in-process store keeps page keys
only (see :func:`metadata_backend`). Each request is served as an
engine's step loop would (see ``hicache_fsm.simulate``): ``match_prefix``;
with storage, ``prefetch`` of the part beyond the in-memory hit, polled until
ready, and a second match; ``load_back`` of the host part; ``lock``; the
per-layer waits; ``alloc_device`` for the input tokens not served; ``insert``
of the input cut to whole pages; ``unlock``; ``poll``. Only input tokens are
cached: the next turn's input carries the answer under its own hash ids.

Time is simulated: storage threads are not started, the replayer runs the
storage tier's queued work itself where a thread would have finished it (a
prefetch before its request proceeds; a request's backups before the next
request, which in a trace comes seconds later), so nothing waits on wall time
and the hit rates do not depend on the machine's load. Each request's time to
first token on that clock follows :class:`CostModel` (prefill proportional to
the tokens computed, load-back to the tokens moved host to device, storage
fetch to the tokens read from storage).

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
from urllib.parse import urlsplit
from typing import Callable, Sequence, TextIO

import attrs
import torch

from hicache_fsm.cache import HiCache
from hicache_fsm.config import check_seconds
from hicache_fsm.errors import ConfigError
from hicache_fsm.executors import AckExecutor
from hicache_fsm.pools import DeviceKVPool, HostKVPool, KVShape, default_device
from hicache_fsm.simulate_config import check_pool_options
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
    storage_available,
)
from hicache_fsm.storage.keys import KeyNamespace
from hicache_fsm.storage.keys_only import KeysOnlyBackend
from hicache_fsm.storage.stepped import SteppedStorageTier
from hicache_fsm.trace import BlockTokens, PrefixBound, Trace, check_page_size, prefix_bound

METADATA_SHAPE = KVShape(1, 1, 1, torch.float16)  # one element of K and one of V per token
DEFAULT_STORAGE_URL = "memory://"


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
        if not isinstance(self.trace, Trace):  # a path or None raised AttributeError deep in the checks
            raise ConfigError(f"TraceOptions.trace must be a Trace (hicache_fsm.trace.load_trace reads one), "
                              f"got {type(self.trace).__name__}")
        ps = check_page_size(self.page_size, self.trace.block_size)
        check_pool_options(self.device_tokens, self.host_tokens, ps, self.layout, self.device)

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


# ====================================================================== the simulated clock


@attrs.frozen
class CostModel:
    """What a request's time to first token is made of, on the simulated clock (seconds per token).

    ``prefill_s``: computing one input token's KV (about 20k tokens/s, an 8B
    model on one accelerator); ``load_s``: moving one token's KV host to
    device; ``storage_s``: fetching one token's KV from storage into host
    memory (a storage hit is then also loaded to the device). A device hit
    costs nothing. Time to first token = the request's storage fetch, its
    load-back and its prefill, one after the other (no queueing: the trace's
    requests are served one at a time).
    """

    prefill_s: float = 50e-6
    load_s: float = 2e-6
    storage_s: float = 10e-6

    def __attrs_post_init__(self) -> None:
        for name in ("prefill_s", "load_s", "storage_s"):
            check_seconds(f"CostModel.{name}", getattr(self, name), zero_ok=True)

    def ttft(self, computed: int, host: int, storage: int) -> float:
        return computed * self.prefill_s + (host + storage) * self.load_s + storage * self.storage_s

    def describe(self) -> str:
        return (f"prefill {self.prefill_s * 1e6:g} us/token computed, load-back {self.load_s * 1e6:g} us/token "
                f"host->device, storage fetch {self.storage_s * 1e6:g} us/token")


@attrs.define
class Latency:
    """One configuration's simulated time to first token over the trace (its prefill counts are its TierResult's)."""

    ttft_s: list[float] = attrs.Factory(list)
    clock_s: float = 0.0  # the simulated clock at the end: the sum of every request's time to first token

    def as_dict(self) -> dict:
        ttft = sorted(self.ttft_s)
        p90 = ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))] if ttft else 0.0
        return {"ttft_mean_s": round(sum(ttft) / len(ttft), 6) if ttft else 0.0, "ttft_p90_s": round(p90, 6),
                "simulated_s": round(self.clock_s, 3)}


# ====================================================================== one configuration


def metadata_executor(device_pool: DeviceKVPool, host_pool: HostKVPool) -> AckExecutor:
    """The executor of a metadata-mode cache over these pools (no KV byte moves between them)."""
    return AckExecutor(device_pool.layers)


def metadata_backend(storage_url: str, namespace: KeyNamespace) -> str | KeysOnlyBackend:
    """What metadata mode stores into: ``memory://[NAME]`` becomes a keys-only store of the same name.

    KV bytes mean nothing without a model, so an in-process store keeps the
    keys alone (:class:`KeysOnlyBackend`: every storage call has the outcome it
    would have on ``memory://``, and no page is serialised). Any other URL
    (``file://``, ``redis://``, ...) is opened as given: its I/O is what the
    caller asked to see.
    """
    parts = urlsplit(storage_url)
    if parts.scheme.lower() != "memory" or parts.path not in ("", "/") or parts.query:
        return storage_url
    return KeysOnlyBackend(namespace, store=f"metadata-{parts.netloc}" if parts.netloc else None)


class TraceReplayer:
    """Serves trace requests one at a time through one configuration's HiCache (metadata mode).

    Storage runs on the simulated clock: the tier starts no threads
    (``SteppedStorageTier``) and the replayer runs its queued work itself
    (``run_queued``) where a thread would have finished it by then: a
    prefetch's queries and transfers before the request proceeds, a request's
    backups before the next request arrives. Nothing waits on wall time.
    """

    def __init__(self, tier: Tier, page_size: int, layout: str = "page_first", device: str = "cpu",
                 storage_namespace: str = "trace-replay", costs: CostModel = CostModel()) -> None:
        self.tier = tier
        self.costs = costs
        self.latency = Latency()
        self.clock = _CallClock()
        device_pool, host_pool = tier.pools(METADATA_SHAPE, page_size, layout, device)
        self.layers = device_pool.layers
        executor = TimedExecutor(metadata_executor(device_pool, host_pool), self.clock)
        self.cache = HiCache(device_pool, host_pool, tier.cache_config(), executor)
        self.result = TierResult(tier.name, tier.device_tokens, tier.host_tokens, tier.storage_url)
        self.storage = tier.storage_url is not None
        if self.storage:
            options = dict(STORAGE_OPTIONS, model=storage_namespace, prefetch_threshold=page_size)
            try:
                backend = metadata_backend(tier.storage_url, KeyNamespace(storage_namespace))
                SteppedStorageTier.attach_to(self.cache, backend, **options)  # setup, not per-request time
            except BaseException:
                self.close()
                raise
        self._requests = 0

    def serve(self, tokens, input_length: int) -> None:
        """One request whose cacheable input (whole pages) is ``tokens`` out of ``input_length`` tokens."""
        call = self.clock.call
        cache, res = self.cache, self.result
        res.requests += 1
        res.prompt_tokens += input_length
        before = (res.host_hit_tokens, res.storage_hit_tokens, res.computed_tokens)
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
        host, storage, computed = (res.host_hit_tokens - before[0], res.storage_hit_tokens - before[1],
                                   res.computed_tokens - before[2])
        lat = self.latency
        res.reused_tokens += n_served
        ttft = self.costs.ttft(computed, host, storage)
        lat.ttft_s.append(ttft)
        lat.clock_s += ttft
        if self.storage:
            self._run_storage()  # this request's backups land before the next request arrives

    def _run_storage(self, rounds: int = 64) -> None:
        """Run every piece of queued storage work on this thread and apply it, until none is left."""
        cache = self.cache
        tier = cache.storage
        for _ in range(rounds):
            work = tier.queued_work()
            if not any(work.values()):
                if not cache.storage_transfers_in_flight():
                    return
                cache.poll()  # completions a run left for the next poll
                if not any(tier.queued_work().values()):
                    return
                continue
            tier.run_all()
            cache.poll()

    def _prefetch(self, tokens, m):
        """Prefetch what storage adds to ``m``; its work runs now, untimed (the simulated clock counts it)."""
        cache, res, clock = self.cache, self.result, self.clock
        rid = self._requests
        self._requests += 1
        if not clock.call(cache.prefetch, rid, tokens, m):
            return m
        res.prefetches += 1
        c0, e0, b0 = clock.controller, clock.executor, dict(clock.by_call)
        for _ in range(8):
            self._run_storage()
            if cache.prefetch_ready(rid):
                break
        else:
            res.prefetch_timeouts += 1
            cache.abort_prefetch(rid)
        clock.controller, clock.executor, clock.by_call = c0, e0, b0
        return clock.call(cache.match_prefix, tokens)

    def finish(self) -> TierResult:
        """Let storage backups land, collect counters, check invariants, close."""
        cache, res = self.cache, self.result
        try:
            if self.storage:
                self._run_storage()
            res.take_counters(cache.stats())
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
    """Serve every request of ``trace`` through each configuration, in step (see ``replay_timed``)."""
    return [r for r, _ in replay_timed(tiers, trace, tokens, page_size, layout, device, storage_namespace, on_request)]


def replay_timed(tiers: Sequence[Tier], trace: Trace, tokens: BlockTokens, page_size: int,
                 layout: str = "page_first", device: str = "cpu", storage_namespace: str = "trace-replay",
                 on_request: Callable[[], None] = lambda: None,
                 costs: CostModel = CostModel()) -> list[tuple[TierResult, Latency]]:
    """Serve every request of ``trace`` through each configuration, in step; each result with its latency.

    Each request's tokens are derived and packed once (``BlockTokens.packed``)
    and served by every configuration before the next request. A
    configuration's ``wall_s`` counts only its own setup, requests and
    wrap-up. ``on_request()`` follows each request (served by all of them).
    """
    replayers: list[TraceReplayer] = []
    spent: list[float] = []
    try:
        for tier in tiers:
            start = time.perf_counter()
            replayers.append(TraceReplayer(tier, page_size, layout, device, storage_namespace, costs))
            spent.append(time.perf_counter() - start)
        for r in trace.requests:
            cacheable = tokens.packed(r.hash_ids, r.input_length - r.input_length % page_size)
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
            results.append((result, replayer.latency))
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


# replays configurations elsewhere: (tiers, trace, page size, layout, device, storage namespace, after each
# configuration) -> (result, latency) per configuration, in order
ConfigReplayer = Callable[[Sequence[Tier], Trace, int, str, str, str, Callable[[], None]],
                          list[tuple[TierResult, "Latency"]]]


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
    latency: dict[str, Latency] = attrs.Factory(dict)
    costs: CostModel = CostModel()

    def tier(self, name: str) -> TierResult | None:
        return next((t for t in self.tiers if t.name == name), None)

    @property
    def hierarchy(self) -> TierResult:
        """The fullest real hierarchy of the run (with storage when it ran)."""
        return self.tier(FULL) or self.tier(DEVICE_HOST) or self.tiers[0]

    def prefill_saved_vs_device(self) -> float | None:
        """Share of the device-only configuration's prefill tokens the hierarchy did not compute."""
        device, full = self.tier(DEVICE), self.hierarchy
        if device is None or not device.computed_tokens:
            return None
        return round(1 - full.computed_tokens / device.computed_tokens, 4)

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
            "configs": {t.name: {**replayed_dict(t), **self.latency[t.name].as_dict()} if t.name in self.latency
                        else replayed_dict(t) for t in self.tiers},
            "cost_model": attrs.asdict(self.costs),
            "prefill_saved_vs_device": self.prefill_saved_vs_device(),
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


CHAT_ONLY = ("ttft_ms_mean", "ttft_ms_p90")  # a model run's TTFT; a replay's is Latency's, on its own clock


def replayed_dict(result: TierResult) -> dict:
    """``result.as_dict()`` for a replayed configuration: no host where it has none (device only, infinite), and
    none of the chat workload's TTFT figures (zeros here, beside the replay's own)."""
    d = {k: v for k, v in result.as_dict().items() if k not in CHAT_ONLY}
    if result.name in (DEVICE, INFINITE):
        d["host_tokens"] = None
    return d


def run_trace(options: TraceOptions, progress: ReplayProgress | None = None,
              sweep: Sequence[int] | None = None, bound: PrefixBound | None = None,
              elsewhere: ConfigReplayer | None = None) -> TraceSimulation:
    """Replay the trace through every configuration (and a device-only cache of each ``sweep`` size).

    ``bound``: the trace's ``prefix_bound`` at the options' page size when the caller has it (else computed here).
    ``elsewhere``: replays the configurations (and the sweep's) outside this
    process (e.g. ``hicache_fsm.trace_workers.in_workers(jobs)``), with the
    same figures; progress then moves as each configuration finishes.
    """
    if not isinstance(options, TraceOptions):
        raise ConfigError(f"run_trace takes TraceOptions, got {type(options).__name__}")
    if bound is not None and not isinstance(bound, PrefixBound):
        raise ConfigError(f"bound must be the trace's PrefixBound (trace.prefix_bound), got {type(bound).__name__}")
    if sweep is not None and (isinstance(sweep, (str, bytes)) or not isinstance(sweep, Sequence)):
        raise ConfigError(f"sweep must be a sequence of device sizes in tokens, got {type(sweep).__name__}")
    start = time.perf_counter()
    trace, ps = options.trace, options.page_size
    device = options.device or str(default_device())
    if bound is None:
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
        def replay_pass(label: str, configs: list[Tier]) -> list[tuple[TierResult, Latency]]:
            if elsewhere is None or len(configs) < 2:
                progress.set_label(label)
                return replay_timed(configs, trace, tokens, ps, options.layout, device, namespace, progress.step)
            progress.set_label(f"{label} in worker processes")
            share = n // len(configs)
            out = elsewhere(configs, trace, ps, options.layout, device, namespace, lambda: progress.step(share))
            progress.step(n - share * len(configs))
            return out

        replayed = replay_pass(f"pass 1/{passes}: {len(tiers)} configurations", tiers)
        if sweep:
            swept = [r for r, _ in replay_pass(f"pass 2/2: {len(sweep)} device sizes",
                                               [device_only(f"sweep-{c}", c, ps) for c in sweep])]
            points = [(c, r.hit_rate) for c, r in zip(sweep, swept)]
    finally:
        progress.close()
    return TraceSimulation(trace, ps, options.layout, device, bound, [r for r, _ in replayed],
                           time.perf_counter() - start, storage_skipped, points,
                           {r.name: lat for r, lat in replayed})


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
    "DEFAULT_STORAGE_URL", "METADATA_SHAPE", "ConfigReplayer", "CostModel", "Latency", "ReplayProgress", "TraceOptions",
    "TraceReplayer", "TraceSimulation", "metadata_backend", "metadata_executor", "replay", "replay_timed",
    "replayed_dict", "run_trace", "sweep_capacities",
]
