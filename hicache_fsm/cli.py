"""The ``hicache-fsm`` command line: one subcommand per job, loaded lazily.

Exit statuses are the same for every subcommand: 0 success, 1 a failed check
or a runtime error (the library's typed errors, a file that cannot be
written, storage that cannot be reached), 2 a usage error (a bad option
value, an adapter or input that cannot be used). Errors are one line on
stderr, never a traceback; ``main`` is the one place that maps them.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from hicache_fsm.bench import BENCHMARKS
from hicache_fsm.commands.args import Parser, UsageError
from hicache_fsm.errors import HiCacheError

# Subcommand name -> module exposing ``configure(parser)`` and ``run(args) -> int``.
COMMANDS = {
    "list": "hicache_fsm.commands.list_specs",
    "validate": "hicache_fsm.commands.validate",
    "diagram": "hicache_fsm.commands.diagram",
    "simulate": "hicache_fsm.commands.simulate",
    "check": "hicache_fsm.commands.check",
    "fuzz": "hicache_fsm.commands.fuzz",
    "replay": "hicache_fsm.commands.replay",
}


def _available(modules: dict[str, str]) -> dict[str, object]:
    found = {}
    for name, path in modules.items():
        try:
            found[name] = importlib.import_module(path)
        except ModuleNotFoundError as exc:
            if exc.name != path:
                raise
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="hicache-fsm", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in _available(COMMANDS).items():
        p = sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        module.configure(p)
        p.set_defaults(_run=module.run)
    bench = sub.add_parser("bench", help="run a benchmark against a same-run baseline")
    bench_sub = bench.add_subparsers(dest="benchmark", required=True)
    for name, module in _available(BENCHMARKS).items():
        p = bench_sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        p.add_argument("--json", action="store_true", help="print only one JSON object on stdout (the report goes to stderr)")
        module.configure(p)
        p.set_defaults(_run=lambda args, m=module: (m.run(args), 0)[1])
    return parser


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    return " ".join(str(exc).split()) or type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    name = "hicache-fsm " + args.command + (f" {args.benchmark}" if args.command == "bench" else "")
    try:
        return int(args._run(args) or 0)
    except UsageError as exc:
        print(f"{name}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except (HiCacheError, OSError) as exc:
        print(f"{name}: {_one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
