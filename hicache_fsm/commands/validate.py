"""Validate spec files: print `ok FILE` for each valid one, `FILE:LINE: message` for every problem.

Any spec file validates without Python: guard, effect and invariant names are
checked against their bindings only for the library's own machines, or for
every file with ``--require-bindings``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Iterable

from hicache_fsm.commands.args import UsageError, printable
from hicache_fsm.errors import SpecError
from hicache_fsm.spec import SPEC_DIR, load_spec, spec_paths


def display_path(path: str | Path) -> str:
    """``path`` relative to the working directory when it lies below it; a file of the installed
    package as ``hicache_fsm/...`` (wherever the package is); else as given. Printable: bytes of a
    name that are not UTF-8, and control characters, as backslash escapes."""
    return printable(_relative(path))


def _relative(path: str | Path) -> str:
    p = Path(path)
    try:
        rel = os.path.relpath(p)
    except ValueError:  # another drive on Windows
        return str(p)
    if not rel.startswith(".."):
        return rel
    package = SPEC_DIR.parent
    try:
        return Path(package.name, p.resolve().relative_to(package.resolve())).as_posix()
    except ValueError:
        return str(p)


def expand_paths(args: Iterable[str]) -> list[Path]:
    """Files named on the command line; a directory stands for its ``*.yaml`` files."""
    out: list[Path] = []
    for arg in args:
        if not arg:  # Path("") is the working directory: read as a spec file's name, it names none
            raise UsageError("an empty PATH names no spec file")
        p = Path(arg)
        out.extend(spec_paths(p) if p.is_dir() else [p])
    return out


def problem_lines(err: SpecError) -> list[str]:
    """Every problem of a ``SpecError`` as ``FILE:LINE: message`` (``FILE: message`` without a line)."""
    problems = err.problems
    out = []
    for p in problems:
        where = display_path(p.path) if p.path and not p.path.startswith("<") else p.path
        out.append(f"{where}:{p.line}: {p.message}" if p.line is not None else f"{where}: {p.message}")
    return out


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "paths", nargs="*", metavar="PATH",
        help="spec files or directories of them (default: every spec in the library's specs/)",
    )
    add_bindings_flag(parser)


def add_bindings_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--require-bindings", action="store_true",
        help="also require a registered Python implementation of every guard, effect and invariant "
             "(always checked for the library's own machines)",
    )


def run(args: argparse.Namespace) -> int:
    paths = expand_paths(args.paths) if args.paths else spec_paths(SPEC_DIR)
    if not paths:
        raise UsageError("no spec files found")
    failed = 0
    for path in paths:
        try:
            load_spec(path, require_bindings=args.require_bindings or None)
        except SpecError as err:
            failed += 1
            for line in problem_lines(err):
                print(printable(line), file=sys.stderr)
        else:
            print(f"ok {display_path(path)}")
    return 1 if failed else 0
