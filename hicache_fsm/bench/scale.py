"""Per-operation cost against the size of the tree: does the controller stay flat at 10^6 nodes?

For each size N (default 1k, 10k, 100k and 1M cached nodes, page 64), a
fresh cache is filled with N one-page prefixes, every one backed up to the
host (write_through), plus a few 4,096-token requests sharing a system
prompt. The eviction policy is ``priority`` with the prefixes at priority 1,
so they stay eviction candidates (the heaps hold N entries) while the
victims of the request cycle are requests at every size (under LRU a small
tree would run out of old prefixes and change what a cycle evicts). Then,
each as the median over repeated chunks of calls:

- ``match_us``: ``match_prefix`` of a cached 4,096-token request (full hit);
  ``match_partial_us``: its 1,024-token system prompt cached, the rest new;
  ``match_miss_us``: nothing cached;
- ``insert_us``: ``insert`` of a new request under a cached prompt (with the
  backup job it emits);
- ``lock_us``: ``lock`` + ``unlock`` of a cached request's leaf;
- ``evict_us``: ``evict`` of 64 pages from a full device, measured right
  after the fill (64 one-page victims, loaded back untimed before the next
  call, so the tree keeps its size);
- ``cycle_us``: the full request cycle under device pressure with host
  backup: ``match_prefix``, ``load_back`` of a host hit, ``lock``,
  ``alloc_device`` (which evicts), ``insert`` (with its backup, which may
  evict host KV), ``unlock``, ``poll``. A third of the requests repeat an
  earlier one whose suffix was evicted to the host, so load-backs happen.

The KV is metadata-sized (one int8 per token and layer) and ``AckExecutor``
acknowledges jobs without copying: the figures are the controller's own
cost. Each size runs in its own interpreter so ``peak_rss_mb`` is that
size's peak. Ratios against the smallest size are printed: the targets are
``evict_us`` and ``cycle_us`` within 2x and match / insert / lock within 1.5x
from 1k to 1M nodes. ``--headroom-pages`` sets ``CacheConfig.eviction_headroom_tokens``
(``alloc_device`` and ``load_back`` evict that many pages beyond the
shortfall: a low watermark), to measure whether that pays.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import resource
import statistics
import subprocess
import sys
import time

import torch

from hicache_fsm.bench.common import machine_description
from hicache_fsm.bench.controller import AckExecutor
from hicache_fsm.cache import HiCache
from hicache_fsm.config import CacheConfig
from hicache_fsm.pools import DeviceKVPool, HostKVPool, KVShape

PAGE = 64
REQUEST = 4096
PROMPT = 1024
VOCAB = 32000
SIZES = (1_000, 10_000, 100_000, 1_000_000)
QUICK_SIZES = (100, 1_000)
KEYS = ("match_us", "insert_us", "lock_us", "evict_us", "cycle_us")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default=None,
                        help="comma-separated node counts (default 1000,10000,100000,1000000)")
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats, for a smoke test")
    parser.add_argument("--chunks", type=int, default=None, help="timed chunks per operation (default 7; quick 3)")
    parser.add_argument("--headroom-pages", type=int, default=0,
                        help="CacheConfig.eviction_headroom_tokens in pages: evicted beyond the shortfall (default 0)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time with perf_counter (wall, default) or process CPU time (cpu: steadier on a "
                             "machine shared with other work)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--in-process", action="store_true",
                        help="run every size in this interpreter (peak RSS then accumulates)")


class _Tokens:
    """Deterministic token tuples: fillers, a system prompt, requests."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.prompt = self.fresh(PROMPT)

    def fresh(self, n: int) -> tuple[int, ...]:
        r = self.rng.randrange
        return tuple(r(1, VOCAB) for _ in range(n))

    def request(self) -> tuple[int, ...]:
        return self.prompt + self.fresh(REQUEST - PROMPT)


def _cache(nodes: int, device_requests: int, host_requests: int, headroom_pages: int = 0) -> HiCache:
    shape = KVShape(layers=1, heads=1, head_dim=1, dtype=torch.int8)
    device = DeviceKVPool(shape, nodes * PAGE + device_requests * REQUEST, PAGE, "cpu")
    host = HostKVPool(shape, nodes * PAGE + host_requests * REQUEST, PAGE, pin_memory=False)
    config = CacheConfig(write_policy="write_through", eviction_policy="priority",
                         eviction_headroom_tokens=headroom_pages * PAGE)
    return HiCache(device, host, config, AckExecutor())


