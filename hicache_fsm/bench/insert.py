"""Insert, call by call after a collection: ours, with and without its host backup, against same-run baselines.

``bench scale`` reports ``insert`` as the median of 7 chunk means, each
chunk between chunks of five other variants, and its insert ratio moves from
run to run (docs/performance.md). Here insert runs alone: on trees of ``--nodes``
one-page prefixes (page 64), the variants take turns in blocks of
``--block`` inserts of 4,096-id requests under a cached 1,024-id prompt,
``gc.collect()`` before each block (as ``bench scale`` does before each
chunk) and the collector off inside it, for ``--blocks`` rounds. Each
position in a block gets its median over the rounds, so the first insert
after a collection (cold caches) and a warm one read apart.

``--request`` sets what each timed insert adds (``REQUESTS``): ``new``
(default), the 3,072 ids after the prompt, as an engine inserts a request
after its prefill; ``finished``, the last 512 ids of a request whose first
3,584 were inserted just before (untimed), as it inserts a request that has
finished decoding; ``cached``, nothing, the whole request having been
inserted just before (untimed). Each insert is handed the ids as the
engine holds them, right after a ``match_prefix`` of them (untimed): the
same object, or with ``--ids list_per_call`` another list of the same ids
(built untimed), as a scheduler holding a prompt and an output apart hands
each call their sum.

Each insert of ours is timed once and split: ``ours`` is the whole call,
``ours_nobackup`` the same call less the time spent starting the host backup
that ``write_through`` asks of it (host KV evicted for room, host pages
claimed, the D2H job built and queued), work the baselines do not do. The
baselines are ``plain`` and ``sglang`` (``bench.baselines``) and, with
``--peer``, SGLang's own ``RadixCache`` (``sglang_peer``). Ratios are ours /
baseline of the mean over every call (``insert``, ``insert_nobackup``), of
the first position and of the last (``first``, ``warm``).
"""

from __future__ import annotations

import argparse
import gc
import statistics

import torch

from hicache_fsm.bench import scale, sglang_peer
from hicache_fsm.bench.common import CLOCKS, ID_FORMS, machine_description, report
from hicache_fsm.commands.args import bounded_int, positive_int, seed_int
from hicache_fsm.jobs import JobKind
from hicache_fsm.outbox import JOBS_KEY

# What a timed insert adds (``--request``): the ids inserted just before it, untimed (None: only the prompt), and
# the words the report uses.
DECODED = 512  # the ids a ``finished`` request adds to those inserted after its prefill
REQUESTS: dict[str, tuple[int | None, str]] = {
    "new": (None, f"new requests ({scale.REQUEST - scale.PROMPT} new ids under the cached prompt)"),
    "finished": (scale.REQUEST - DECODED, f"finished requests (the first {scale.REQUEST - DECODED} ids inserted "
                                          f"before, then {DECODED} more)"),
    "cached": (scale.REQUEST, f"cached requests (all {scale.REQUEST} ids inserted before, then again)"),
}
SHOWN_POSITIONS = (1, 2, 3, 4, 8, 16, 32, 64)  # columns of the printed table: those within a block, and its last
BACKUP_JOBS = JOBS_KEY[JobKind.D2H]  # the cache counter of D2H jobs emitted: one per backup started
MAX_BLOCKS, MAX_BLOCK, MAX_WARMUP = 10_000, 1024, 100_000
PER_CALL = "list_per_call"  # ``--ids``: a list, built anew for the insert (``OursVariant.per_call``)
INSERT_ID_FORMS = ID_FORMS | {PER_CALL: (ID_FORMS["list"][0], "a list built anew for each call: insert is handed "
                                                               "another list than match_prefix, of the same ids")}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=positive_int, default=10_000,
                        help=f"one-page prefixes in every tree, within what memory holds at {scale.NODE_BYTES} bytes "
                             "a node (default 10000)")
    # bounds a run of hours would pass, not a machine's: a larger count is a mistyped one, not a longer benchmark
    parser.add_argument("--blocks", type=bounded_int(1, MAX_BLOCKS), default=40,
                        help=f"rounds of blocks per variant (default 40, at most {MAX_BLOCKS})")
    parser.add_argument("--block", type=bounded_int(1, MAX_BLOCK), default=16,
                        help=f"inserts in a block, after one collection (default 16, at most {MAX_BLOCK})")
    parser.add_argument("--warmup", type=bounded_int(1, MAX_WARMUP), default=200,
                        help=f"untimed inserts per variant before timing (default 200, at most {MAX_WARMUP})")
    parser.add_argument("--request", choices=tuple(REQUESTS), default="new",
                        help="what each timed insert adds: new (default: a request after its prefill), finished "
                             "(the last 512 ids of a request inserted before) or cached (nothing: the request was "
                             "inserted before)")
    parser.add_argument("--ids", choices=tuple(INSERT_ID_FORMS), default="array",
                        help="the form ours is handed each request's ids in (see bench scale --ids), or "
                             f"{PER_CALL}: a list built anew for each call")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="cpu",
                        help="process CPU time (cpu, default) or perf_counter (wall)")
    parser.add_argument("--peer", choices=("auto", "sglang", "none"), default="auto",
                        help="also time SGLang's own RadixCache: auto (default) when importable, sglang to require "
                             "it, none to skip it")
    parser.add_argument("--seed", type=seed_int, default=0)


