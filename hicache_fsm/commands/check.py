"""Exhaustively explore the composed cache protocol within small bounds and check every invariant.

With no bounds given, the whole protocol (``testing.protocol.default_families``):
each write policy, storage attached with each prefetch stop policy (partial
per-key results, attach / detach as actions), CP layer writes with draft
layers on 1 and 2 ranks, each family explored completely within its model bounds (nodes,
pages, depth: the same states, coverage and verdict on every machine); coverage is
merged over the families (``--json``: ``"coverage": {machine: {"states":
[hit, total], "transitions": [hit, total]}}``).

Breadth-first over every reachable state of a cache with at most ``--nodes``
radix nodes on ``--device-pages`` / ``--host-pages`` pages: every engine step
(insert, match, lock, load back, back up, pin, evict) and every completion or
failure of every pending job, in every order. Progress goes to stderr; the
summary (states, transitions, violations with a shortest counterexample each,
how far it went: ``complete``, ``complete to depth N`` when ``--max-depth`` left states unexpanded,
``INCOMPLETE``, or ``CHECKED NOTHING`` when no step led to a second state or the adapter accepted no
insert) to stdout, the time taken to stderr; with ``--json`` stdout is one JSON object that does not
depend on the machine. Exit status 1 when a violation was found, when a run checked nothing, or when
the ``--max-seconds`` safety stop cut a run short (an incomplete run never passes by the clock). Ctrl-C
or SIGTERM ends the search with what it found so far (``INCOMPLETE (interrupted)``; exit status 130
unless it had found a violation).
"""

from __future__ import annotations

import argparse
import json
import sys

from hicache_fsm.commands.args import (INTERRUPTED, UsageError, adapter_ref, bounded_int, cache_option, int_arg,
                                      json_kwargs, non_negative_int, output_path, positive_float, positive_int)
from hicache_fsm.config import EVICTION_POLICIES, WRITE_POLICIES
from hicache_fsm.errors import ConfigError
from hicache_fsm.pools import LAYOUTS
from hicache_fsm.storage.options import STOP_POLICIES



# Bounds of a single exploration when any bound flag is given (with none, the default families run).
# Flags default to None so that an explicit flag equal to its default still counts as given.
MAX_CHECK_PAGE_SIZE = 64  # SGLang's usual page; the explored state keys hold token prefixes: cost ~ page squared
BOUND_DEFAULTS: dict = {"nodes": 3, "device_pages": 2, "host_pages": 2, "layers": 1, "page_size": 1, "alphabet": 2,
                        "max_len": None, "locks": 1, "pins": 1, "write_policy": "write_through",
                        "eviction_policy": "lru", "track_hits": False, "no_redeliver": False, "max_depth": None,
                        "max_states": None, "max_seconds": None, "namespaces": 1, "host_layout": "layer_first",
                        "cache_option": (), "storage": False, "stop_policy": "best_effort", "max_prefetches": 1,
                        "storage_option": (), "remote_tenant": None, "priorities": 1, "max_resets": 0}


