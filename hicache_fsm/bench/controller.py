"""Controller overhead per request: HiCache on the compiled table vs through ``transitions``.

Each request is 4,096 tokens (page 64): a shared prefix of 1,024 tokens (one
of 8 system prompts) plus a unique suffix. The engine loop per request is
``match_prefix``, ``alloc_device`` for the uncached part, ``insert``
(write_through: one backup job), ``poll`` (starts the batch) and ``poll``
again (applies the acks). The figure is the time of match + insert (with its
backup) + the two polls; ``alloc_device`` and building the index tensor are
the engine's slot allocation and are left out of both variants.

``--batch N`` matches N requests before inserting any of them, as a
scheduler matches a whole batch before its forward pass (``batch`` in the
result; default 1): per batch, every ``match_prefix``, then every
``insert``, then the two polls, all timed, per request as before.

``--ids`` sets the form the engine holds each request's ids in (``ids`` in
the result): an ``array('q')`` (default: the form SGLang's scheduler holds a
request's ids in; numpy reads it, no per-id Python work), a tuple or a list,
handed to every call, which checks and packs it (``insert`` right after
``match_prefix`` of the same ids in a tuple, a list or an array reuses that
packing); ``list_per_call``:
a list built anew for each call (untimed) from the request's prompt list and
the rest, as a scheduler holding a prompt and an output apart hands their sum
(``insert`` finds its ids equal to those ``match_prefix`` packed); an int64 tensor
(packed by numpy, reused as an array's is); or ``packed``: ``pack_token_ids`` once when
the request arrives, timed with the request, then the ``TokenIds`` to every
call. The forms are built before timing, as the engine holds them.

Copies are not measured: ``executors.AckExecutor`` acknowledges every
batch on the next poll without moving any bytes, and the pools use a
one-element KV shape. Before timing, the tree holds ``--tree-nodes`` other
backed-up prefixes (a serving cache holds tens of thousands of nodes; by
default 10 per timed request).

Baseline: the same loop with ``HiCache(dispatcher=TransitionsDispatcher(...))``,
which fires every residency trigger through ``transitions.Machine`` with one
model per node (``add_model`` when a node is created), as an engine using
``transitions`` directly would. Both caches are built and filled first; the
timed chunks of 100 requests then alternate between them so machine noise
hits both alike, and the best chunk of each is kept. The garbage collector is off while a
chunk runs (as ``timeit`` does).

Result keys: ``us_per_request`` (compiled), ``transitions_us_per_request``,
``speedup`` (their ratio), plus the configuration.

Metrics (with the ``metrics`` extra): a Prometheus scrape of the compiled
cache after the run (``HiCacheCollector`` plus the text exposition, best of 5)
adds nothing per request, so its cost is the scrape's time spread over the
requests served between two scrapes (``--scrape-every``):
``metrics_overhead_pct`` = scrape time / (requests per scrape x us/request).
``metrics_breakeven_requests`` is how many requests a scrape interval must hold
for that to stay under 1%.

Tensor parallelism (``--tp 1,2,4``): the same loop (compiled table) on N rank
processes joined by a gloo group over 127.0.0.1, each with its own cache
(``HiCache(group=...)``) serving the same requests; ``--tp-requests`` timed
requests per rank, best chunk kept per rank, the slowest rank reported (ranks
run in lockstep). Every ``poll`` runs one MIN all-reduce, so a request pays two;
the figures split each request's time into the collective itself (waiting for
the other ranks included), the agreement's own bookkeeping, and the rest of the
controller. ``tp`` in the result maps N to those figures; tp 1 runs in a rank
process too (no collectives), so the ratios compare like with like.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import math
import random
import time
from collections.abc import Callable

import torch

from hicache_fsm.bench.common import ID_FORMS as ENGINE_ID_FORMS, machine_description, report
from hicache_fsm.cache import HiCache
from hicache_fsm.commands.args import UsageError, bounded_int, check_fits, non_negative_int, positive_int, seed_int
from hicache_fsm.config import CacheConfig
from hicache_fsm.executors import AckExecutor
from hicache_fsm.pools import DeviceKVPool, HostKVPool, KVShape
from hicache_fsm.spec import load_builtin
from hicache_fsm.tokens import pack_token_ids
from hicache_fsm.tp import MAX_RANKS, PURPOSE_ENGINE, RankGroup
from hicache_fsm.transitions_dispatch import TransitionsDispatcher

REQUEST_TOKENS = 4096
PAGE_SIZE = 64
PREFIX_TOKENS = 1024
SYSTEM_PROMPTS = 8
VOCAB = 32000
CHUNK = 100  # requests per timed chunk; chunks of the two variants alternate
RAW_ALL_REDUCES = 200  # bare all-reduces timed per rank, the transport's floor
CACHE_TOKEN_BYTES = 64  # a token of make_cache's pools and allocator tables (measured 32, with room)
REQUEST_BYTES = 2 * 8 * REQUEST_TOKENS  # a request's ids: its tuple, and the form the engine holds them in
_VOCAB_INTS = list(range(VOCAB))  # token ids as a tokenizer's vocabulary table hands them out


def system_prompts(seed: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(_VOCAB_INTS[rng.randrange(1, VOCAB)] for _ in range(PREFIX_TOKENS)) for _ in range(SYSTEM_PROMPTS)]


def make_requests(n: int, seed: int = 0, prompts: list[tuple[int, ...]] | None = None) -> list[tuple[int, ...]]:
    prompts = prompts if prompts is not None else system_prompts(seed)
    rng = random.Random(seed + 1)
    vocab = _VOCAB_INTS
    return [
        rng.choice(prompts) + tuple(vocab[rng.randrange(1, VOCAB)] for _ in range(REQUEST_TOKENS - PREFIX_TOKENS))
        for _ in range(n)
    ]


def check_sizes(requests: int, repeats: int, tree_nodes: int, caches: int, request_lists: int = 1,
                flag: str = "--requests") -> int:
    """Tokens each cache needs, or ``UsageError`` when ``caches`` such caches and ``request_lists`` lists of
    ``requests`` requests would not fit in memory (checked before the first is built)."""
    check_fits(requests, request_lists * REQUEST_BYTES, flag, f"{REQUEST_TOKENS} ids a request, held twice")
    capacity = tree_nodes * PAGE_SIZE + (repeats * requests + SYSTEM_PROMPTS) * REQUEST_TOKENS
    check_fits(capacity, caches * CACHE_TOKEN_BYTES, "tokens a cache holds",
               f"--tree-nodes x {PAGE_SIZE} + --repeats x {flag} x {REQUEST_TOKENS}, in each of {caches} caches")
    return capacity


def make_cache(capacity_tokens: int, dispatcher=None, group=None) -> HiCache:
    shape = KVShape(layers=1, heads=1, head_dim=1)
    device = DeviceKVPool(shape, capacity_tokens, PAGE_SIZE, "cpu")
    host = HostKVPool(shape, capacity_tokens, PAGE_SIZE, pin_memory=False)
    return HiCache(device, host, CacheConfig(write_policy="write_through"), AckExecutor(), dispatcher=dispatcher,
                   group=group)


def fill(cache: HiCache, nodes: int) -> None:
    """Insert ``nodes`` one-page prefixes (distinct first tokens, outside the request vocabulary) and ack them."""
    for i in range(nodes):
        tokens = (VOCAB + i,) + tuple(range(1, PAGE_SIZE))
        cache.insert(tokens, cache.alloc_device(PAGE_SIZE))
        if i % 256 == 255:
            cache.poll()
            cache.poll()
    cache.poll()
    cache.poll()


class ToPack:
    """A request the engine packs (``pack_token_ids``) when it arrives: ``serve_batch`` times that packing."""

    __slots__ = ("ids",)

    def __init__(self, ids: tuple[int, ...]) -> None:
        self.ids = ids


class BuiltPerCall:
    """A request whose ids the engine builds anew for every call: its prompt's list plus its output's, as a
    scheduler holding the two apart hands their sum. ``serve_batch`` builds each list untimed (the engine's work)."""

    __slots__ = ("prompt", "output")

    def __init__(self, ids: tuple[int, ...]) -> None:
        self.prompt, self.output = list(ids[:PREFIX_TOKENS]), list(ids[PREFIX_TOKENS:])

    def ids(self) -> list[int]:
        return self.prompt + self.output


# How the engine holds each request's ids (``--ids``): the forms handed to every call, plus three more.
ID_FORMS: dict[str, Callable[[tuple[int, ...]], object]] = {name: build for name, (build, _) in ENGINE_ID_FORMS.items()}
ID_FORMS["list_per_call"] = BuiltPerCall  # a new list of the same ids to each call
ID_FORMS["tensor"] = lambda ids: torch.tensor(ids, dtype=torch.int64)  # packed by numpy, no per-id Python
ID_FORMS["packed"] = ToPack  # packed once on arrival, timed; every call takes the TokenIds as it is
_ID_ROWS = {name: row for name, (_, row) in ENGINE_ID_FORMS.items()} | {
    "list_per_call": "a list built anew for each call, prompt + output (insert after match_prefix of an equal "
                     "list reuses its packing)",
    "tensor": "an int64 tensor per call (packed by numpy)",
    "packed": "packed once on arrival (timed), a TokenIds to every call",
}


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def serve(cache: HiCache, requests: list[tuple[int, ...]], pc=time.perf_counter,
          after: Callable[[], None] | None = None, batch: int = 1) -> float:
    """Run the requests through the engine loop, ``batch`` at a time (``serve_batch``);
    seconds (of clock ``pc``) spent in match + insert + polls (and ``after``, run once a request, or a batch,
    inside the timed part: ``bench events`` flushes its events there)."""
    spent = 0.0
    gc.collect()
    gc.disable()  # as timeit does: a collection pass landing in one variant's loop is noise
    try:
        for start in range(0, len(requests), batch):
            spent += serve_batch(cache, requests[start : start + batch], pc, after)
    finally:
        gc.enable()
    if cache.pending_job_ids():
        raise RuntimeError("benchmark left jobs pending")
    return spent


def serve_one(cache: HiCache, tokens, pc=time.perf_counter,
              after: Callable[[], None] | None = None) -> float:
    """One request of the engine loop (see ``serve``, without its collector handling); seconds timed."""
    return serve_batch(cache, (tokens,), pc, after)


def serve_batch(cache: HiCache, batch, pc=time.perf_counter, after: Callable[[], None] | None = None) -> float:
    """Requests a scheduler matches together: every ``match_prefix``, then every ``insert`` (on the slots
    allocated after each match, untimed), then the two polls (and ``after``); seconds timed.

    A ``ToPack`` request is packed first, inside the timed part (an engine that packs a request on arrival); a
    ``BuiltPerCall`` request's list is built for each call, outside it.
    """
    spent = 0.0
    matched = []
    for request in batch:
        built = type(request) is BuiltPerCall
        tokens = request.ids() if built else request
        t0 = pc()
        if type(tokens) is ToPack:
            tokens = pack_token_ids(tokens.ids)
        m = cache.match_prefix(tokens)
        spent += pc() - t0
        cached = m.device_hit_length
        new = cache.alloc_device(len(tokens) - cached)
        matched.append((request.ids() if built else tokens, torch.cat([m.device_indices, new]) if cached else new))
    t0 = pc()
    for tokens, indices in matched:
        cache.insert(tokens, indices)
    cache.poll()  # start the backup batch
    cache.poll()  # apply its acks
    if after is not None:
        after()
    return spent + (pc() - t0)


def scrape_cost_us(cache: HiCache, repeats: int = 5) -> float | None:
    """Best time of one Prometheus scrape of ``cache`` (collect and text exposition); None without the extra."""
    try:
        from prometheus_client import CollectorRegistry, generate_latest

        from hicache_fsm.metrics import HiCacheCollector
    except ImportError:
        return None
    registry = CollectorRegistry()
    registry.register(HiCacheCollector(cache))
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        generate_latest(registry)
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def _tp_rank(rank: int, world: int, pg, n: int, tree_nodes: int, seed: int) -> dict:
    """One rank of the tensor-parallel figures: best chunk, and where a request's time goes."""
    torch.set_num_threads(1)
    group = RankGroup(pg if world > 1 else None, timeout_s=120.0)
    capacity = tree_nodes * PAGE_SIZE + (n + SYSTEM_PROMPTS) * REQUEST_TOKENS
    cache = make_cache(capacity, group=group)
    fill(cache, tree_nodes)
    requests = make_requests(n, seed, system_prompts(seed))
    chunk = min(CHUNK, n)
    best = None
    for start in range(0, n - chunk + 1, chunk):
        c0, a0, k0 = group.collective_s, cache.agreement.seconds, group.collectives
        spent = serve(cache, requests[start:start + chunk])
        row = (spent / chunk * 1e6, (group.collective_s - c0) / chunk * 1e6,
               (cache.agreement.seconds - a0 - (group.collective_s - c0)) / chunk * 1e6,
               (group.collectives - k0) / chunk)
        if best is None or row[0] < best[0]:
            best = row
    us, coll, book, per = best
    raw = 0.0
    if world > 1:  # the transport alone: the same all-reduce with nothing else to do, same processes
        vec = [0] * 64
        start, spent = group.collectives, time.perf_counter()
        for _ in range(RAW_ALL_REDUCES):
            group.min(vec, PURPOSE_ENGINE)
        raw = (time.perf_counter() - spent) / (group.collectives - start) * 1e6
    return {"us_per_request": us, "collective_us": coll, "agreement_us": book, "collectives_per_request": per,
            "raw_all_reduce_us": raw}


def tp_figures(worlds: list[int], n: int, tree_nodes: int, seed: int) -> dict[int, dict]:
    """Per world size: the slowest rank's best-chunk figures (see the module docstring)."""
    from hicache_fsm.testing.ranks import run_ranks

    out = {}
    for world in worlds:
        ranks = [o.unwrap() for o in run_ranks(_tp_rank, world, n, tree_nodes, seed, timeout_s=1800)]
        worst = max(ranks, key=lambda r: r["us_per_request"])
        out[world] = {k: round(v, 2) for k, v in worst.items()}
    base = out.get(1, {}).get("us_per_request")
    for figures in out.values():
        if base:
            figures["ratio_to_tp1"] = round(figures["us_per_request"] / base, 2)
    return out


def _worlds(text: str) -> list[int]:
    """The rank counts of ``--tp`` ("" skips the TP figures); an empty element ("1,,2") is a mistyped list."""
    if not text.strip():
        return []
    try:
        worlds = [int(x) for x in text.split(",")]
    except ValueError:
        raise UsageError(f"--tp wants comma-separated rank counts, got {text!r}") from None
    if any(w < 1 for w in worlds):
        raise UsageError(f"--tp wants rank counts >= 1, got {text!r}")
    if any(w > MAX_RANKS for w in worlds):  # each rank is a process importing torch
        raise UsageError(f"--tp wants at most {MAX_RANKS} ranks, got {text!r}")
    return worlds


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=positive_int, default=1000, help="timed requests per repeat (default 1000)")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="runs of --requests new requests per variant (default 3)")
    parser.add_argument("--tree-nodes", type=non_negative_int, default=None,
                        help="nodes in the tree before timing (default 10 x --requests)")
    parser.add_argument("--seed", type=seed_int, default=0)
    parser.add_argument("--scrape-every", type=positive_int, default=1000,
                        help="requests between two Prometheus scrapes, for the metrics overhead (default 1000)")
    parser.add_argument("--tp", default="1,2,4",
                        help="also time the loop on this many rank processes each, comma-separated "
                             "(gloo on CPU; empty: skip; default 1,2,4)")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="cpu",
                        help="time the two variants with process CPU time (cpu, default: steadier on a machine "
                             "shared with other work) or perf_counter (wall); the --tp figures use wall time")
    parser.add_argument("--tp-requests", type=positive_int, default=300,
                        help="timed requests per rank for the --tp figures (default 300)")
    parser.add_argument("--batch", type=bounded_int(1, CHUNK), default=1,
                        help=f"requests matched before any of them is inserted, as a scheduler matches a batch "
                             f"(default 1: each request matched, then inserted; at most {CHUNK})")
    parser.add_argument("--ids", choices=tuple(ID_FORMS), default="array",
                        help="the form the engine holds each request's ids in: an array('q') (default, as SGLang's "
                             "scheduler holds them), a tuple or a list handed to every call, a list built anew for "
                             "each call (list_per_call), an int64 tensor, or packed once on arrival (timed) into a "
                             "TokenIds")


