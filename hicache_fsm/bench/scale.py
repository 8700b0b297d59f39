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
  ``match_miss_us``: nothing cached. Each of ours packs the request's ids
  afresh: the packings a match made for an insert to come are not kept
  (``RequestIds.keep_earlier(0)``), or the requests these rows match in turn,
  never inserted, would be packed once;
- ``insert_us``: ``insert`` of a new request under a cached prompt (with the
  backup job it emits, and the host eviction that makes room for it);
  ``insert_nobackup_us``: the same with that backup started once the clock
  has stopped (the baselines back nothing up);
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
cost. Every operation is timed, chunk by chunk interleaved, on two same-run
baselines doing the same work (``bench.baselines``: ``plain``, a dict of
page tuples; ``sglang``, a minimal re-implementation of SGLang RadixCache's
loop, which takes lists as SGLang's keys hold them), and reported as ratios
``vs_plain`` / ``vs_sglang`` (ours / theirs), so a regression shows on any
machine. ``bytes_per_node`` is the resident memory the fill took per node
(RSS delta: torch's slot tensors live outside tracemalloc's view), the
baselines' beside it. Each size runs in its own interpreter so
``peak_rss_mb`` is that size's peak.

Ours is timed with ids in two forms, interleaved on the same cache: ``ours``
takes each request's 4,096 ids on every call in the form ``--ids`` names
(the call checks and packs them), and ``ours packed`` (``packed_*`` and
``vs_*_packed_*``) takes a ``TokenIds`` the engine packed once when the
request arrived. ``--ids array`` (default) hands ours the ``array('q')``
SGLang's scheduler holds a request's ids in, the very form the SGLang peer is
handed, so ``vs_sglang_peer`` compares the same input; ``tuple`` and ``list``
are the Python forms, and with either the peer is handed lists (its
``RadixKey`` takes them; SGLang keeps no tuples), so it too pays for Python
ids (``ids`` in the result names each variant's form). ``insert`` right
after ``match_prefix`` of a tuple or list holding the same ids (its items
compared with those last packed) reuses that call's packing, and so does an
array holding the same ids (its bytes compared); a miss checks and packs its first
page only, whatever the form. The packing
of a 4,096-id tuple is timed apart as ``pack_us``: add it once per request to
the packed figures. Ratios against the smallest size are printed: the targets are
``evict_us`` and ``cycle_us`` within 2x and match / insert / lock within 1.5x
from 1k to 1M nodes. ``--headroom-pages`` sets ``CacheConfig.eviction_headroom_tokens``
(``alloc_device`` and ``load_back`` evict that many pages beyond the
shortfall: a low watermark), to measure whether that pays.

``--peer`` adds SGLang's own ``RadixCache`` (``bench.sglang_peer``) as a third
same-run variant, ``sglang_peer``, with ratios ``vs_sglang_peer``: ``auto``
(default) when ``sglang`` is importable (else one line on stderr says why not,
and the bench runs without it), ``sglang`` requires it (exit 2 when missing),
``none`` skips it. Its full hit is also timed without reading the slots
(``sglang_peer_match_bare_us``: SGLang's ``match_prefix`` returns a length and
a node; ours returns the slots).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import random
import resource
import statistics
import subprocess
import sys

import torch

from hicache_fsm.bench import sglang_peer
from hicache_fsm.bench.baselines import PlainPrefixCache, RadixLikeSGLang
from hicache_fsm.bench.common import CLOCKS, ID_FORMS, machine_description
from hicache_fsm.executors import AckExecutor
from hicache_fsm.cache import HiCache
from hicache_fsm.commands.args import UsageError, check_fits, non_negative_int, positive_int, seed_int
from hicache_fsm.config import CacheConfig
from hicache_fsm.pools import DeviceKVPool, HostKVPool, KVShape
from hicache_fsm.tokens import pack_token_ids

PAGE = 64
REQUEST = 4096
PROMPT = 1024
VOCAB = 32000
SIZES = (1_000, 10_000, 100_000, 1_000_000)
QUICK_SIZES = (100, 1_000)
KEYS = ("match_us", "insert_us", "lock_us", "evict_us", "cycle_us")
MIN_NODES = 64  # the evict row evicts 64 one-page prefixes a call
NODE_BYTES = 4096  # a node of the tree in ours and the baselines together (their bytes_per_node, measured, with room)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default=None,
                        help=f"comma-separated node counts, each at least {MIN_NODES} and within what memory holds "
                             f"at {NODE_BYTES} bytes a node (default 1000,10000,100000,1000000)")
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats, for a smoke test")
    parser.add_argument("--chunks", type=positive_int, default=None,
                        help="timed chunks per operation (default 7; quick 3)")
    parser.add_argument("--headroom-pages", type=non_negative_int, default=0,
                        help="CacheConfig.eviction_headroom_tokens in pages: evicted beyond the shortfall (default 0)")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="cpu",
                        help="time with process CPU time (cpu, default: steadier on a machine shared with other "
                             "work) or perf_counter (wall)")
    parser.add_argument("--seed", type=seed_int, default=0)
    parser.add_argument("--in-process", action="store_true",
                        help="run every size in this interpreter (peak RSS then accumulates)")
    parser.add_argument("--ids", choices=tuple(ID_FORMS), default="array",
                        help="the form ours is handed each request's ids in on every call: array (default: "
                             "array('q'), as SGLang's scheduler holds them), tuple or list (the SGLang peer then "
                             "gets lists)")
    parser.add_argument("--peer", choices=("auto", "sglang", "none"), default="auto",
                        help="also time SGLang's own RadixCache in the same run: auto (default) when sglang is "
                             "importable, sglang to require it, none to skip it")


