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

from hicache_fsm import __version__
from hicache_fsm.bench import BENCHMARKS
from hicache_fsm.commands.args import Parser, UsageError, printable, sigterm_interrupts, signals_held
from hicache_fsm.errors import HiCacheError

# Subcommand name -> (module exposing ``configure(parser)`` and ``run(args) -> int``, one-line help).
# The help lines live here so that naming every command imports none of them: a command's
# module is imported only to run it, and ``list``/``validate``/``diagram`` never import torch.
COMMANDS = {
    "list": ("hicache_fsm.commands.list_specs", "List the specs: machine name, number of states and transitions, file."),
    "validate": ("hicache_fsm.commands.validate",
                 "Validate spec files: print `ok FILE` for each valid one, `FILE:LINE: message` for every problem."),
    "diagram": ("hicache_fsm.commands.diagram",
                "Draw a spec as a mermaid, Graphviz dot or SVG diagram; with --counts, as a heat map of a recorded run."),
    "simulate": ("hicache_fsm.commands.simulate",
                 "Run a multi-turn chat workload (or replay a trace) through the cache tiers and compare them."),
    "check": ("hicache_fsm.commands.check",
              "Exhaustively explore the composed cache protocol within small bounds and check every invariant."),
    "fuzz": ("hicache_fsm.commands.fuzz",
             "Fuzz the cache protocol with the hypothesis state machine, outside pytest, reproducibly."),
    "replay": ("hicache_fsm.commands.replay",
               "Check that a recorded JSONL trace is a valid run of the specs; report the first divergence."),
}
BENCH = "bench"
_NONE = ""


def _add_bench(sub: argparse._SubParsersAction, benchmarks: Sequence[str]) -> None:
    """The ``bench`` command; only the ``benchmarks`` named are configured (their modules imported)."""
    bench = sub.add_parser(BENCH, help="run a benchmark against a same-run baseline")
    bench_sub = bench.add_subparsers(dest="benchmark", required=True)
    for name, (path, help_line) in BENCHMARKS.items():
        p = bench_sub.add_parser(name, help=help_line)
        if name not in benchmarks:
            continue
        module = importlib.import_module(path)
        p.add_argument("--json", action="store_true", help="print only one JSON object on stdout (the report goes to stderr)")
        module.configure(p)
        p.set_defaults(_run=lambda args, m=module: (m.run(args), 0)[1], _parser=p)


def build_parser(only: str | None = None, benchmark: str = _NONE) -> argparse.ArgumentParser:
    """The parser naming every subcommand; with ``only``, just that one is configured.

    Configuring a subcommand imports its module, so ``main`` configures only the
    command it runs (``only=""``: none, for ``--help`` and usage errors), and of ``bench``
    only the ``benchmark`` it runs; tests and docs checks use the full parser.
    """
    parser = Parser(prog="hicache-fsm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"hicache-fsm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (path, help_line) in COMMANDS.items():
        p = sub.add_parser(name, help=help_line)
        if only is None or only == name:
            module = importlib.import_module(path)
            module.configure(p)
            p.set_defaults(_run=module.run, _parser=p)
    _add_bench(sub, list(BENCHMARKS) if only is None else [benchmark] if only == BENCH else [])
    return parser


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return printable(f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror)
    return printable(" ".join(str(exc).split())) or type(exc).__name__


def _command_in(argv: Sequence[str]) -> tuple[str, str]:
    """The subcommand ``argv`` names (its first non-option word) and, for ``bench``, the benchmark
    (the second); "" where none is known."""
    words = [a for a in argv if not a.startswith("-")][:2] + [_NONE, _NONE]
    command = words[0] if words[0] in COMMANDS or words[0] == BENCH else _NONE
    return command, words[1] if command == BENCH and words[1] in BENCHMARKS else _NONE


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any("\0" in str(arg) for arg in argv):  # a real command line cannot carry one; paths would raise ValueError
        print("hicache-fsm: error: arguments cannot contain NUL characters", file=sys.stderr)
        return 2
    command, benchmark = _command_in(argv)
    name = " ".join(["hicache-fsm", *filter(None, (command, benchmark))])
    try:  # SIGTERM (a timeout, a stop) cleans up as Ctrl-C does: temp dirs, threads
        with sigterm_interrupts():
            with signals_held():  # building the parser imports the command's module (torch, seconds)
                args, extras = build_parser(only=command, benchmark=benchmark).parse_known_args(argv)
            if extras:  # the command's own parser names them: `hicache-fsm fuzz: error: ... (see ... fuzz --help)`
                args._parser.error(f"unrecognized arguments: {' '.join(extras)}")
            name = "hicache-fsm " + args.command + (f" {args.benchmark}" if args.command == BENCH else "")
            return int(args._run(args) or 0)
    except UsageError as exc:  # worded as argparse's own usage errors (``Parser.error``)
        print(f"{name}: error: {_one_line(exc)} (see {name} --help)", file=sys.stderr)
        return 2
    except (HiCacheError, OSError) as exc:  # MissingExtra too: it names the extra to install
        print(f"{name}: {_one_line(exc)}", file=sys.stderr)
        return 1
    except MemoryError as exc:  # sizes the machine cannot hold (numpy says how much it wanted)
        print(f"{name}: not enough memory: {_one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