def run(args: argparse.Namespace) -> dict:
    worlds = _worlds(getattr(args, "tp", "") or "")  # a bad --tp is refused before the timed runs, not after
    if worlds:  # the rank processes run through the toolkit: a missing `testing` extra is told before timing too
        importlib.import_module("hicache_fsm.testing.ranks")
    n = args.requests
    repeats = args.repeats
    tree_nodes = args.tree_nodes if getattr(args, "tree_nodes", None) is not None else 10 * n
    capacity = check_sizes(n, repeats, tree_nodes, caches=2)
    tp_n = max(1, getattr(args, "tp_requests", 300))
    if worlds:  # each rank process holds its own cache and requests
        check_sizes(tp_n, 1, min(tree_nodes, 10 * tp_n), caches=max(worlds), request_lists=max(worlds),
                    flag="--tp-requests")
    clock = CLOCKS[getattr(args, "clock", "cpu")]
    ids = getattr(args, "ids", "array")
    form = ID_FORMS[ids]
    batch = getattr(args, "batch", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # index tensors are tiny: intra-op threads only add wake-up latency
    try:
        ours = make_cache(capacity)
        theirs = make_cache(capacity, TransitionsDispatcher(load_builtin("residency")))
        fill(ours, tree_nodes)
        fill(theirs, tree_nodes)
        prompts = system_prompts(args.seed)
        chunk = min(CHUNK, n)
        ours_us, theirs_us = [], []
        for r in range(repeats):
            requests = [form(t) for t in make_requests(n, args.seed + 7919 * r, prompts)]
            for start in range(0, n - chunk + 1, chunk):
                part = requests[start : start + chunk]
                ours_us.append(serve(ours, part, clock, batch=batch) / chunk * 1e6)
                theirs_us.append(serve(theirs, part, clock, batch=batch) / chunk * 1e6)
        scrape_us = scrape_cost_us(ours)
    finally:
        torch.set_num_threads(threads)
    us = min(ours_us)
    tus = min(theirs_us)
    result = {
        "benchmark": "controller",
        "requests": n,
        "repeats": repeats,
        "tree_nodes": tree_nodes,
        "clock": getattr(args, "clock", "cpu"),
        "request_tokens": REQUEST_TOKENS,
        "page_size": PAGE_SIZE,
        "ids": ids,
        "batch": batch,
        "executor": "AckExecutor (acks without copying)",
        "timed": "match_prefix + insert (with its backup) + 2 x poll; best chunk of 100 requests" if batch == 1 else
                 f"per request, in batches of {batch}: every match_prefix, then every insert (with its backup), "
                 "then 2 x poll; best chunk of 100 requests",
        "us_per_request": round(us, 2),
        "transitions_us_per_request": round(tus, 2),
        "speedup": round(tus / us, 2),
        "machine": machine_description(),
    }
    if scrape_us is not None:
        every = max(1, getattr(args, "scrape_every", 1000))
        result.update(
            metrics_scrape_us=round(scrape_us, 1),
            metrics_tree_nodes=len(ours.tree),
            metrics_scrape_every=every,
            metrics_overhead_pct=round(100 * scrape_us / (every * us), 3),
            metrics_breakeven_requests=math.ceil(100 * scrape_us / us),
        )
    rows = [
        ("requests", f"{repeats} x {n} x {REQUEST_TOKENS} tokens, page {PAGE_SIZE}, {tree_nodes} nodes already cached"
                     + (f", matched in batches of {batch} before their inserts" if batch > 1 else "")),
        ("ids", _ID_ROWS[ids]),
        ("compiled table", f"{us:.1f} us/request"),
        ("transitions", f"{tus:.1f} us/request"),
        ("speedup", f"{tus / us:.2f}x"),
    ]
    if scrape_us is not None:
        rows.append(("metrics scrape", f"{scrape_us:.0f} us at {len(ours.tree)} nodes = "
                     f"{result['metrics_overhead_pct']:.2f}% of the controller's time over {result['metrics_scrape_every']} "
                     f"requests (1% at {result['metrics_breakeven_requests']})"))
    if worlds:
        tp = tp_figures(worlds, tp_n, min(tree_nodes, 10 * tp_n), args.seed)
        result["tp"] = {str(w): f for w, f in tp.items()}
        for w, f in tp.items():
            rows.append((f"tp {w} ({w} processes)",
                         f"{f['us_per_request']:.1f} us/request ({f.get('ratio_to_tp1', 1.0):.2f}x tp 1): "
                         f"{f['collective_us']:.1f} in {f['collectives_per_request']:.0f} MIN all-reduce(s) "
                         f"(a bare one: {f['raw_all_reduce_us']:.1f}), {f['agreement_us']:.1f} agreement bookkeeping"))
    report("controller overhead: match + insert + backup + acks", rows, result, getattr(args, "json", False))
    return result