class RequestTokens:
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


OPS = ("match_us", "match_partial_us", "match_miss_us", "insert_us", "lock_us", "evict_us", "cycle_us")
ID_OPS = ("match_us", "match_partial_us", "match_miss_us", "insert_us", "cycle_us")  # the ops that take ids
BASELINES = ("plain", "sglang")


def _rss() -> int:
    """Resident set size in bytes (Linux; 0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return 0


def _interleaved(fns: dict, chunks: int, calls: dict, pc) -> dict[str, float]:
    """Median over ``chunks`` of the mean microseconds per call of each ``fn(i, clock)``; the variants alternate
    chunk by chunk so machine noise hits them alike (gc off while timing)."""
    per_call: dict[str, list[float]] = {name: [] for name in fns}
    counter = dict.fromkeys(fns, 0)
    for _ in range(chunks):
        for name, fn in fns.items():
            gc.collect()
            gc.disable()
            try:
                spent = 0.0
                for _ in range(calls[name]):
                    spent += fn(counter[name], pc)
                    counter[name] += 1
            finally:
                gc.enable()
            per_call[name].append(spent / calls[name] * 1e6)
    return {name: statistics.median(v) for name, v in per_call.items()}


class OursVariant:
    """``HiCache`` doing each operation of the benchmark, the engine handing it ids in one form (``ids``)."""

    name = "ours"

    def __init__(self, nodes: int, warm: int, headroom_pages: int, ids: str = "array", per_call: bool = False) -> None:
        self.ids = ids
        self.per_call = per_call  # ``insert`` is handed another object than its ``match_prefix`` (the form built anew)
        # room for the warm requests and a few more: inserts and cycles soon evict (older requests first)
        self.cache = _cache(nodes, device_requests=warm + 8, host_requests=3 * warm, headroom_pages=headroom_pages)

    def packed_twin(self) -> "OursVariant":
        """The same cache driven with each request's ids packed once as a ``TokenIds`` (``ours_packed``)."""
        twin = copy.copy(self)
        twin.name, twin.ids = "ours_packed", "packed"
        return twin

    def fill(self, nodes: int) -> None:
        _fill(self.cache, nodes)

    def put(self, tokens: tuple) -> None:
        _put(self.cache, tokens)

    def match(self, tokens: tuple) -> object:
        return self.cache.match_prefix(tokens)

    def leaf(self, tokens: tuple) -> object:
        return self.cache.match_prefix(tokens).last_device_node

    def engine_form(self, tokens: tuple):
        """What the engine hands the cache (untimed): the request's ids in the form ``ids`` names (see
        ``ID_FORMS``), packed by the calls that take them, or a ``TokenIds`` packed once per request."""
        return pack_token_ids(tokens) if self.ids == "packed" else ID_FORMS[self.ids][0](tokens)

    def lock(self, node) -> None:
        self.cache.lock(node)
        self.cache.unlock(node)

    def insert_timed(self, tokens: tuple, pc) -> float:
        spent = self._insert(tokens, pc)
        self._settle()
        return spent

    def _insert(self, tokens: tuple, pc) -> float:
        """Match and allocate (untimed), then the timed ``insert``."""
        cache = self.cache
        matched = self.engine_form(tokens)
        m = cache.match_prefix(matched)
        idx = torch.cat([m.device_indices, cache.alloc_device(len(tokens) - m.device_hit_length)])
        form = self.engine_form(tokens) if self.per_call else matched
        t0 = pc()
        cache.insert(form, idx)
        return pc() - t0

    def _settle(self) -> None:
        """Two polls (untimed): the backup the insert started completes."""
        self.cache.poll()
        self.cache.poll()

    def insert_parts_timed(self, tokens: tuple, pc) -> tuple[float, float]:
        """``insert_timed``, and the part of it spent starting the host backup (work the baselines do not do).

        The backup is timed by wrapping ``Eviction.try_backup`` for the insert only: its clock calls add to the
        total here, never to ``insert_timed``'s.
        """
        eviction = self.cache.eviction
        backup = eviction.try_backup
        backup_spent = 0.0

        def timed_backup(node) -> bool:
            nonlocal backup_spent
            t0 = pc()
            try:
                return backup(node)
            finally:
                backup_spent += pc() - t0

        eviction.try_backup = timed_backup
        try:
            spent = self._insert(tokens, pc)
        finally:
            del eviction.try_backup  # the class's method again
        self._settle()
        return spent, backup_spent

    def insert_without_backup_timed(self, tokens: tuple, pc) -> float:
        """``insert_timed`` less the host backup it starts: the insert's calls to ``Eviction.try_backup`` are held
        and made, in order, once the clock has stopped (``insert`` reads nothing they return), so no clock is read
        inside the insert (``insert_parts_timed``'s reads would cost the insert the part of a read either side)."""
        eviction = self.cache.eviction
        held: list = []
        eviction.try_backup = held.append
        try:
            spent = self._insert(tokens, pc)
        finally:
            del eviction.try_backup  # the class's method again
        for node in held:
            eviction.try_backup(node)
        self._settle()
        return spent

    def cycle(self, t: tuple) -> None:
        cache = self.cache
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


