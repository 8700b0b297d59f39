"""Command output shown in the docs comes from running the command.

Every fenced block of ``README.md`` and ``docs/*.md`` whose info string is
``text``, ``console`` or empty, and every block holding a ``$ `` line, carries
an HTML comment on the line just before its fence that says what it is:

``<!-- transcript -->``
    ``$ COMMAND`` lines, each followed by what the command prints. A command
    ending in ``\\`` continues on the next line. The commands run in order,
    under bash, in a fresh temporary directory where ``examples/`` is the
    repository's, ``hicache-fsm`` is this checkout's ``python -m hicache_fsm``
    and ``PYTHONHASHSEED=0``; the block shows what they write to stdout
    (progress and timings on stderr are left out). Options, after a colon:

    - ``stderr``: show stderr too, after stdout;
    - ``head=N``: show each command's first N lines, then ``...``;
    - ``select=REGEX``: show only the lines ``re.search`` finds REGEX in, a
      ``...`` line standing for each run of lines left out;
    - ``cwd=snippets``: run in the directory where the page's ```python blocks
      ran (in order, as ``tests/test_docs_snippets.py`` runs them, up to the
      page's last block marked ``cwd=snippets`` or ``python``);
    - ``python``: no commands: the block shows what the ```python block just
      above it printed, the page's blocks running in order in one namespace.

``<!-- not-run: REASON -->``
    command output this tool does not run (a timing benchmark, several
    processes, minutes of CPU); the test lists every such block with its reason.

``<!-- not-output: WHAT -->``
    not a command's output (a synopsis, a diagram, a formula).

Output is compared after normalising what genuinely varies between runs, and
nothing else: a duration (a number followed by ``s``, ``ms``, ``us``, ``µs`` or
``ns``) reads ``<time>``; a memory address (``0x`` and at least six hex digits)
reads ``<addr>``; a run of spaces reads as one space and a run of three or more
``-`` as ``---`` (a table's columns are as wide as their widest cell, which may be
a timing); the repository's absolute path reads ``/path/to/repo`` and the
run directory's ``/path/to/cwd`` (both are also written that way). When a block is
rewritten, a command's output that reads the same once normalised keeps its old
text, so the timings in the docs change only with the output around them::

    python -m hicache_fsm.docs_transcripts           # exit 1 and show a diff for each drifted block
    python -m hicache_fsm.docs_transcripts --write   # rewrite the drifted blocks from real runs
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REGENERATE = "python -m hicache_fsm.docs_transcripts --write"
CHECKED_INFO = {"", "text", "console"}
MARKER = re.compile(r"^<!--\s*(transcript|not-run|not-output)\s*(?::\s*(.*?))?\s*-->\s*$")
FENCE = re.compile(r"^(`{3,})([\w+-]*)\s*$")
SECTION = "\x1e"
HANG_GUARD_S = 900  # a hung command fails loudly; no verdict depends on it


class TranscriptError(ValueError):
    """A marker or transcript block this module cannot read."""


@dataclass
class Block:
    """One fenced block of a page: where it is, what it holds, how it is marked."""

    page: Path
    line: int  # 1-based line of the opening fence
    info: str
    body: list[str]
    kind: str | None = None  # transcript, not-run, not-output, or None (unmarked)
    note: str = ""  # the marker's options or reason
    options: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{_shown_path(self.page)}:{self.line}"


def _shown_path(page: Path) -> str:
    return str(page.relative_to(REPO)) if page.is_relative_to(REPO) else page.name


def doc_pages(root: Path = REPO) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def parse_blocks(page: Path, text: str | None = None) -> list[Block]:
    """Every fenced block of a Markdown page, with the marker on the line before it."""
    lines = (page.read_text(encoding="utf-8") if text is None else text).splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info = m.group(1), m.group(2)
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence), None)
        if end is None:
            raise TranscriptError(f"{page.name}:{i + 1}: fence never closed")
        block = Block(page, i + 1, info, lines[i + 1 : end])
        marker = MARKER.match(lines[i - 1]) if i else None
        if marker:
            block.kind, block.note = marker.group(1), (marker.group(2) or "").strip()
            if block.kind == "transcript":
                block.options = _options(block)
        blocks.append(block)
        i = end + 1
    return blocks


def _options(block: Block) -> dict[str, str]:
    out = {}
    for word in shlex.split(block.note):
        key, _, value = word.partition("=")
        if key not in {"stderr", "head", "select", "cwd", "python"}:
            raise TranscriptError(f"{block.where}: unknown transcript option {key!r}")
        out[key] = value
    if "head" in out and not out["head"].isdigit():
        raise TranscriptError(f"{block.where}: head= needs a number of lines")
    if out.get("cwd", "snippets") != "snippets":
        raise TranscriptError(f"{block.where}: cwd= takes only 'snippets'")
    return out


def needs_marker(block: Block) -> bool:
    """A block that could show command output: plain text, console, or one with a ``$`` line."""
    return block.info in CHECKED_INFO or (block.info != "python" and any(ln.startswith("$ ") for ln in block.body))


def commands(block: Block) -> list[tuple[str, list[str]]]:
    """(command, output lines shown) of a transcript block."""
    if "python" in block.options:
        return [("", block.body)]
    out: list[tuple[str, list[str]]] = []
    lines = iter(block.body)
    for line in lines:
        if line.startswith("$ "):
            cmd = [line[2:]]
            while cmd[-1].endswith("\\"):
                cmd.append(next(lines, ""))
            out.append(("\n".join(cmd), []))
        elif not out:
            raise TranscriptError(f"{block.where}: a transcript starts with a `$ ` command line")
        else:
            out[-1][1].append(line)
    return out


# -- normalising -----------------------------------------------------------------------

_DURATION = re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s?(?:ms|us|µs|ns|s)\b")
_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]{6,}\b")
_SPACES = re.compile(r" {2,}")
_RULE = re.compile(r"-{3,}")


def normalise(line: str) -> str:
    """The line with its durations, memory addresses and column padding masked (see the module doc)."""
    line = _ADDRESS.sub("<addr>", _DURATION.sub("<time>", line))
    return _RULE.sub("---", _SPACES.sub(" ", line))


def shown(output: str, options: dict[str, str]) -> list[str]:
    """What a block shows of a command's output, after ``select=`` and ``head=``."""
    lines = output.rstrip("\n").splitlines() if output.strip() else []
    if "select" in options:
        pattern, kept, gap = re.compile(options["select"]), [], False
        for line in lines:
            if pattern.search(line):
                kept.append(line)
                gap = False
            elif not gap:
                kept.append("...")
                gap = True
        lines = kept
    if "head" in options and len(lines) > int(options["head"]):
        lines = [*lines[: int(options["head"])], "..."]
    return lines


