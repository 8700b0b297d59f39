"""Exhaustively explore the composed cache protocol within small bounds and check every invariant.

With no bounds given, the whole protocol (``testing.protocol.default_families``):
each write policy, storage attached with each prefetch stop policy (partial
per-key results, attach / detach as actions), CP layer writes with draft
layers on 1 and 2 ranks, each family up to its state budget (under a time cap); coverage is
merged over the families (``--json``: ``"coverage": {machine: {"states":
[hit, total], "transitions": [hit, total]}}``).

Breadth-first over every reachable state of a cache with at most ``--nodes``
radix nodes on ``--device-pages`` / ``--host-pages`` pages: every engine step
(insert, match, lock, load back, back up, pin, evict) and every completion or
failure of every pending job, in every order. Progress goes to stderr; the
summary (states, transitions, violations with a shortest counterexample each,
seconds) to stdout; with ``--json`` stdout is one JSON object. Exit
status 1 when a violation was found.
"""

from __future__ import annotations

import argparse
import json
import sys

from hicache_fsm.commands.args import UsageError, adapter_ref, json_kwargs, non_negative_int, positive_float, positive_int
from hicache_fsm.config import EVICTION_POLICIES, WRITE_POLICIES


DEFAULTS: dict = {}


def configure(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("bounds")
    g.add_argument("--nodes", type=positive_int, default=3, help="most radix nodes in a state (default 3)")
    g.add_argument("--device-pages", type=positive_int, default=2, help="device pool pages (default 2)")
    g.add_argument("--host-pages", type=positive_int, default=2, help="host pool pages (default 2)")
    g.add_argument("--layers", type=positive_int, default=1, help="model layers of the KV (default 1)")
    g.add_argument("--page-size", type=positive_int, default=1, help="tokens per page (default 1)")
    g.add_argument("--alphabet", type=positive_int, default=2, help="distinct page contents in prompts (default 2)")
    g.add_argument("--max-len", type=positive_int, default=None, help="longest prompt in pages (default: min(nodes, device pages))")
    g.add_argument("--locks", type=non_negative_int, default=1, help="engine locks held at once (default 1)")
    g.add_argument("--pins", type=non_negative_int, default=1, help="host pins held at once (default 1)")
    g.add_argument("--write-policy", default="write_through", choices=[*WRITE_POLICIES, "all"],
                   help="cache write policy, or 'all' to explore each (default write_through)")
    g.add_argument("--eviction-policy", default="lru", choices=EVICTION_POLICIES)
    g.add_argument("--track-hits", action="store_true", help="tell hit from never-hit nodes in the state key")
    g.add_argument("--no-redeliver", action="store_true", help="do not try re-delivering finished acks")
    g.add_argument("--max-states", type=positive_int, default=None, help="stop after this many states")
    g.add_argument("--max-seconds", type=positive_float, default=None, help="stop after this long")
    parser.add_argument("--stop-on-first", action="store_true", help="stop at the first violation")
    parser.add_argument("--max-violations", type=positive_int, default=5, help="distinct violations to collect (default 5)")
    parser.add_argument("--adapter", metavar="MODULE:CALLABLE", type=adapter_ref,
                        help="explore your own cache: a callable taking the Bounds and returning a CacheAdapter")
    parser.add_argument("--variant", metavar="JSON", type=json_kwargs,
                        help="keyword arguments for a block-store --adapter factory, as a JSON object")
    g.add_argument("--max-jobs", type=int, default=2, help="block stores: jobs in flight at once (default 2)")
    g.add_argument("--max-entries", type=int, default=None, help="block stores: keys held in a state to expand")
    parser.add_argument("--coverage", action="store_true", help="print which spec states/transitions were reached")
    parser.add_argument("--record", metavar="FILE",
                        help="write every transition fired while exploring to FILE (JSONL; "
                             "`hicache-fsm diagram NAME --counts FILE` draws it)")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    parser.add_argument("--json", action="store_true", help="print only one JSON object on stdout (the report goes to stderr)")
    DEFAULTS.update({f: parser.get_default(f) for f in BOUND_FLAGS})


def _how_far(result, args) -> str:
    if result.complete:
        return "complete"
    if result.violations and (args.stop_on_first or len(result.violations) >= args.max_violations):
        return "stopped at a violation"
    return "INCOMPLETE (stopped by --max-states / --max-seconds)"


# The search is exhaustive: each state tries every prompt and every eviction, so bounds must stay small.
MAX_PROMPTS = 4096
MAX_POOL_TOKENS = 1 << 20


def _check_bounds_are_small(args: argparse.Namespace) -> None:
    pages = args.max_len if args.max_len is not None else max(1, min(args.nodes, args.device_pages))
    prompts, per_length = 0, 1
    for _ in range(pages):  # stops as soon as the count is too big, however long --max-len is
        per_length *= args.alphabet
        prompts += per_length
        if prompts > MAX_PROMPTS:
            raise UsageError(f"--alphabet {args.alphabet} with prompts of up to {pages} pages gives more than "
                             f"{MAX_PROMPTS} prompts to try in every state (lower --alphabet or --max-len)")
    tokens = (args.device_pages + args.host_pages) * args.page_size * args.layers
    if tokens > MAX_POOL_TOKENS:
        raise UsageError(f"pools of {tokens} token-layers are far beyond what an exhaustive search can cover; "
                         f"keep (--device-pages + --host-pages) x --page-size x --layers under {MAX_POOL_TOKENS}")


def run(args: argparse.Namespace) -> int:
    if args.adapter:
        from hicache_fsm.commands.block_store import check_block_store

        status = check_block_store(args, DEFAULTS)  # None: a prefix-cache factory, explored below
        if status is not None:
            return status
    elif args.variant is not None:
        raise UsageError("--variant needs --adapter")
    return _check_prefix_cache(args)


BOUND_FLAGS = ("nodes", "device_pages", "host_pages", "layers", "page_size", "alphabet", "max_len", "locks", "pins",
               "write_policy", "eviction_policy", "track_hits", "no_redeliver", "max_states", "max_seconds")


def _defaults_only(args: argparse.Namespace, parser_defaults: dict) -> bool:
    return all(getattr(args, f) == parser_defaults[f] for f in BOUND_FLAGS)


def _check_portfolio(args: argparse.Namespace) -> int:
    """No bounds given: every family of ``testing.protocol.default_families`` (the whole protocol)."""
    from hicache_fsm.testing.explorer import Explorer
    from hicache_fsm.testing.paths import CoverageTracker
    from hicache_fsm.testing.protocol import default_families

    total = CoverageTracker()
    runs = []
    out = sys.stderr if args.json else sys.stdout
    for name, bounds, factory in default_families():
        cov = CoverageTracker()
        explorer = Explorer(factory, bounds, stop_on_first=args.stop_on_first, max_violations=args.max_violations,
                            progress=None, coverage=cov)
        result = explorer.run()
        total.merge(cov)
        runs.append((name, result))
        if result.complete:
            how = "complete"
        elif result.violations:
            how = "stopped at a violation"
        elif bounds.max_states is not None and result.states >= bounds.max_states:
            how = f"state budget {bounds.max_states} spent"
        else:
            how = f"time cap {bounds.max_seconds:g}s reached"
        print(f"{name}: {result.adapter}: {result.states} states, {result.transitions} transitions, max depth "
              f"{result.max_depth}, {how}, {len(result.violations)} violations, {result.seconds:.1f}s",
              file=out, flush=True)
        for v in result.violations:
            print(v.format(), file=out)
        if result.violations and args.stop_on_first:
            break
    report = total.report()
    if args.coverage or not args.json:
        print(total.format(), file=out)
    status = 1 if any(r.violations for _, r in runs) else 0
    if args.json:
        summary = {
            "states": sum(r.states for _, r in runs),
            "transitions": sum(r.transitions for _, r in runs),
            "violations": sum(len(r.violations) for _, r in runs),
            "seconds": round(sum(r.seconds for _, r in runs), 3),
            "complete": all(r.complete for _, r in runs),
            "coverage": coverage_summary(report),
            "coverage_detail": report,
            "runs": [dict(r.to_json(), family=name) for name, r in runs],
        }
        print(json.dumps(summary, sort_keys=True))
    return status


def coverage_summary(report: dict) -> dict:
    """``{machine: {"states": [hit, total], "transitions": [hit, total]}}`` from a ``CoverageTracker`` report."""
    return {m: {"states": [r["states"], r["states_total"]], "transitions": [r["transitions"], r["transitions_total"]]}
            for m, r in report.items()}


def _check_prefix_cache(args: argparse.Namespace) -> int:
    if not args.adapter and _defaults_only(args, DEFAULTS):
        return _check_portfolio(args)
    from hicache_fsm.testing.explorer import Bounds, Explorer, hicache_factory
    from hicache_fsm.testing.paths import CoverageTracker
    from hicache_fsm.testing.transition_log import RecordingCoverage, recording_writer

    _check_bounds_are_small(args)

    factory = hicache_factory
    if args.adapter:
        from hicache_fsm.commands.adapter_factory import load_factory

        factory = load_factory(args.adapter)
    policies = list(WRITE_POLICIES) if args.write_policy == "all" else [args.write_policy]
    runs = []
    status = 0
    writer = recording_writer(args.record)
    for policy in policies:
        bounds = Bounds(
            nodes=args.nodes, device_pages=args.device_pages, host_pages=args.host_pages, layers=args.layers,
            page_size=args.page_size, alphabet=args.alphabet, max_len=args.max_len, max_locks=args.locks,
            max_pins=args.pins, write_policy=policy, eviction_policy=args.eviction_policy,
            track_hits=args.track_hits, redeliver=not args.no_redeliver, max_states=args.max_states,
            max_seconds=args.max_seconds,
        )
        cov = CoverageTracker() if args.coverage or args.json else None
        if writer is not None:
            cov = RecordingCoverage(writer, recorded_by="check", objects=False, write_policy=policy)
        explorer = Explorer(factory, bounds, stop_on_first=args.stop_on_first, max_violations=args.max_violations,
                            progress=None if args.quiet else sys.stderr, coverage=cov)
        result = explorer.run()
        runs.append(result)
        if result.violations:
            status = 1
        out = sys.stderr if args.json else sys.stdout
        print(f"{result.adapter}: {result.states} states, {result.transitions} transitions, max depth "
              f"{result.max_depth}, {_how_far(result, args)}, "
              f"{len(result.violations)} violations, {result.seconds:.1f}s", file=out)
        for v in result.violations:
            print(v.format(), file=out)
        if args.coverage and cov is not None:
            print(cov.format(), file=out)
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
                "seconds": round(sum(r.seconds for r in runs), 3),
                "complete": all(r.complete for r in runs),
                "runs": [r.to_json() for r in runs],
            }
        print(json.dumps(summary, sort_keys=True))
    return status