def _fill(cache: HiCache, nodes: int) -> None:
    """``nodes`` one-page prefixes (first token outside the request vocabulary), each backed up."""
    tail = tuple(range(1, PAGE))
    for i in range(nodes):
        cache.insert((VOCAB + i,) + tail, cache.alloc_device(PAGE), priority=1)
        if i % 1024 == 1023:
            cache.poll()
            cache.poll()
    cache.poll()
    cache.poll()


def _put(cache: HiCache, tokens: tuple[int, ...]) -> None:
    m = cache.match_prefix(tokens)
    cache.lock(m.last_device_node)
    new = cache.alloc_device(len(tokens) - m.device_hit_length)
    cache.insert(tokens, torch.cat([m.device_indices, new]))
    cache.unlock(m.last_device_node)
    cache.poll()
    cache.poll()


_CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}


def _chunks(fn, chunks: int, calls: int, pc=time.perf_counter) -> float:
    """Median over ``chunks`` of the mean microseconds per call of ``fn(i, clock)`` (gc off while timing)."""
    per_call = []
    i = 0
    for _ in range(chunks):
        gc.collect()
        gc.disable()
        try:
            spent = 0.0
            for _ in range(calls):
                spent += fn(i, pc)
                i += 1
        finally:
            gc.enable()
        per_call.append(spent / calls * 1e6)
    return statistics.median(per_call)