def merge(old: list[str], new: list[str]) -> list[str]:
    """``old`` when it reads the same as ``new`` once normalised, else ``new`` (whole, so tables stay aligned)."""
    return old if [normalise(x) for x in old] == [normalise(x) for x in new] else new


# -- running -----------------------------------------------------------------------------


def _environment(bin_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "COV_", "HYPOTHESIS"))}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               PYTHONHASHSEED="0", PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", COLUMNS="100",
               PYTHONIOENCODING="utf-8")
    return env


def _shims(bin_dir: Path) -> None:
    """``hicache-fsm`` and ``python`` on PATH mean this interpreter and this checkout."""
    for name, args in (("hicache-fsm", " -m hicache_fsm"), ("python", "")):
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)}{args} "$@"\n', encoding="utf-8")
        shim.chmod(0o755)


def _paths_masked(text: str, cwd: Path) -> str:
    for path, name in ((cwd.resolve(), "/path/to/cwd"), (cwd, "/path/to/cwd"), (REPO, "/path/to/repo")):
        text = text.replace(str(path), name)
    return text


def run_command(command: str, cwd: Path, env: dict[str, str], stderr: bool) -> str:
    proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=HANG_GUARD_S, stdin=subprocess.DEVNULL)
    return _paths_masked(proc.stdout + (proc.stderr if stderr else ""), cwd)


_RUNNER = """\
import json, sys
page, blocks = json.load(open(sys.argv[1], encoding="utf-8"))
namespace = {"__name__": "docs_page"}
for line, code in blocks:
    print("\\x1e", flush=True)
    exec(compile("\\n" * (line - 1) + code, page, "exec"), namespace)
sys.stdout.flush()
"""