def configure(parser: argparse.ArgumentParser) -> None:
    from hicache_fsm.testing.explorer import MAX_PRIORITIES
    from hicache_fsm.testing.kv import MAX_LAYERS

    g = parser.add_argument_group("bounds")
    g.add_argument("--nodes", type=positive_int, help="most radix nodes in a state (default 3)")
    g.add_argument("--device-pages", type=positive_int, help="device pool pages (default 2)")
    g.add_argument("--host-pages", type=positive_int, help="host pool pages (default 2)")
    g.add_argument("--layers", type=bounded_int(1, MAX_LAYERS),
                   help=f"model layers of the KV (default 1, at most {MAX_LAYERS}: the test KV encodes the layer in "
                        f"each value)")
    g.add_argument("--page-size", type=bounded_int(1, MAX_CHECK_PAGE_SIZE),
                   help=f"tokens per page (default 1, at most {MAX_CHECK_PAGE_SIZE}: a state's key holds each slot's "
                        f"token prefix, so the search's cost grows with the square of the page)")
    g.add_argument("--alphabet", type=positive_int, help="distinct page contents in prompts (default 2)")
    g.add_argument("--max-len", type=positive_int, help="longest prompt in pages (default: min(nodes, device pages))")
    g.add_argument("--locks", type=non_negative_int, help="engine locks held at once (default 1)")
    g.add_argument("--pins", type=non_negative_int, help="host pins held at once (default 1)")
    g.add_argument("--write-policy", choices=[*WRITE_POLICIES, "all"],
                   help="cache write policy, or 'all' to explore each in turn (default write_through; 'all' "
                        "explores four policies: at the default bounds that is tens of minutes, so give "
                        "--max-depth or --max-states with it)")
    g.add_argument("--eviction-policy", choices=EVICTION_POLICIES)
    g.add_argument("--namespaces", type=positive_int,
                   help="tree namespaces (tenants, LoRA ids) a prompt's first token also names (default 1; with "
                        "2, prompts starting with 1 and 2 are the same tokens in two namespaces)")
    g.add_argument("--host-layout", choices=LAYOUTS, help="the host pool's layout (default layer_first)")
    g.add_argument("--cache-option", metavar="NAME=VALUE", type=cache_option, action="append",
                   help="a CacheConfig threshold or budget for the cache under test, e.g. eviction_headroom_tokens=1, "
                        "load_back_threshold=2, load_back_max_tokens=none, write_behind_batch_tokens=1 (repeatable)")
    g.add_argument("--storage", action="store_true", default=None,
                   help="attach an L3 storage tier run step by step: prompts may also be prefetched or stored by "
                        "another instance, and each storage step completed or failed")
    g.add_argument("--stop-policy", choices=STOP_POLICIES,
                   help="the prefetch stop policy (with --storage; default best_effort)")
    g.add_argument("--max-prefetches", type=positive_int, help="prefetches running at once (with --storage; default 1)")
    g.add_argument("--storage-option", metavar="NAME=VALUE", type=cache_option, action="append",
                   help="a storage tier limit (with --storage): prefetch_threshold, prefetch_capacity_tokens or "
                        "batch_pages, e.g. batch_pages=1 (repeatable)")
    g.add_argument("--remote-tenant", metavar="NAME",
                   help="another tenant stores on the same storage (with --storage): its pages, other KV for the "
                        "same tokens, must never be hit")
    g.add_argument("--priorities", type=bounded_int(1, MAX_PRIORITIES),
                   help=f"inserts also run at priorities 1..N-1 (for the priority eviction policy; default 1, at most "
                        f"{MAX_PRIORITIES}: each is another insert of every prompt in every state)")
    g.add_argument("--max-resets", type=non_negative_int, help="reset steps per path (default 0)")
    g.add_argument("--track-hits", action="store_true", default=None,
                   help="tell hit from never-hit nodes in the state key")
    g.add_argument("--no-redeliver", action="store_true", default=None, help="do not try re-delivering finished acks")
    g.add_argument("--max-depth", type=positive_int,
                   help="explore every state within this many steps (a model bound: the run is reported "
                        "'complete to depth N' when deeper states may exist; block stores: default 7)")
    g.add_argument("--max-states", type=positive_int, help="stop after this many states (the run is incomplete)")
    g.add_argument("--max-seconds", type=positive_float,
                   help="safety stop: a run it stops is reported INCOMPLETE and check exits 1")
    parser.add_argument("--stop-on-first", action="store_true", help="stop at the first violation")
    parser.add_argument("--max-violations", type=positive_int, default=5, help="distinct violations to collect (default 5)")
    parser.add_argument("--adapter", metavar="MODULE:CALLABLE", type=adapter_ref,
                        help="explore your own cache: a callable taking the Bounds and returning a CacheAdapter")
    parser.add_argument("--variant", metavar="JSON", type=json_kwargs,
                        help="keyword arguments for a block-store --adapter factory, as a JSON object")
    g.add_argument("--max-jobs", type=int_arg, default=None, help="block stores: jobs in flight at once (default 2)")
    g.add_argument("--max-entries", type=int_arg, default=None, help="block stores: keys held in a state to expand")
    g.add_argument("--no-symmetry", action="store_true",
                   help="block stores: do not merge states that differ only by the names of block keys")
    parser.add_argument("--coverage", action="store_true", help="print which spec states/transitions were reached")
    parser.add_argument("--record", metavar="FILE", type=output_path,
                        help="write every transition fired while exploring to FILE (JSONL; "
                             "`hicache-fsm diagram NAME --counts FILE` draws it)")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    parser.add_argument("--json", action="store_true", help="print only one JSON object on stdout (the report goes to stderr)")


