"""Draw a spec as a mermaid, Graphviz dot or SVG diagram; with --counts, as a heat map of a recorded run.

Any spec file draws without Python bindings (``--require-bindings`` checks
them too). ``--counts TRACE`` reads a JSONL trace (``simulate``, ``fuzz`` or
``check`` with ``--record``, or ``hicache_fsm.testing.record``) and puts on
every transition how often it fired and on every state how many objects sat in
it (see ``hicache_fsm.heatmap``).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from hicache_fsm.commands.args import UsageError, path_arg, printable
from hicache_fsm.commands.validate import add_bindings_flag, problem_lines
from hicache_fsm.diagrams import RENDERERS, render
from hicache_fsm.errors import DiagramError, SpecError, TraceError
from hicache_fsm.output_files import write_output_text
from hicache_fsm.spec import Spec, load_all, load_builtin, load_spec, spec_paths

if TYPE_CHECKING:  # heatmap loads with --counts only
    from hicache_fsm.heatmap import Heat

EXTENSIONS = {"mermaid": "mmd", "dot": "dot", "svg": "svg"}


def resolve_spec(target: str, require_bindings: bool | None = None) -> Spec:
    """A library machine name (``residency``) or a path to a spec file; ``UsageError`` for neither."""
    p = Path(target)
    if p.suffix in (".yaml", ".yml") or _is_file(p) or "/" in target or "\\" in target:
        return load_spec(p, require_bindings=require_bindings)
    known = [path.stem for path in spec_paths()]
    if target not in known:
        close = difflib.get_close_matches(target, known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UsageError(f"no machine named {target!r}; {hint}known: {', '.join(known)} (or give a spec file path)")
    return load_builtin(target)


def _is_file(path: Path) -> bool:
    """``path.is_file()``, False where the name cannot be a file here (too long: ``is_file`` raised ENAMETOOLONG)."""
    try:
        return path.is_file()
    except OSError:
        return False


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", nargs="?", metavar="NAME|PATH", help="a machine name (see `hicache-fsm list`) or a spec file")
    parser.add_argument("--all", action="store_true", help="draw every spec of the library")
    parser.add_argument("--format", "-f", choices=sorted(RENDERERS), default="mermaid", help="output format (default: mermaid)")
    parser.add_argument(
        "-o", "--output", metavar="FILE", type=path_arg,
        help="write to FILE instead of stdout (with --all: a directory, one NAME.EXT file per spec)",
    )
    parser.add_argument(
        "--counts", metavar="TRACE", type=path_arg,
        help="draw a heat map of the run recorded in this JSONL trace: fire count per transition, "
             "objects per state (with --all: every machine the trace has transitions of)",
    )
    add_bindings_flag(parser)


def _heat_maps(specs: list[Spec], trace: str, fmt: str, all_specs: bool) -> list[tuple[Spec, str]]:
    from hicache_fsm.event_trace import read_events
    from hicache_fsm.heatmap import machines_in, render_heat, tally

    events = read_events(trace)
    recorded = machines_in(events)
    if all_specs:
        specs = [s for s in specs if s.name in recorded]
    missing = [s.name for s in specs if s.name not in recorded]
    if missing or not specs:
        has = ", ".join(recorded) or "none"
        raise DiagramError(f"{trace} records no transitions of {', '.join(missing) or 'any library machine'} "
                           f"(it has transitions of: {has})")
    return [(spec, render_heat(spec, _printable_heat(tally(events, spec)), fmt)) for spec in specs]


def _printable_heat(heat: Heat) -> Heat:
    """``heat`` with the trace's own words escaped where UTF-8 cannot hold them: Graphviz is fed UTF-8 too."""
    return attrs.evolve(heat, recorded_by=printable(heat.recorded_by))


def run(args: argparse.Namespace) -> int:
    if bool(args.spec) == bool(args.all):
        raise UsageError("give one NAME|PATH, or --all")
    try:
        specs = load_all() if args.all else [resolve_spec(args.spec, args.require_bindings or None)]
        if args.counts:
            texts = _heat_maps(specs, args.counts, args.format, args.all)
        else:
            texts = [(spec, render(spec, args.format)) for spec in specs]
    except SpecError as err:
        for line in problem_lines(err):
            print(printable(line), file=sys.stderr)
        return 1
    except TraceError as err:  # --counts names a file that is not a trace: a usage error
        print(printable(f"hicache-fsm diagram: error: --counts {err}"), file=sys.stderr)
        return 2
    except (DiagramError, ValueError, OSError) as err:
        print(printable(f"hicache-fsm diagram: {err}"), file=sys.stderr)
        return 1
    if args.output and args.all:
        out_dir = Path(args.output)
        out_dir.mkdir(parents=True, exist_ok=True)
        for spec, text in texts:
            write_output_text(out_dir / f"{spec.name}.{EXTENSIONS[args.format]}", text)
        return 0
    if args.output:
        write_output_text(args.output, texts[0][1])
        return 0
    for i, (spec, text) in enumerate(texts):
        if args.all:
            if i:
                print()
            if args.format == "mermaid":
                print(f"%% {spec.name}")
            elif args.format == "dot":
                print(f"// {spec.name}")
        sys.stdout.write(text)
    return 0