def run_snippets(page: Path, cwd: Path, env: dict[str, str], scratch: Path, until: int) -> list[str]:
    """Run the page's ```python blocks above line ``until`` in ``cwd``; return what each printed."""
    from_test = [(b.line + 1, "\n".join(b.body) + "\n") for b in python_blocks(page) if b.line < until]
    spec = scratch / "blocks.json"
    spec.write_text(json.dumps([_shown_path(page), from_test]), encoding="utf-8")
    runner = scratch / "runner.py"
    runner.write_text(_RUNNER, encoding="utf-8")
    proc = subprocess.run([sys.executable, str(runner), str(spec)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=HANG_GUARD_S, stdin=subprocess.DEVNULL)
    if proc.returncode:
        raise TranscriptError(f"{page.name}: its python blocks failed:\n{proc.stderr[-3000:]}")
    return [_paths_masked(part.removeprefix("\n"), cwd) for part in proc.stdout.split(SECTION + "\n")[1:]]


def python_blocks(page: Path) -> list[Block]:
    """The page's runnable ```python blocks (not marked ``<!-- no-test -->``)."""
    lines = page.read_text(encoding="utf-8").splitlines()

    def runnable(block: Block) -> bool:
        before = [line for line in lines[: block.line - 1] if line.strip()]
        return not before or before[-1].strip() != "<!-- no-test -->"

    return [b for b in parse_blocks(page) if b.info == "python" and runnable(b)]


@dataclass
class Result:
    """A transcript block and what it should read after running it now."""

    block: Block
    expected: list[str]  # the block's body as it should read

    @property
    def drifted(self) -> bool:
        return [normalise(x) for x in self.block.body] != [normalise(x) for x in self.expected]

    def diff(self) -> str:
        return "\n".join(difflib.unified_diff(self.block.body, self.expected, f"{self.block.where} (docs)",
                                              f"{self.block.where} (run now)", lineterm=""))


@contextmanager
def _workspace() -> Iterator[tuple[Path, dict[str, str], Path]]:
    """A fresh run directory (with the repository's ``examples/``), its environment and a scratch directory."""
    with tempfile.TemporaryDirectory(prefix="docs-transcript-") as tmp:
        scratch, cwd, bin_dir = Path(tmp) / "scratch", Path(tmp) / "run", Path(tmp) / "bin"
        for d in (scratch, cwd, bin_dir):
            d.mkdir()
        _shims(bin_dir)
        (cwd / "examples").symlink_to(REPO / "examples")
        yield cwd, _environment(bin_dir), scratch


def _page_unit(page: Path, blocks: list[Block]) -> list[Result]:
    """Blocks that need one page's python blocks run first: python output and cwd=snippets commands."""
    with _workspace() as (cwd, env, scratch):
        until = max(b.line for b in blocks)  # later blocks cannot change what these show
        printed = dict(zip((b.line for b in python_blocks(page)), run_snippets(page, cwd, env, scratch, until)))
        results = []
        for block in blocks:
            if "python" in block.options:
                above = [line for line in printed if line < block.line]
                if not above:
                    raise TranscriptError(f"{block.where}: no python block above it")
                results.append(Result(block, merge(block.body, shown(printed[max(above)], block.options))))
            else:
                results.append(_run_block(block, cwd, env))
        return results


def _fresh_unit(block: Block) -> list[Result]:
    with _workspace() as (cwd, env, _):
        return [_run_block(block, cwd, env)]


def _run_block(block: Block, cwd: Path, env: dict[str, str]) -> Result:
    body = []
    for command, old in commands(block):
        body += [f"$ {line}" if i == 0 else line for i, line in enumerate(command.split("\n"))]
        out = run_command(command, cwd, env, "stderr" in block.options)
        body += merge(old, shown(out, block.options))
    return Result(block, body)


def transcript_blocks(pages: list[Path] | None = None) -> list[Block]:
    return [b for page in pages or doc_pages() for b in parse_blocks(page) if b.kind == "transcript"]


def run_all(pages: list[Path] | None = None, jobs: int = 2) -> list[Result]:
    """Run every transcript of ``pages`` (default: README.md and docs/*.md), ``jobs`` at a time."""
    blocks = transcript_blocks(pages)
    by_page: dict[Path, list[Block]] = {}
    units = []
    for block in blocks:
        if "python" in block.options or "cwd" in block.options:
            by_page.setdefault(block.page, []).append(block)
        else:
            units.append((_fresh_unit, (block,)))
    units = [(_page_unit, (page, page_blocks)) for page, page_blocks in by_page.items()] + units
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        done = list(pool.map(lambda unit: unit[0](*unit[1]), units))
    return sorted((r for rs in done for r in rs), key=lambda r: (str(r.block.page), r.block.line))


def write(results: list[Result]) -> list[Block]:
    """Rewrite every drifted block in place; return them."""
    drifted = [r for r in results if r.drifted]
    for page in {r.block.page for r in drifted}:
        lines = page.read_text(encoding="utf-8").splitlines()
        for r in sorted((r for r in drifted if r.block.page == page), key=lambda r: -r.block.line):
            start = r.block.line  # index of the first body line
            lines[start : start + len(r.block.body)] = r.expected
        page.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return [r.block for r in drifted]


def unmarked(pages: list[Path] | None = None) -> list[Block]:
    """Blocks that could show output but carry no marker."""
    return [b for page in pages or doc_pages() for b in parse_blocks(page) if b.kind is None and needs_marker(b)]


def not_run(pages: list[Path] | None = None) -> list[Block]:
    return [b for page in pages or doc_pages() for b in parse_blocks(page) if b.kind == "not-run"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hicache_fsm.docs_transcripts",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("pages", nargs="*", type=Path, help="pages to check (default: README.md and docs/*.md)")
    parser.add_argument("--write", action="store_true", help="rewrite drifted blocks from the runs")
    parser.add_argument("--jobs", type=int, default=2, help="transcripts run at once (default 2)")
    args = parser.parse_args(argv)
    pages = [p.resolve() for p in args.pages] or None
    try:
        results = run_all(pages, args.jobs)
    except (TranscriptError, subprocess.TimeoutExpired) as err:
        print(f"docs_transcripts: {err}", file=sys.stderr)
        return 1
    for block in unmarked(pages):
        print(f"{block.where}: a ```{block.info} block without a transcript/not-run/not-output marker",
              file=sys.stderr)
    for block in not_run(pages):
        print(f"{block.where}: not run: {block.note}")
    if args.write:
        for block in write(results):
            print(f"rewrote {block.where}")
        return 0
    drifted = [r for r in results if r.drifted]
    for r in drifted:
        print(r.diff())
    print(f"{len(results)} transcripts, {len(drifted)} drifted" + (f"; regenerate with: {REGENERATE}" if drifted else ""))
    return 1 if drifted or unmarked(pages) else 0


if __name__ == "__main__":
    sys.exit(main())