def how_far(result) -> str:
    """How far a run went, in the words the summary line uses."""
    if not result.violations and result.checked_nothing():
        return f"CHECKED NOTHING ({result.checked_nothing()})"
    if result.complete:
        return f"complete to depth {result.bounds.max_depth}" if result.depth_bounded else "complete"
    if result.stopped_by == "violation":
        return "stopped at a violation"
    if result.stopped_by == "max_states":
        return f"INCOMPLETE (state budget {result.bounds.max_states} spent)"
    if result.stopped_by == "max_seconds":
        return f"INCOMPLETE (safety stop: {result.bounds.max_seconds:g}s reached)"
    if result.stopped_by == "interrupted":
        return "INCOMPLETE (interrupted)"
    return "INCOMPLETE"


def reduced(result) -> str:
    """What the reductions removed, for the summary line ("" when nothing)."""
    red = result.reductions()
    parts = []
    if red["token_renaming"]["without"] != result.states:
        parts.append(f"{red['token_renaming']['without']} before token renaming")
    if red["omitted_ops"]:
        parts.append(f"without {', '.join(red['omitted_ops'])}")
    if red["start_steps"]:
        parts.append(f"from a {red['start_steps']}-step start")
    return f" ({'; '.join(parts)})" if parts else ""


def _status(results) -> int:
    """1 when a violation was found, a run checked nothing, or a safety stop cut a run short (never a pass by
    the clock); ``INTERRUPTED`` when Ctrl-C or SIGTERM ended a run that had found nothing."""
    if any(r.violations for r in results):
        return 1
    if any(r.stopped_by == "interrupted" for r in results):
        return INTERRUPTED
    return 1 if any(not r.ok or r.stopped_by == "max_seconds" for r in results) else 0


# The search is exhaustive: each state tries every prompt and every eviction, so bounds must stay small.
MAX_POOL_TOKENS = 1 << 20


# Bounds fields in a ``ConfigError``, as the flags that set them
_FLAG_WORDS = (("Bounds.cache_options", "--cache-option"), ("Bounds.storage_options", "--storage-option"),
               ("Bounds.remote_tenant", "--remote-tenant"), ("(storage=True)", "(--storage)"))
STORAGE_ONLY_FLAGS = ("stop_policy", "max_prefetches", "storage_option", "remote_tenant")


def _as_flags(message: str) -> str:
    """A ``Bounds`` error in the words of the command line."""
    for field, flag in _FLAG_WORDS:
        message = message.replace(field, flag)
    return message


def _refuse_storage_flags_without_storage(args: argparse.Namespace) -> None:
    """``UsageError`` for a storage flag given without ``--storage`` (the run would ignore it and pass)."""
    given = [f for f in STORAGE_ONLY_FLAGS if getattr(args, f) not in (None, ())]
    if given and not args.storage:
        flags = ", ".join("--" + f.replace("_", "-") for f in given)
        raise UsageError(f"{flags}: the storage tier's, so {'it needs' if len(given) == 1 else 'they need'} --storage")


def _check_bounds_are_small(args: argparse.Namespace) -> None:
    from hicache_fsm.commands.block_store import refuse_many_prompts

    refuse_many_prompts(args.alphabet, args.max_len if args.max_len is not None
                        else max(1, min(args.nodes, args.device_pages)))
    if args.namespaces > args.alphabet:  # namespace = (first token - 1) mod N: only --alphabet of them occur
        raise UsageError(f"--namespaces {args.namespaces} is more than --alphabet {args.alphabet}: a prompt's first "
                         f"token names its namespace, so only {args.alphabet} would be explored (raise --alphabet)")
    tokens = (args.device_pages + args.host_pages) * args.page_size * args.layers
    if tokens > MAX_POOL_TOKENS:
        raise UsageError(f"pools of {tokens} token-layers are far beyond what an exhaustive search can cover; "
                         f"keep (--device-pages + --host-pages) x --page-size x --layers under {MAX_POOL_TOKENS}")


