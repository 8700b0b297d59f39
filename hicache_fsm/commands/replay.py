"""Check that a recorded JSONL trace is a valid run of the specs; report the first divergence.

Each transition must be legal from the object's recorded state, each
acknowledgement must match a pending job, each job must complete exactly
once (see ``hicache_fsm.testing.trace``). Exit status 0 when the trace is
valid, 1 at the first divergence (printed with the events before it) or for a
``--spec`` that is not a valid spec (its ``FILE:LINE`` lines), 2 when the trace
cannot be read.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from hicache_fsm.commands.args import bounded_int, path_arg, printable
from hicache_fsm.commands.validate import problem_lines

MAX_CONTEXT = 10_000  # events kept to show before a divergence


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", metavar="TRACE", type=path_arg,
                        help="JSONL trace file (from hicache_fsm.testing.trace.record)")
    parser.add_argument("--quiescent", action="store_true", help="also require no job or copy left in flight at the end")
    parser.add_argument("--spec", action="append", default=[], metavar="FILE", type=path_arg,
                        help="also check against this spec file (a machine of your own cache); repeatable")
    parser.add_argument("--context", type=bounded_int(0, MAX_CONTEXT), default=4,
                        help=f"events shown before a divergence, at most {MAX_CONTEXT} (default 4)")
    parser.add_argument("--json", action="store_true", help="print only one JSON object on stdout (the report goes to stderr)")


def run(args: argparse.Namespace) -> int:
    from hicache_fsm.errors import SpecError
    from hicache_fsm.spec import load_all, load_spec
    from hicache_fsm.testing.trace import load_trace, replay

    try:
        specs = load_all() + [load_spec(p) for p in args.spec]
    except SpecError as exc:  # a spec that fails validation: exit 1 with its problems, as `validate` reports them
        for line in problem_lines(exc):
            print(printable(line), file=sys.stderr)
        return 1
    try:
        events = load_trace(Path(args.trace))  # a path, whatever it reads like (a string may hold a trace's text)
    except OSError as exc:
        print(printable(f"hicache-fsm replay: cannot read {exc.filename or args.trace}: {exc.strerror or exc}"),
              file=sys.stderr)
        return 2
    except ValueError as exc:
        print(printable(f"hicache-fsm replay: {exc}"), file=sys.stderr)
        return 2
    result = replay(events, specs, require_quiescent=args.quiescent, context=args.context)
    out = sys.stderr if args.json else sys.stdout
    if result.ok:
        print(f"ok: {result.events} events, {result.transitions} transitions, {result.jobs} jobs, "
              f"{result.completions} completions, {len(result.pending_jobs)} jobs still pending", file=out)
    else:
        print(printable(f"divergence in {args.trace}:"), file=out)
        print(printable(result.divergence.format()), file=out)
    if args.json:
        print(json.dumps(strict_json(result.to_json()), sort_keys=True, allow_nan=False))
    return 0 if result.ok else 1


def strict_json(value: object) -> object:
    """``value`` with every non-finite float as a string ("inf", "nan"): a trace's ``1e999`` must not make
    stdout ``Infinity``, which strict JSON readers refuse. (The trace's nesting is bounded when it is read.)"""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value