def measure(nodes: int, blocks: int, block: int, warmup: int, ids: str = "array", clock: str = "cpu",
            peer: sglang_peer.SGLangRadix | None = None, seed: int = 0, request: str = "new") -> dict:
    """Per-position medians of every variant's insert (see the module docstring)."""
    pc = CLOCKS[clock]
    inserted_before = REQUESTS[request][0]
    warm = 16  # room for this many requests beyond the prefixes, as in ``bench scale``: later inserts evict
    ours = scale.OursVariant(nodes, warm, 0, "list" if ids == PER_CALL else ids, per_call=ids == PER_CALL)
    variants = [ours] + [scale.BaselineVariant(name, nodes, warm) for name in scale.BASELINES]
    if peer is not None:
        peer_cache = sglang_peer.SGLangRadixPeer(peer, scale.PAGE, sglang_peer.peer_form(ids))
        variants.append(scale.BaselineVariant(sglang_peer.NAME, nodes, warm, peer_cache))
    streams = {v.name: scale.RequestTokens(seed) for v in variants}  # every variant inserts the same requests
    for v in variants:
        v.fill(nodes)
        for _ in range(warmup):
            tokens = streams[v.name].request()
            _insert_earlier(v, tokens, inserted_before, pc)
            v.insert_timed(tokens, pc)
    samples: dict[str, list[list[float]]] = {name: [[] for _ in range(block)]
                                             for name in ["ours", "ours_nobackup"] + [v.name for v in variants[1:]]}
    counters = ours.cache.counters
    backups = 0  # started by the timed inserts of ours
    for _ in range(blocks):
        for v in variants:
            stream = streams[v.name]
            gc.collect()
            gc.disable()
            try:
                for position in range(block):
                    tokens = stream.request()
                    _insert_earlier(v, tokens, inserted_before, pc)
                    if v is ours:
                        jobs = counters[BACKUP_JOBS]
                        spent, backup = ours.insert_parts_timed(tokens, pc)
                        backups += counters[BACKUP_JOBS] - jobs
                        samples["ours_nobackup"][position].append((spent - backup) * 1e6)
                    else:
                        spent = v.insert_timed(tokens, pc)
                    samples[v.name][position].append(spent * 1e6)
            finally:
                gc.enable()
    positions = {name: [round(statistics.median(s), 2) for s in by_position] for name, by_position in samples.items()}
    mean = {name: round(statistics.fmean(x for s in by_position for x in s), 2)
            for name, by_position in samples.items()}
    out: dict = {"nodes": nodes, "blocks": blocks, "block": block, "clock": clock, "request": request,
                 "baselines": [v.name for v in variants[1:]], "positions": positions, "mean_us": mean,
                 "timed_inserts": blocks * block, "ours_backups_started": backups,
                 "ids": {"ours": INSERT_ID_FORMS[ids][1]}}
    if peer is not None:
        out["sglang_peer_version"] = peer.version
        out["ids"][sglang_peer.NAME] = sglang_peer.PEER_FORMS[sglang_peer.peer_form(ids)][1]
    for name in out["baselines"]:
        ratios = out[f"vs_{name}"] = {}
        for mine, suffix in (("ours", ""), ("ours_nobackup", "_nobackup")):
            ratios[f"insert{suffix}"] = _ratio(mean[mine], mean[name])
            ratios[f"first{suffix}"] = _ratio(positions[mine][0], positions[name][0])
            ratios[f"warm{suffix}"] = _ratio(positions[mine][-1], positions[name][-1])
    return out


def _insert_earlier(variant, tokens: tuple, inserted_before: int | None, pc) -> None:
    """The request's earlier insert, untimed: its first ``inserted_before`` ids (``REQUESTS``), when there is one."""
    if inserted_before is not None:
        variant.insert_timed(tokens[:inserted_before], pc)


def _ratio(ours: float, base: float) -> float | None:
    return round(ours / base, 3) if base else None


def run(args: argparse.Namespace) -> dict:
    scale.check_nodes(args.nodes, "--nodes")
    peer = scale.resolve_peer(args.peer, "insert")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = measure(args.nodes, args.blocks, args.block, args.warmup, args.ids, args.clock, peer, args.seed,
                         args.request)
    finally:
        torch.set_num_threads(threads)
    result["machine"] = machine_description()
    shown = sorted({p for p in SHOWN_POSITIONS if p <= args.block} | {args.block})  # the last: the warm figure
    rows = [("position after the collection", "  ".join(f"{p:>8}" for p in shown) + f"  {'mean':>8}")]
    for name, by_position in result["positions"].items():
        rows.append((name, "  ".join(f"{by_position[p - 1]:>8}" for p in shown)
                     + f"  {result['mean_us'][name]:>8}"))
    for name in result["baselines"]:
        r = result[f"vs_{name}"]
        rows.append((f"ours / {name}",
                     f"mean {r['insert']}x (without the backup {r['insert_nobackup']}x), first {r['first']}x "
                     f"({r['first_nobackup']}x), warm {r['warm']}x ({r['warm_nobackup']}x)"))
    rows.append(("backups", f"{result['ours_backups_started']} started by {result['timed_inserts']} timed inserts "
                            "of ours"))
    report(f"insert after a collection: median us at each position of blocks of {args.block}, {args.blocks} rounds, "
           f"{args.nodes} prefixes, {REQUESTS[args.request][1]}, {args.clock} clock", rows, result,
           getattr(args, "json", False))
    return result
