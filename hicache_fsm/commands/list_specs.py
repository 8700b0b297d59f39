"""List the specs: machine name, number of states and transitions, file.

A transition is counted per source state (one ``source: [a, b]`` entry is two
transitions), as ``check`` counts its coverage, so the two report the same total.
"""

from __future__ import annotations

import argparse
import json
import sys

from hicache_fsm.commands.args import UsageError, printable
from hicache_fsm.commands.validate import display_path, expand_paths, problem_lines
from hicache_fsm.errors import SpecError
from hicache_fsm.spec import SPEC_DIR, load_spec, spec_paths


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="*", metavar="PATH", help="spec files or directories (default: the library's specs/)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per spec instead of a table")


def run(args: argparse.Namespace) -> int:
    paths = expand_paths(args.paths) if args.paths else spec_paths(SPEC_DIR)
    if not paths:  # as ``validate``: an empty listing would read as a success
        raise UsageError("no spec files found")
    rows = []
    status = 0
    for path in paths:
        try:
            spec = load_spec(path)
        except SpecError as err:
            status = 1
            for line in problem_lines(err):
                print(printable(line), file=sys.stderr)
            continue
        edges = {(t.trigger, source, t.dest) for t in spec.transitions for source in t.sources}
        rows.append({"name": spec.name, "states": len(spec.states), "transitions": len(edges),
                     "entries": len(spec.transitions), "file": display_path(path)})
    if args.json:
        for row in rows:
            print(json.dumps(row, sort_keys=True))
        return status
    if not rows:  # every spec failed to load: its problems are on stderr, no table to show
        return status
    header = ("name", "states", "transitions", "spec entries", "file")
    table = [header] + [(r["name"], str(r["states"]), str(r["transitions"]), str(r["entries"]), r["file"])
                        for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        cells = [row[0].ljust(widths[0]), *(row[i].rjust(widths[i]) for i in (1, 2, 3)), row[4]]
        print("  ".join(cells).rstrip())
    return status