def measure(nodes: int, chunks: int, calls: int, headroom_pages: int, seed: int, warmup_cycles: int = 64,
            clock: str = "wall") -> dict:
    """Every figure at one tree size (see the module docstring)."""
    pc = _CLOCK[clock]
    tok = _Tokens(seed)
    warm = 16
    # room for the warm requests and a few more: inserts and cycles soon evict (older requests first)
    cache = _cache(nodes, device_requests=warm + 8, host_requests=3 * warm, headroom_pages=headroom_pages)
    _fill(cache, nodes)
    # ---- evict 64 pages from a full device; the victims come back (untimed) before the next call
    free = cache.device_allocator.available_tokens
    held = cache.alloc_device(free - free % PAGE)  # the engine holds every free page: the next come from eviction
    victims: list = []

    def observe(event: dict) -> None:
        if event.get("trigger") == "evict_device":
            victims.append(event["node"])

    cache.add_observer(observe)

    def evict(i, pc):
        victims.clear()
        t0 = pc()
        freed = cache.evict(64 * PAGE)
        spent = pc() - t0  # the observer is timed too: a few hundred ns per victim, at every size alike
        if freed < 64 * PAGE:
            raise RuntimeError(f"evict freed {freed} tokens, wanted {64 * PAGE}")
        ids = list(victims)
        for nid in ids:
            node = cache.tree.get(nid)
            if node is not None and cache.load_back(node) is None:
                raise RuntimeError("the benchmark could not reload an evicted node")
        cache.poll()
        cache.poll()
        return spent

    evict_us = _chunks(evict, chunks, max(1, calls // 8), pc)
    cache.free_device(held)
    cache.remove_observer(observe)

    requests = [tok.request() for _ in range(warm)]
    for r in requests:
        _put(cache, r)

    def match_full(i, pc):
        t = requests[i % warm]
        t0 = pc()
        cache.match_prefix(t)
        return pc() - t0

    partial = [tok.prompt + tok.fresh(REQUEST - PROMPT) for _ in range(64)]

    def match_partial(i, pc):
        t = partial[i % 64]
        t0 = pc()
        cache.match_prefix(t)
        return pc() - t0

    misses = [tok.fresh(REQUEST) for _ in range(64)]

    def match_miss(i, pc):
        t = misses[i % 64]
        t0 = pc()
        cache.match_prefix(t)
        return pc() - t0

    leaves = [cache.match_prefix(r).last_device_node for r in requests]

    def lock(i, pc):
        node = leaves[i % warm]
        t0 = pc()
        cache.lock(node)
        cache.unlock(node)
        return pc() - t0

    out = {"nodes": nodes, "evict_us": evict_us}
    out["match_us"] = _chunks(match_full, chunks, calls, pc)
    out["match_partial_us"] = _chunks(match_partial, chunks, calls, pc)
    out["match_miss_us"] = _chunks(match_miss, chunks, calls, pc)
    out["lock_us"] = _chunks(lock, chunks, calls, pc)

    insert_calls = max(1, calls // 4)

    def insert(i, pc):
        t = tok.request()
        m = cache.match_prefix(t)
        idx = torch.cat([m.device_indices, cache.alloc_device(REQUEST - m.device_hit_length)])
        t0 = pc()
        cache.insert(t, idx)
        spent = pc() - t0
        cache.poll()
        cache.poll()
        return spent

    out["insert_us"] = _chunks(insert, chunks, insert_calls, pc)

    # ---- the request cycle under device pressure with host backup
    seen: list[tuple[int, ...]] = []
    rng = random.Random(seed + 1)

    def cycle(i, pc):
        if seen and rng.random() < 1 / 3:
            t = seen[rng.randrange(len(seen))]
        else:
            t = tok.request()
            seen.append(t)
        t0 = pc()
        m = cache.match_prefix(t)
        lb = cache.load_back(m.last_host_node) if m.host_hit_length else None
        node = lb.last_node if lb is not None else m.last_device_node
        prefix = torch.cat([m.device_indices, lb.device_indices]) if lb is not None else m.device_indices
        cache.lock(node)
        idx = cache.alloc_device(len(t) - prefix.numel())
        if idx is None:
            raise RuntimeError("the benchmark's device is too small for one request")
        cache.insert(t, torch.cat([prefix, idx]))
        cache.unlock(node)
        cache.poll()
        return pc() - t0

    for _ in range(warmup_cycles):  # reach the steady state: device full, host full
        cycle(-1, pc)
    out["cycle_us"] = _chunks(cycle, chunks, max(1, calls // 4), pc)
    cache.poll()
    out["tree_nodes_after"] = len(cache.tree)
    out["evicted_device_tokens"] = cache.counters["evicted_device_tokens"]
    out["loaded_back_tokens"] = cache.counters["loaded_back_tokens"]
    out["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    for k in list(out):
        if k.endswith("_us"):
            out[k] = round(out[k], 2)
    return out


def _sizes(args: argparse.Namespace) -> list[int]:
    if args.sizes:
        try:
            sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
        except ValueError:
            raise SystemExit(f"--sizes wants comma-separated integers; got {args.sizes!r}") from None
        if not sizes or min(sizes) < 16:
            raise SystemExit("--sizes wants node counts of at least 16")
        return sizes
    return list(QUICK_SIZES if args.quick else SIZES)


def _one_size_in_subprocess(n: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "hicache_fsm.cli", "bench", "scale", "--in-process", "--json", "--sizes", str(n),
           "--headroom-pages", str(args.headroom_pages), "--seed", str(args.seed), "--clock", args.clock]
    if args.chunks is not None:
        cmd += ["--chunks", str(args.chunks)]
    if args.quick:
        cmd.append("--quick")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"bench scale at {n} nodes failed with exit status {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["per_size"][0]


def run(args: argparse.Namespace) -> dict:
    sizes = _sizes(args)
    chunks = args.chunks if args.chunks is not None else (3 if args.quick else 7)
    if chunks <= 0 or args.headroom_pages < 0:
        raise SystemExit("--chunks must be positive and --headroom-pages non-negative")
    calls = 16 if args.quick else 64
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if args.in_process or len(sizes) == 1:
            warmup = 8 if args.quick else 64
            per_size = [measure(n, chunks, calls, args.headroom_pages, args.seed, warmup, args.clock) for n in sizes]
        else:
            per_size = [_one_size_in_subprocess(n, args) for n in sizes]
    finally:
        torch.set_num_threads(threads)
    result: dict = {"nodes": [r["nodes"] for r in per_size]}
    for key in KEYS + ("peak_rss_mb", "match_partial_us", "match_miss_us"):
        result[key] = [r[key] for r in per_size]
    base = per_size[0]
    result["growth"] = {k: round(per_size[-1][k] / base[k], 2) if base[k] else None for k in KEYS}
    result["headroom_pages"] = args.headroom_pages
    result["clock"] = args.clock
    result["per_size"] = per_size
    result["machine"] = machine_description()
    out = sys.stderr if getattr(args, "json", False) else sys.stdout
    print(f"controller cost per operation against tree size (page {PAGE}, {REQUEST}-token requests, "
          f"median of {chunks} chunks)", file=out)
    cols = ["nodes", "match_us", "match_partial_us", "match_miss_us", "insert_us", "lock_us", "evict_us", "cycle_us",
            "peak_rss_mb"]
    print("  " + "  ".join(c.rjust(16) for c in cols), file=out)
    for r in per_size:
        print("  " + "  ".join(str(r[c]).rjust(16) for c in cols), file=out)
    print(f"  growth {per_size[0]['nodes']} -> {per_size[-1]['nodes']} nodes: "
          + ", ".join(f"{k} {v}x" for k, v in result["growth"].items()), file=out)
    if getattr(args, "json", False):
        print(json.dumps(result))
    return result
