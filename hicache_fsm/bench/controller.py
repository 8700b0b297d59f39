"""Controller overhead per request: HiCache on the compiled table vs through ``transitions``.

Each request is 4,096 tokens (page 64): a shared prefix of 1,024 tokens (one
of 8 system prompts) plus a unique suffix. Per request the engine-side loop
does ``match_prefix``, ``alloc_device`` for the uncached part, ``insert``
(write_through: one backup job), ``poll`` (starts the batch), and ``poll``
again (applies the acks). Copies are not measured: ``AckExecutor`` (defined
here) acknowledges every batch on the next poll without moving any bytes, and
the pools use a one-element KV shape. The same loop runs with
``HiCache(dispatcher=TransitionsDispatcher(...))``, which fires every
residency trigger through ``transitions.Machine`` with one model per node
(``add_model`` on first use), as an engine using ``transitions`` directly would.

Result keys: ``us_per_request`` (compiled), ``transitions_us_per_request``,
``speedup`` (their ratio), plus the configuration.
"""

from __future__ import annotations

import argparse
import gc
import random
import time

from hicache_fsm.bench.common import machine_description, report
from hicache_fsm.cache import HiCache
from hicache_fsm.config import CacheConfig
from hicache_fsm.jobs import Completion, JobBatch, completed_all
from hicache_fsm.pools import DeviceKVPool, HostKVPool, KVShape
from hicache_fsm.spec import load_builtin
from hicache_fsm.transitions_dispatch import TransitionsDispatcher

REQUEST_TOKENS = 4096
PAGE_SIZE = 64
PREFIX_TOKENS = 1024
SYSTEM_PROMPTS = 8


class _Done:
    def __init__(self, layers: int) -> None:
        self.layers = layers

    def wait(self, layer: int) -> None:
        return None

    def done(self) -> bool:
        return True


class AckExecutor:
    """Acknowledges every submitted batch on the next ``poll`` without copying (controller-only timing)."""

    manual = False

    def __init__(self, layers: int = 1) -> None:
        self.layers = layers
        self._ready: list[Completion] = []

    def submit(self, batch: JobBatch) -> _Done:
        self._ready.extend(completed_all(batch.jobs))
        return _Done(self.layers)

    def poll(self) -> list[Completion]:
        out, self._ready = self._ready, []
        return out

    def synchronize(self) -> None:
        return None

    def close(self) -> None:
        return None


def make_requests(n: int, seed: int = 0) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    prompts = [tuple(rng.randrange(1, 32000) for _ in range(PREFIX_TOKENS)) for _ in range(SYSTEM_PROMPTS)]
    return [
        rng.choice(prompts) + tuple(rng.randrange(1, 32000) for _ in range(REQUEST_TOKENS - PREFIX_TOKENS))
        for _ in range(n)
    ]


def make_cache(n_requests: int, dispatcher=None) -> HiCache:
    shape = KVShape(layers=1, heads=1, head_dim=1)
    tokens = (n_requests + SYSTEM_PROMPTS) * REQUEST_TOKENS
    device = DeviceKVPool(shape, tokens, PAGE_SIZE, "cpu")
    host = HostKVPool(shape, tokens, PAGE_SIZE, pin_memory=False)
    return HiCache(device, host, CacheConfig(write_policy="write_through"), AckExecutor(), dispatcher=dispatcher)


def serve(cache: HiCache, requests: list[tuple[int, ...]]) -> float:
    """Run every request through the engine loop; seconds taken."""
    gc.collect()
    start = time.perf_counter()
    for tokens in requests:
        m = cache.match_prefix(tokens)
        cached = m.device_hit_length
        new = cache.alloc_device(len(tokens) - cached)
        indices = new if not cached else _cat(m.device_indices, new)
        cache.insert(tokens, indices)
        cache.poll()  # start the backup batch
        cache.poll()  # apply its acks
    elapsed = time.perf_counter() - start
    if cache.pending_job_ids():
        raise RuntimeError("benchmark left jobs pending")
    return elapsed


def _cat(a, b):
    import torch

    return torch.cat([a, b])


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=1000, help="requests per run (default 1000)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each variant; the best is kept (default 3)")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> dict:
    n = args.requests
    if n <= 0:
        raise SystemExit("--requests must be positive")
    requests = make_requests(n, args.seed)
    spec = load_builtin("residency")
    ours, theirs = [], []
    for _ in range(max(1, args.repeats)):  # alternate so machine noise hits both alike
        ours.append(serve(make_cache(n), requests))
        theirs.append(serve(make_cache(n, TransitionsDispatcher(spec)), requests))
    us = min(ours) / n * 1e6
    tus = min(theirs) / n * 1e6
    result = {
        "benchmark": "controller",
        "requests": n,
        "request_tokens": REQUEST_TOKENS,
        "page_size": PAGE_SIZE,
        "executor": "AckExecutor (acks without copying)",
        "us_per_request": round(us, 2),
        "transitions_us_per_request": round(tus, 2),
        "speedup": round(tus / us, 2),
        "machine": machine_description(),
    }
    rows = [
        ("requests", f"{n} x {REQUEST_TOKENS} tokens, page {PAGE_SIZE}"),
        ("compiled table", f"{us:.1f} us/request"),
        ("transitions", f"{tus:.1f} us/request"),
        ("speedup", f"{tus / us:.2f}x"),
    ]
    report("controller overhead: match + insert + backup + acks", rows, result, getattr(args, "json", False))
    return result