def run(args: argparse.Namespace) -> int:
    if args.adapter:
        from hicache_fsm.commands.block_store import check_block_store

        status = check_block_store(args, {})  # bound flags default to None: a value means given  # None: a prefix-cache factory, explored below
        if status is not None:
            return status
    elif args.variant is not None:
        raise UsageError("--variant needs --adapter")
    for flag, given in (("--no-symmetry", args.no_symmetry), ("--max-jobs", args.max_jobs is not None),
                        ("--max-entries", args.max_entries is not None)):
        if given:
            raise UsageError(f"{flag} is for a block-store --adapter")
    return _check_prefix_cache(args)


def bounds_given(args: argparse.Namespace) -> bool:
    """True when any bound flag is on the command line (even one equal to its default)."""
    return any(getattr(args, f) is not None for f in BOUND_DEFAULTS)


def _fill_defaults(args: argparse.Namespace) -> None:
    for f, default in BOUND_DEFAULTS.items():
        if getattr(args, f) is None:
            setattr(args, f, default)


def _check_portfolio(args: argparse.Namespace) -> int:
    """No bounds given: every family of ``testing.protocol.default_families`` (the whole protocol)."""
    from hicache_fsm.testing.explorer import Explorer
    from hicache_fsm.testing.paths import CoverageTracker
    from hicache_fsm.testing.protocol import default_families

    total = CoverageTracker()
    runs = []
    out = sys.stderr if args.json else sys.stdout
    families = default_families()
    for n, (name, bounds, factory) in enumerate(families, 1):
        cov = CoverageTracker()
        explorer = Explorer(factory, bounds, stop_on_first=args.stop_on_first, max_violations=args.max_violations,
                            progress=None if args.quiet else sys.stderr, progress_label=f"{name} ({n}/{len(families)})",
                            coverage=cov)
        result = explorer.run()  # SIGTERM interrupts it as Ctrl-C does (cli.main)
        total.merge(cov)
        runs.append((name, result))
        print(f"{name}: {result.adapter}: {result.states} states{reduced(result)}, {result.transitions} transitions, "
              f"depth {result.max_depth}, {how_far(result)}, {len(result.violations)} violations", file=out, flush=True)
        for v in result.violations:
            print(v.format(), file=out)
        if (result.violations and args.stop_on_first) or result.stopped_by == "interrupted":
            break
    report = total.report()
    if args.coverage or not args.json:
        print(total.format(), file=out)
        for machine, edges in unreached_with_reasons(report).items():
            for edge, reason in edges.items():
                print(f"  {machine}: {edge}: {reason}", file=out)
    status = _status([r for _, r in runs])
    print(f"check: {sum(r.states for _, r in runs)} states in {sum(r.seconds for _, r in runs):.1f}s", file=sys.stderr)
    if args.json:
        summary = {
            "states": sum(r.states for _, r in runs),
            "transitions": sum(r.transitions for _, r in runs),
            "violations": sum(len(r.violations) for _, r in runs),
            "complete": all(r.complete for _, r in runs),
            "depth_bounded": any(r.depth_bounded for _, r in runs),
            "reductions": {"token_renaming": {"states": sum(r.states for _, r in runs),
                                              "without": sum(r.reductions()["token_renaming"]["without"]
                                                             for _, r in runs)}},
            "coverage": coverage_summary(report),
            "coverage_detail": report,
            "unreached": unreached_with_reasons(report),
            "runs": [dict(r.to_json(), family=name) for name, r in runs],
        }
        print(json.dumps(summary, sort_keys=True))
    return status


def unreached_with_reasons(report: dict) -> dict:
    """``{machine: {transition: reason}}`` for every transition the default families leave unfired."""
    from hicache_fsm.testing.protocol import UNREACHED_REASONS

    return {m: {edge: UNREACHED_REASONS.get(m, {}).get(edge, "unexplained") for edge in r["missing_transitions"]}
            for m, r in report.items() if r["missing_transitions"]}


def coverage_summary(report: dict) -> dict:
    """``{machine: {"states": [hit, total], "transitions": [hit, total]}}`` from a ``CoverageTracker`` report."""
    return {m: {"states": [r["states"], r["states_total"]], "transitions": [r["transitions"], r["transitions_total"]]}
            for m, r in report.items()}