class BaselineVariant:
    """A baseline prefix cache (``bench.baselines``, or the SGLang peer) behind the same operations, with a device
    budget in tokens."""

    def __init__(self, name: str, nodes: int, warm: int, cache=None) -> None:
        self.name = name
        if cache is not None:
            self.cache, self._form = cache, cache.engine_form
        elif name == "plain":
            self.cache, self._form = PlainPrefixCache(PAGE), tuple
        else:
            self.cache, self._form = RadixLikeSGLang(PAGE), list  # SGLang keys held lists before array('q')
        self.capacity = nodes * PAGE + (warm + 8) * REQUEST
        self.used = 0
        self._slots = torch.arange(self.capacity, dtype=torch.int64)

    def fill(self, nodes: int) -> None:
        tail = tuple(range(1, PAGE))
        for i in range(nodes):
            self.cache.insert(self._form((VOCAB + i,) + tail), self._slots[i * PAGE : (i + 1) * PAGE])
        self.used = nodes * PAGE

    def restore_page(self, tokens: tuple) -> None:
        """Insert a one-page prefix if it is not cached (the evict benchmark puts its victims back)."""
        key = self._form(tokens)
        if not self.cache.match_prefix(key)[0].numel():
            self.cache.insert(key, self._slots[:PAGE])

    def _alloc(self, n: int) -> torch.Tensor:
        if self.used + n > self.capacity:
            self.used -= self.cache.evict(self.used + n - self.capacity)
        return self._slots[:n]  # slot values do not matter to a baseline: only the work does

    def put(self, tokens: tuple) -> None:
        self.cycle(tokens)

    def match(self, tokens) -> object:
        return self.cache.match_prefix(tokens)

    def leaf(self, tokens: tuple) -> object:
        return self.cache.match_prefix(tokens)[1]

    def engine_form(self, tokens: tuple):
        """What the engine would hand this cache (untimed)."""
        return self._form(tokens)

    def lock(self, node) -> None:
        self.lock_node(node, 1)
        self.lock_node(node, -1)

    def insert_timed(self, tokens: tuple, pc) -> float:
        tokens = self.engine_form(tokens)
        indices, _ = self.cache.match_prefix(tokens)
        new = len(tokens) - indices.numel()
        idx = torch.cat([indices, self._alloc(new)])
        t0 = pc()
        self.cache.insert(tokens, idx)
        spent = pc() - t0
        self.used += new
        return spent

    def cycle(self, t: tuple) -> None:
        indices, node = self.cache.match_prefix(t)
        self.lock_node(node, 1)
        idx = self._alloc(len(t) - indices.numel())
        self.cache.insert(t, torch.cat([indices, idx]))
        self.used += len(t) - indices.numel()
        self.lock_node(node, -1)

    def lock_node(self, node, delta: int) -> None:
        if isinstance(self.cache, PlainPrefixCache):
            self.cache.lock(node, delta)
        elif delta > 0:
            self.cache.inc_lock_ref(node)
        else:
            self.cache.dec_lock_ref(node)


