"""Fuzz the cache protocol with the hypothesis state machine, outside pytest, reproducibly.

Runs ``CacheProtocolMachine`` (engine and executor steps in random orders,
every invariant checked after every step) for ``--examples`` runs of up to
``--steps`` steps from ``--seed``. Progress on stderr. On failure it prints the
shrunk failing program and a runnable pytest test replaying it (also written
to ``--test-out``), and exits 1. A run in which the adapter accepted no insert
checked nothing: it fails too (exit 1), with no program to show. With ``--json``
stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from hicache_fsm.commands.args import UsageError, adapter_ref, json_kwargs, output_path, positive_int, seed_int
from hicache_fsm.output_files import write_output_text


STEPS = 40  # most steps per run by default (``--cp``, ``--adapter``)
HICACHE_STEPS = 60  # the HiCache variants: L3 prefetches that fail or land short are many steps deep


def default_steps(args: argparse.Namespace) -> int:
    """``--steps``, or its default for the machine the other flags choose."""
    if args.steps is not None:
        return args.steps
    return STEPS if args.cp or args.adapter else HICACHE_STEPS


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--examples", type=positive_int, default=100, help="state-machine runs (default 100)")
    parser.add_argument("--steps", type=positive_int, default=None,
                        help=f"most steps per run (default {HICACHE_STEPS} for the HiCache variants, whose storage "
                             f"and prefetch paths lie deeper; {STEPS} with --cp or --adapter)")
    parser.add_argument("--seed", type=seed_int, default=0, help="random seed, a 64-bit integer; same seed, same runs "
                        "(default 0)")
    parser.add_argument("--no-shrink", action="store_true", help="report the first failure as found")
    parser.add_argument("--adapter", metavar="MODULE:CALLABLE", type=adapter_ref,
                        help="fuzz your own cache: a callable returning a CacheAdapter")
    parser.add_argument("--variant", metavar="JSON", action="append", type=json_kwargs,
                        help="keyword arguments for the --adapter factory, as a JSON object (repeat to draw among several)")
    parser.add_argument("--cp", action="store_true",
                        help="fuzz CP layer writes (1 and 2 context-parallel ranks, target and draft layers) "
                             "instead of the HiCache variants")
    parser.add_argument("--test-out", metavar="FILE", type=output_path,
                        help="write the regression test for a failure here (it runs from any directory)")
    parser.add_argument("--coverage", action="store_true",
                        help="also print the per-machine coverage with --json (it is always in the report)")
    parser.add_argument("--record", metavar="FILE", type=output_path,
                        help="write every transition the runs fire to FILE (JSONL, one run per example; "
                             "`hicache-fsm diagram NAME --counts FILE` draws it)")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    parser.add_argument("--json", action="store_true", help="print only one JSON object on stdout (the report goes to stderr)")



def run(args: argparse.Namespace) -> int:
    from hicache_fsm.testing.explorer import quiet_cache_logs
    from hicache_fsm.testing.paths import CoverageTracker
    from hicache_fsm.testing.transition_log import RecordingCoverage, recording_writer
    from hicache_fsm.testing.stateful import (
        BrokenFactory,
        CacheProtocolMachine,
        VariantRefused,
        cp_machine,
        hicache_machine,
        run_fuzz,
    )

    variants = args.variant or [{}]
    if args.variant and not args.adapter:
        raise UsageError("--variant needs --adapter")
    if args.cp and args.adapter:
        raise UsageError("--cp fuzzes the built-in CP adapter; it cannot be combined with --adapter")
    args.steps = default_steps(args)
    factory = None
    if args.adapter:
        from hicache_fsm.commands.adapter_factory import import_lines, load_factory
        from hicache_fsm.commands.block_store import fuzz_block_store

        # None: every --variant made a prefix cache (a factory that cannot was refused there), fuzzed below
        status = fuzz_block_store(args, variants, _report)
        if status is not None:
            return status
        factory = load_factory(args.adapter)
    writer = recording_writer(args.record)  # opened (emptying the file) once the arguments passed
    cov = CoverageTracker() if writer is None else RecordingCoverage(writer, recorded_by="fuzz", objects=True)
    if args.cp:
        machine = cp_machine(coverage=cov)
        machine_import = ("from hicache_fsm.testing.stateful import cp_machine\n"
                          "CPMachine = cp_machine(name='CPMachine')")
    elif factory is not None:
        machine = CacheProtocolMachine.bind(factory, name="AdapterMachine", coverage=cov, variants=variants)
        machine_import = (f"from hicache_fsm.testing import CacheProtocolMachine\n"
                          f"{import_lines(args.adapter, '_factory')}\n"
                          f"AdapterMachine = CacheProtocolMachine.bind(_factory, name='AdapterMachine', "
                          f"variants={variants!r})")
    else:
        machine = hicache_machine(coverage=cov)
        machine_import = None
    try:
        with quiet_cache_logs():
            result = run_fuzz(machine, examples=args.examples, steps=args.steps, seed=args.seed,
                              progress=None if args.quiet else sys.stderr, shrink=not args.no_shrink,
                              machine_import=machine_import)
    except (VariantRefused, BrokenFactory) as exc:  # a --variant the factory cannot build: the call's mistake
        raise UsageError(f"--adapter {args.adapter}: {exc}") from None
    finally:
        if writer is not None:
            writer.close()
    out = sys.stderr if args.json else sys.stdout
    _report(result, args, out)
    if cov.format() and (args.coverage or not args.json):  # per machine, like `check`
        print(cov.format(), file=out)
    if args.json:
        print(json.dumps(result.to_json(), sort_keys=True))
    return 0 if result.ok else 1


def _report(result, args: argparse.Namespace, out) -> None:
    """The run's outcome; on a failure, its steps and a regression test (also to ``--test-out``)."""
    if result.ok:
        print(f"fuzz: {result.examples} runs of up to {args.steps} steps, seed {args.seed}: no failure "
              f"({result.seconds:.1f}s)", file=out)
        return
    print(f"fuzz: FAILED after {result.examples} runs (seed {args.seed}, {result.seconds:.1f}s): "
          f"{failure_line(result)}", file=out)
    if result.checked_nothing or not result.steps:  # no failing program, so no regression test to show
        return
    print("\n".join(["", "failing steps:", *(f"  {line}" for line in result.steps), "", "regression test:", "",
                     result.test_code]), file=out)
    if args.test_out:
        write_output_text(args.test_out, result.test_code)
        print(f"(written to {args.test_out})", file=out)


def failure_line(result) -> str:
    """The failure in one line: the error, the first invariant it names, and the step it broke at."""
    lines = [line.strip() for line in (result.failure or "").splitlines() if line.strip()]
    if not lines:
        return ""
    head = lines[0]
    if head.endswith(":") and len(lines) > 1:  # "invariant catalogue:" then one problem per line
        head = f"{head} {lines[1]}"
    steps = [s for s in result.steps if RULE_LINE.match(s.strip())]
    return f"{head} (at step {len(steps)} of the failing steps)" if steps else head


# A rule of the failing program (``state.evict(...)``, ``prompts_1 = state.insert(...)``); not the machine's own
# calls around them (its checks, teardown, the variant's confirmation)
RULE_LINE = re.compile(r"^(\w+ = )?state\.(?!check\(|teardown\(|expect_variant\()\w+\(")