def _check_prefix_cache(args: argparse.Namespace) -> int:
    if not args.adapter and not bounds_given(args):
        return _check_portfolio(args)
    _refuse_storage_flags_without_storage(args)
    _fill_defaults(args)
    from hicache_fsm.testing.explorer import Bounds, Explorer
    from hicache_fsm.testing.paths import CoverageTracker
    from hicache_fsm.testing.protocol import protocol_factory
    from hicache_fsm.testing.transition_log import RecordingCoverage, recording_writer

    _check_bounds_are_small(args)

    def bounds_for(policy: str) -> Bounds:
        return Bounds(
            nodes=args.nodes, device_pages=args.device_pages, host_pages=args.host_pages, layers=args.layers,
            page_size=args.page_size, alphabet=args.alphabet, max_len=args.max_len, max_locks=args.locks,
            max_pins=args.pins, write_policy=policy, eviction_policy=args.eviction_policy,
            track_hits=args.track_hits, redeliver=not args.no_redeliver, max_depth=args.max_depth,
            max_states=args.max_states, max_seconds=args.max_seconds, namespaces=args.namespaces,
            host_layout=args.host_layout, cache_options=dict(args.cache_option), storage=args.storage,
            stop_policy=args.stop_policy, max_prefetches=args.max_prefetches,
            storage_options=dict(args.storage_option), remote_tenant=args.remote_tenant,
            priorities=args.priorities, max_resets=args.max_resets,
        )

    policies = list(WRITE_POLICIES) if args.write_policy == "all" else [args.write_policy]
    try:
        bounds_for(policies[0])
    except ConfigError as exc:  # an option or tenant the bounds refuse: a usage mistake, named before anything runs
        raise UsageError(_as_flags(str(exc))) from None
    if not args.adapter and not args.quiet:  # bounds replace the portfolio: say what the run leaves out
        print(f"check: bounds given: one exploration per write policy ({', '.join(policies)}), not the families "
              f"of plain `check` (CP, TP, the other policies{'' if args.storage else ', storage and prefetch'})",
              file=sys.stderr)
    factory = protocol_factory  # the checks of the families: policy obligations, eviction order, load-backs
    if args.adapter:
        from hicache_fsm.commands.adapter_factory import check_explorer_factory, load_factory

        factory = load_factory(args.adapter)
        check_explorer_factory(factory, args.adapter, bounds_for(policies[0]))
    runs = []
    writer = recording_writer(args.record)
    for policy in policies:
        bounds = bounds_for(policy)
        cov = CoverageTracker() if args.coverage or args.json else None
        if writer is not None:
            cov = RecordingCoverage(writer, recorded_by="check", objects=False, write_policy=policy)
        explorer = Explorer(factory, bounds, stop_on_first=args.stop_on_first, max_violations=args.max_violations,
                            progress=None if args.quiet else sys.stderr, coverage=cov)
        result = explorer.run()  # SIGTERM interrupts it as Ctrl-C does (cli.main)
        runs.append(result)
        out = sys.stderr if args.json else sys.stdout
        print(f"{result.adapter}: {result.states} states{reduced(result)}, {result.transitions} transitions, depth "
              f"{result.max_depth}, {how_far(result)}, {len(result.violations)} violations", file=out)
        for v in result.violations:
            print(v.format(), file=out)
        if args.coverage and cov is not None:
            print(cov.format(), file=out)
        if result.stopped_by == "interrupted":
            break
    if writer is not None:
        writer.close()
    if args.json:
        if len(runs) == 1:
            summary = runs[0].to_json()
            summary["coverage_detail"] = summary["coverage"]
            summary["coverage"] = coverage_summary(summary["coverage"])
        else:
            summary = {
                "states": sum(r.states for r in runs),
                "transitions": sum(r.transitions for r in runs),
                "violations": sum(len(r.violations) for r in runs),
                "complete": all(r.complete for r in runs),
                "depth_bounded": any(r.depth_bounded for r in runs),
                "runs": [r.to_json() for r in runs],
            }
        print(json.dumps(summary, sort_keys=True))
    return _status(runs)
