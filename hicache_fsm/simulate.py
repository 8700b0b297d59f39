"""``simulate``: the chat workload served through several cache configurations, compared.

The workload (``simulate_workload``) has the shape of SGLang's multi-turn
benchmark; the model is :class:`~hicache_fsm.model.TinyModel` (``tiny``) or a
Hugging Face Llama (``llama``, :class:`~hicache_fsm.llama_model.LlamaModel`),
both behind :class:`~hicache_fsm.model.KVModel`. Several cache configurations
(``simulate_config``) run the same requests in one run: device only, device +
host, device + host + storage, and an infinite cache as the bound. A cache-free
run comes first and gives the reference answers: every configuration must
produce the same greedy tokens (checked token by token; the reference tokens
are then fed back, so every configuration sees the same token stream). Each
configuration is served by the engine loop of ``simulate_engine``, which also
checks every KV page the cache serves; ``simulate_results`` holds what they
measured.

``run_simulation`` returns a :class:`Simulation`; ``hit_rate_sweep`` replays the
reference token stream without the model (a one-element KV shape) to map hit
rate against device and host capacity for ``--plot``.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
import time
import uuid
from typing import TextIO

from hicache_fsm.errors import ConfigError
from hicache_fsm.pools import default_device
from hicache_fsm.simulate_config import (
    DEVICE, DEVICE_HOST, FULL, INFINITE, MODELS, NEVER, STORAGE_OPTIONS, Options, Tier, build_model, device_only,
    storage_available,
)
from hicache_fsm.simulate_engine import (
    PREFETCH_POLL_S, PREFETCH_TIMEOUT_S, KVOracle, Observer, Shard, TimedExecutor, fetch_prefix, prefetch_and_wait,
    run_tier,
)
from hicache_fsm.simulate_results import Simulation, TierResult
from hicache_fsm.simulate_workload import ARRIVALS, Reference, Workload, reference_run, token_stream


class Progress:
    """A one-line progress bar on a terminal (no output when the stream is not one)."""

    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool | None = None, width: int = 30) -> None:
        self.total = max(1, total)
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.width = width
        self.label = ""
        self._last = 0.0

    def step(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if self.enabled and (now - self._last > 0.1 or self.done >= self.total):
            self._last = now
            filled = int(self.width * self.done / self.total)
            bar = "#" * filled + "." * (self.width - filled)
            self.stream.write(f"\r[{bar}] {self.done}/{self.total} {self.label:<22}")
            self.stream.flush()

    def set_label(self, label: str) -> None:
        self.label = label
        self.step(0)

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * (self.width + 40) + "\r")
            self.stream.flush()


def run_simulation(options: Options = Options(), progress: Progress | None = None,
                   storage_options: dict | None = None, observe: Observer | None = None,
                   settle_storage: bool = False) -> Simulation:
    """Run the cache-free reference and every configuration on the same requests.

    ``observe(tier_name, cache)`` is called with each configuration's cache before
    its first request (to record a trace or count transitions). With ``options.tp`` > 1
    every configuration runs on that many rank processes (see ``simulate_tp``).
    ``settle_storage``: storage hits that depend on the workload only, not on the
    storage threads' speed (see ``simulate_engine``; the CLI leaves it off).
    """
    if observe is not None and not callable(observe):
        raise ConfigError(f"observe must be callable as observe(tier_name, cache), got {observe!r}")
    start = time.perf_counter()
    w = options.workload
    device = options.device or str(default_device())
    model = build_model(options, device)
    storage_skipped = None
    tmp = None
    storage_url = None
    if options.storage:
        if not storage_available():
            storage_skipped = "this build of HiCache has no storage tier (attach_storage)"
        elif options.storage_url is not None:
            storage_url = options.storage_url
        else:
            tmp = tempfile.mkdtemp(prefix="hicache-sim-")
            storage_url = "file://" + os.path.join(tmp, "l3")
    tiers = options.tiers(storage_url)
    if storage_url is not None:  # a fresh key space per run: a store given again holds an earlier run's pages
        label = model.name if model is not None else f"tokens-only-s{w.seed}"
        storage_options = {"model": f"{label}-run-{uuid.uuid4().hex[:12]}", **(storage_options or {})}
    if progress is None:
        progress = Progress(w.requests * (len(tiers) + 1), enabled=False)
    else:
        progress.total = w.requests * (len(tiers) + 1)
    try:
        progress.set_label("cache-free reference")
        reference = reference_run(model, w, progress.step)
        rank_tiers: list[list[TierResult]] = []
        if options.tp > 1:
            from hicache_fsm.simulate_tp import run_ranks_tiers

            progress.set_label(f"{options.tp} ranks")
            rank_tiers = run_ranks_tiers(options, tiers, reference, device, storage_options, settle_storage)
            progress.step(w.requests * len(tiers))
            results = rank_tiers[0]
        else:
            results = []
            for tier in tiers:
                progress.set_label(tier.name)
                results.append(run_tier(tier, w, reference, model, options.page_size, options.layout, device,
                                        storage_options, progress.step, observe, settle_storage=settle_storage))
    finally:
        progress.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return Simulation(w, options.page_size, options.layout, device, results, reference.seconds,
                      time.perf_counter() - start, storage_skipped, reference, options.model, model.name,
                      options.tp, rank_tiers)


# ====================================================================== capacity sweep (for --plot)


def capacity_grid(options: Options) -> tuple[list[int], list[int]]:
    """Device sizes and host sizes to sweep: from one conversation (device) or one page (host) to everything."""
    ps = options.page_size
    w = options.workload
    one = w.system_prompt_length + w.rounds * (w.request_length + w.output_length)
    top = options.infinite_tokens()

    def pages(x: float) -> int:
        return max(ps, math.ceil(x / ps) * ps)

    devices = sorted({pages(one * f) for f in (1, 1.5, 2, 3, 4, 6, 8)} | {options.device_tokens})
    devices = [d for d in devices if d < top] + [top]
    hosts = sorted({pages(top * f) for f in (0.125, 0.25, 0.375, 0.5, 0.75, 1.0)} | {options.host_tokens})
    return devices, hosts


def sweep_hit_rate(options: Options, reference: Reference, device_tokens: int, host_tokens: int,
                   storage_url: str | None = None) -> float:
    """Token hit rate of the reference stream for one capacity (host 0 = device only).

    No model runs: a one-element KV shape and the reference answers; hit rates
    depend only on tokens and capacities.
    """
    ps = options.page_size
    if host_tokens == 0:
        tier = device_only("sweep", device_tokens, ps)
    else:
        tier = Tier("sweep", device_tokens, host_tokens, storage_url)
    return run_tier(tier, options.workload, reference, None, ps, options.layout, "cpu").hit_rate


def hit_rate_sweep(options: Options, reference: Reference, storage_url: str | None = None) -> dict[str, dict]:
    """Hit rate against device capacity (one line per host size) and against host capacity.

    Returns ``{"by_device": {label: [(device_tokens, rate)]}, "by_host": {label: [(host_tokens, rate)]},
    "skipped": [reason]}``; with ``storage_url`` each panel also has a line with storage added. Points
    whose host pool is not larger than the device pool cannot be configured; they are left out and
    ``skipped`` says which.
    """
    devices, hosts = capacity_grid(options)
    skipped: list[str] = []

    def line(points: list[tuple[int, int]], x: int, storage: str | None = None) -> list[tuple[int, float]]:
        """Hit rate at each (device, host) point, keyed by its ``x``-th coordinate."""
        out = []
        for point in points:
            d, h = point
            if 0 < h <= d:
                skipped.append(f"device {d} / host {h}: the host pool must be larger than the device pool")
            else:
                out.append((point[x], sweep_hit_rate(options, reference, d, h, storage)))
        return out

    by_device: dict[str, list[tuple[int, float]]] = {}
    for host in (0, *sorted({hosts[1], options.host_tokens, hosts[-3]})):
        label = "device only" if host == 0 else f"host {host}"
        by_device[label] = line([(d, host) for d in devices], 0)
    if storage_url is not None:
        by_device[f"host {options.host_tokens} + storage"] = line(
            [(d, options.host_tokens) for d in devices], 0, storage_url)
    by_host: dict[str, list[tuple[int, float]]] = {}
    dev = options.device_tokens
    by_host[f"device {dev}"] = line([(dev, h) for h in hosts], 1)
    if storage_url is not None:
        by_host[f"device {dev} + storage"] = line([(dev, h) for h in hosts], 1, storage_url)
    return {"by_device": by_device, "by_host": by_host, "skipped": sorted(set(skipped))}


__all__ = [
    "ARRIVALS", "DEVICE", "DEVICE_HOST", "FULL", "INFINITE", "KVOracle", "MODELS", "NEVER", "Observer",
    "Options", "PREFETCH_POLL_S", "PREFETCH_TIMEOUT_S", "Progress", "Reference", "STORAGE_OPTIONS", "Shard",
    "Simulation", "Tier", "TierResult", "TimedExecutor", "Workload", "build_model", "capacity_grid", "device_only",
    "fetch_prefix", "hit_rate_sweep", "prefetch_and_wait", "reference_run", "run_simulation", "run_tier",
    "storage_available", "sweep_hit_rate", "token_stream",
]