def _timed(pc, fn, arg) -> float:
    t0 = pc()
    fn(arg)
    return pc() - t0


def _filled(variant, nodes: int) -> int:
    """Fill ``variant`` with ``nodes`` one-page prefixes; the resident memory that took, per node."""
    gc.collect()
    before = _rss()
    variant.fill(nodes)
    gc.collect()
    return max(0, _rss() - before) // nodes


def measure(nodes: int, chunks: int, calls: int, headroom_pages: int, seed: int, warmup_cycles: int = 64,
            clock: str = "cpu", baselines: tuple[str, ...] = BASELINES,
            peer: sglang_peer.SGLangRadix | None = None, ids: str = "array") -> dict:
    """Every figure at one tree size, ours and each baseline's (and SGLang's own with ``peer``), interleaved (see
    the module docstring)."""
    pc = CLOCKS[clock]
    warm = 16
    ours = OursVariant(nodes, warm, headroom_pages, ids)
    ours.cache.request_ids.keep_earlier(0)  # every match packs afresh (see the module docstring)
    variants = [ours] + [BaselineVariant(name, nodes, warm) for name in baselines]
    peer_ids = sglang_peer.peer_form(ids)  # the form the peer is handed
    if peer is not None:
        peer_cache = sglang_peer.SGLangRadixPeer(peer, PAGE, peer_ids)
        variants.append(BaselineVariant(sglang_peer.NAME, nodes, warm, peer_cache))
    out: dict = {"nodes": nodes, "baselines": [v.name for v in variants[1:]], "bytes_per_node": _filled(ours, nodes)}
    if peer is not None:
        out["sglang_peer_version"] = peer.version
    for v in variants[1:]:
        out[f"{v.name}_bytes_per_node"] = _filled(v, nodes)
    out["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    # baselines evict by scanning every leaf (as SGLang does): give them few calls at large sizes
    scan_calls = max(1, min(calls // 8, 2_000_000 // (nodes * 8) or 1))
    # ---- evict 64 pages from a full device; the victims come back (untimed) before the next call
    cache = ours.cache
    free = cache.device_allocator.available_tokens
    held = cache.alloc_device(free - free % PAGE)  # the engine holds every free page: the next come from eviction
    victims: list = []

    def observe(event: dict) -> None:
        if event.get("trigger") == "evict_device":
            victims.append(event["node"])

    cache.add_observer(observe)

    def evict_ours(i, pc):
        victims.clear()
        t0 = pc()
        freed = cache.evict(64 * PAGE)
        spent = pc() - t0  # the observer is timed too: a few hundred ns per victim, at every size alike
        if freed < 64 * PAGE:
            raise RuntimeError(f"evict freed {freed} tokens, wanted {64 * PAGE}")
        for nid in list(victims):
            node = cache.tree.get(nid)
            if node is not None and cache.load_back(node) is None:
                raise RuntimeError("the benchmark could not reload an evicted node")
        cache.poll()
        cache.poll()
        return spent

    def evict_baseline(v):
        tail = tuple(range(1, PAGE))
        order = iter(range(1 << 62))

        def evict(i, pc):
            t0 = pc()
            freed = v.cache.evict(64 * PAGE)
            spent = pc() - t0
            if freed < 64 * PAGE:
                raise RuntimeError(f"{v.name} evict freed {freed} tokens, wanted {64 * PAGE}")
            for _ in range(64):  # LRU took the 64 oldest prefixes: put them back (now the newest), untimed
                v.restore_page((VOCAB + next(order) % nodes,) + tail)
            return spent
        return evict

    evict_fns = {"ours": evict_ours}
    evict_fns.update({v.name: evict_baseline(v) for v in variants[1:]})
    evict_calls = {"ours": max(1, calls // 8)} | {v.name: scan_calls for v in variants[1:]}
    results = {"evict_us": _interleaved(evict_fns, chunks, evict_calls, pc)}
    cache.free_device(held)
    cache.remove_observer(observe)

    packed = ours.packed_twin()  # ours again, each request's ids packed once as a TokenIds: same cache
    timed = variants + [packed]  # the variants of every operation that takes ids
    tok = {v.name: RequestTokens(seed) for v in variants}  # every variant sees the same token stream
    tok[packed.name] = tok[ours.name]  # one cache, one stream: neither form meets a request the other inserted
    requests = {v.name: [v.engine_form(tok[v.name].request()) for _ in range(warm)] for v in timed}
    for v in timed:
        for r in requests[v.name]:
            v.put(r)
    partial = {v.name: [v.engine_form(tok[v.name].prompt + tok[v.name].fresh(REQUEST - PROMPT)) for _ in range(64)]
               for v in timed}
    miss_ids = {v.name: [tok[v.name].fresh(REQUEST) for _ in range(64)] for v in timed}
    misses = {v.name: [v.engine_form(t) for t in miss_ids[v.name]] for v in timed}
    leaves = {v.name: [v.leaf(r) for r in requests[v.name]] for v in variants}
    # an engine holding its ids in an integer tensor: packed by numpy, no per-id Python work
    misses["ours_tensor"] = [torch.tensor(t, dtype=torch.int32) for t in miss_ids["ours"]]

    def timed_call(v, inputs, op):
        def fn(i, pc):
            t = inputs[v.name][i % len(inputs[v.name])]
            t0 = pc()
            op(v)(t)
            return pc() - t0
        return fn

    every = {v.name: calls for v in timed}
    match_fns = {v.name: timed_call(v, requests, lambda v: v.match) for v in timed}
    bare = "sglang_peer_bare"
    if peer is not None:  # SGLang's match_prefix alone: a length and a node, no slots read
        match_fns[bare] = lambda i, pc: _timed(pc, variants[-1].cache.match_length,
                                               requests[sglang_peer.NAME][i % warm])
    results["match_us"] = _interleaved(match_fns, chunks, every | {bare: calls}, pc)
    if peer is not None:
        bare_us = results["match_us"].pop(bare)
        out["sglang_peer_match_bare_us"] = round(bare_us, 2)
        out["vs_sglang_peer_match_bare"] = round(results["match_us"]["ours"] / bare_us, 3) if bare_us else None
    results["match_partial_us"] = _interleaved(
        {v.name: timed_call(v, partial, lambda v: v.match) for v in timed}, chunks, every, pc)
    miss_fns = {v.name: timed_call(v, misses, lambda v: v.match) for v in timed}
    miss_fns["ours_tensor"] = lambda i, pc: _timed(pc, ours.match, misses["ours_tensor"][i % 64])
    miss_fns["pack"] = lambda i, pc: _timed(pc, pack_token_ids, miss_ids["ours"][i % 64])  # a tuple, once a request
    results["match_miss_us"] = _interleaved(miss_fns, chunks, every | {"ours_tensor": calls, "pack": calls}, pc)
    out["pack_us"] = round(results["match_miss_us"].pop("pack"), 2)
    tensor_miss = results["match_miss_us"].pop("ours_tensor")
    out["match_miss_tensor_us"] = round(tensor_miss, 2)
    for v in variants[1:]:
        base = results["match_miss_us"][v.name]
        out[f"vs_{v.name}_match_miss_tensor"] = round(tensor_miss / base, 3) if base else None
    results["lock_us"] = _interleaved({v.name: timed_call(v, leaves, lambda v: v.lock) for v in variants},
                                      chunks, every, pc)
    insert_fns = {v.name: (lambda v: lambda i, pc: v.insert_timed(tok[v.name].request(), pc))(v) for v in timed}
    insert_fns["ours_nobackup"] = lambda i, pc: ours.insert_without_backup_timed(tok["ours"].request(), pc)
    results["insert_us"] = _interleaved(insert_fns, chunks, {name: max(1, calls // 4) for name in insert_fns}, pc)
    nobackup = results["insert_us"].pop("ours_nobackup")
    out["insert_nobackup_us"] = round(nobackup, 2)
    for v in variants[1:]:
        base = results["insert_us"][v.name]
        out[f"vs_{v.name}_insert_nobackup"] = round(nobackup / base, 3) if base else None

    # ---- the request cycle under device pressure (ours: with host backup and load-backs)
    def cycle_fn(v):
        seen: list[tuple[int, ...]] = []
        rng = random.Random(seed + 1)

        def cycle(i, pc):
            if seen and rng.random() < 1 / 3:
                t = seen[rng.randrange(len(seen))]
            else:
                t = tok[v.name].request()
                seen.append(t)
            return _timed(pc, v.cycle, v.engine_form(t))
        return cycle

    cycles = {v.name: cycle_fn(v) for v in timed}
    for v in timed:  # reach the steady state: device full (ours: host full too)
        for _ in range(warmup_cycles if isinstance(v, OursVariant) else min(warmup_cycles, 4 * scan_calls)):
            cycles[v.name](-1, pc)
    results["cycle_us"] = _interleaved(cycles, chunks, dict.fromkeys(("ours", packed.name), max(1, calls // 4))
                                       | {v.name: min(max(1, calls // 4), scan_calls) for v in variants[1:]}, pc)
    cache.poll()
    out["ids"] = {"ours": ID_FORMS[ids][1], "packed": "a TokenIds packed once per request"}
    if peer is not None:
        out["ids"][sglang_peer.NAME] = sglang_peer.PEER_FORMS[peer_ids][1]
    for key, by_variant in results.items():
        out[key] = round(by_variant["ours"], 2)
        for v in variants[1:]:
            base = by_variant[v.name]
            out[f"{v.name}_{key}"] = round(base, 2)
            out[f"vs_{v.name}_{key[:-3]}"] = round(by_variant["ours"] / base, 3) if base else None
        if packed.name in by_variant:  # the ops that take ids, ours again with them packed once per request
            mine = by_variant[packed.name]
            out[f"packed_{key}"] = round(mine, 2)
            for v in variants[1:]:
                base = by_variant[v.name]
                out[f"vs_{v.name}_packed_{key[:-3]}"] = round(mine / base, 3) if base else None
    out["tree_nodes_after"] = len(cache.tree)
    out["evicted_device_tokens"] = cache.counters["evicted_device_tokens"]
    out["loaded_back_tokens"] = cache.counters["loaded_back_tokens"]
    out["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return out


def check_nodes(nodes: int, flag: str) -> int:
    """``nodes``, or ``UsageError`` when trees of that many nodes (ours and each baseline's) would not fit in memory."""
    return check_fits(nodes, NODE_BYTES, flag, f"{NODE_BYTES} bytes a node for ours and the baselines")


def _sizes(args: argparse.Namespace) -> list[int]:
    if args.sizes is not None:
        try:
            sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
        except ValueError:
            raise UsageError(f"--sizes wants comma-separated integers; got {args.sizes[:80]!r}") from None
        if not sizes or min(sizes) < MIN_NODES:
            raise UsageError(f"--sizes wants node counts of at least {MIN_NODES}")
        check_nodes(max(sizes), "--sizes node count")
        return sizes
    return list(QUICK_SIZES if args.quick else SIZES)


def resolve_peer(choice: str, bench: str = "scale") -> sglang_peer.SGLangRadix | None:
    """SGLang's ``RadixCache`` when ``--peer`` asks for it and it imports; ``--peer sglang`` without it is a usage
    error, ``auto`` says in one line (naming ``bench``) that it runs without it."""
    if choice == "none":
        return None
    try:
        return sglang_peer.load()
    except sglang_peer.PeerUnavailable as exc:
        if choice == "sglang":
            raise UsageError(f"--peer sglang: {exc}") from None
        print(f"bench {bench}: no SGLang peer: {exc}; the baselines run without it (--peer none to skip the check)",
              file=sys.stderr)
        return None


def _one_size_in_subprocess(n: int, args: argparse.Namespace, peer: bool) -> dict:
    cmd = [sys.executable, "-m", "hicache_fsm.cli", "bench", "scale", "--in-process", "--json", "--sizes", str(n),
           "--headroom-pages", str(args.headroom_pages), "--seed", str(args.seed), "--clock", args.clock,
           "--peer", "sglang" if peer else "none", "--ids", args.ids]
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
    calls = 16 if args.quick else 64
    peer = resolve_peer(getattr(args, "peer", "auto"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if args.in_process or len(sizes) == 1:
            warmup = 8 if args.quick else 64
            per_size = [measure(n, chunks, calls, args.headroom_pages, args.seed, warmup, args.clock, peer=peer,
                                 ids=args.ids) for n in sizes]
        else:
            per_size = [_one_size_in_subprocess(n, args, peer is not None) for n in sizes]
    finally:
        torch.set_num_threads(threads)
    names = per_size[0]["baselines"]
    result: dict = {"nodes": [r["nodes"] for r in per_size], "baselines": names}
    if peer is not None:
        result["sglang_peer_version"] = peer.version
        result["sglang_peer_match_bare_us"] = [r["sglang_peer_match_bare_us"] for r in per_size]
        result["vs_sglang_peer_match_bare"] = [r["vs_sglang_peer_match_bare"] for r in per_size]
    for key in OPS + ("peak_rss_mb", "bytes_per_node"):
        result[key] = [r[key] for r in per_size]
    for name in names:
        result[f"{name}_bytes_per_node"] = [r[f"{name}_bytes_per_node"] for r in per_size]
        result[f"vs_{name}"] = {key[:-3]: [r[f"vs_{name}_{key[:-3]}"] for r in per_size] for key in OPS}
    result["ids"] = per_size[0]["ids"]
    result["pack_us"] = [r["pack_us"] for r in per_size]
    result["packed"] = {key: [r[f"packed_{key}"] for r in per_size] for key in ID_OPS}
    for name in per_size[0].get("baselines", BASELINES):  # every baseline of the run (a peer too, where one ran)
        result[f"vs_{name}_packed"] = {key[:-3]: [r[f"vs_{name}_packed_{key[:-3]}"] for r in per_size] for key in ID_OPS}
    base = per_size[0]
    result["growth"] = {k: round(per_size[-1][k] / base[k], 2) if base[k] else None for k in KEYS}
    result["headroom_pages"] = args.headroom_pages
    result["clock"] = args.clock
    result["per_size"] = per_size
    result["machine"] = machine_description()
    out = sys.stderr if getattr(args, "json", False) else sys.stdout
    print(f"controller cost per operation against tree size (page {PAGE}, {REQUEST}-token requests, "
          f"median of {chunks} interleaved chunks, {args.clock} clock)", file=out)
    cols = ["nodes"] + list(OPS) + ["bytes_per_node", "peak_rss_mb"]
    print("  " + "  ".join(c.rjust(16) for c in cols), file=out)
    for r in per_size:
        print("  " + "  ".join(str(r[c]).rjust(16) for c in cols), file=out)
        for name in names:
            row = [f"/ {name}"] + [f"{r[f'vs_{name}_{c[:-3]}']}x" for c in OPS] + [
                f"{r['bytes_per_node'] / r[f'{name}_bytes_per_node']:.2f}x" if r[f"{name}_bytes_per_node"] else "-", ""]
            print("  " + "  ".join(c.rjust(16) for c in row), file=out)
        print("  " + "  ".join(c.rjust(16) for c in ["ours packed"] + [
            str(r[f"packed_{c}"]) if c in ID_OPS else "-" for c in OPS]), file=out)
        for name in r.get("baselines", BASELINES):
            row = [f"/ {name}"] + [f"{r[f'vs_{name}_packed_{c[:-3]}']}x" if c in ID_OPS else "-" for c in OPS]
            print("  " + "  ".join(c.rjust(16) for c in row), file=out)
        print(f"  ids ({REQUEST} a request): ours takes {r['ids']['ours']}; ours packed takes a TokenIds packed "
              f"once per request (a tuple took {r['pack_us']} us to pack)"
              + (f"; the SGLang peer takes {r['ids'][sglang_peer.NAME]}" if sglang_peer.NAME in r["ids"] else ""),
              file=out)
        print(f"  insert without the host backup it starts: {r['insert_nobackup_us']} us ("
              + ", ".join(f"{r[f'vs_{name}_insert_nobackup']}x {name}" for name in names) + ")", file=out)
        if peer is not None:
            print(f"  SGLang {peer.version} match_prefix alone (no slots read): {r['sglang_peer_match_bare_us']} us "
                  f"(ours / it: {r['vs_sglang_peer_match_bare']}x)", file=out)
    print(f"  growth {per_size[0]['nodes']} -> {per_size[-1]['nodes']} nodes: "
          + ", ".join(f"{k} {v}x" for k, v in result["growth"].items()), file=out)
    print("  ratios: ours / same-run baseline doing the same work (plain: a dict of page tuples; sglang: a "
          "re-implementation of SGLang RadixCache's loop, see hicache_fsm.bench.baselines"
          + ("; sglang_peer: SGLang's own RadixCache, see hicache_fsm.bench.sglang_peer)" if peer else ")"), file=out)
    if getattr(args, "json", False):
        print(json.dumps(result))
    return result
