"""Generate docs/machines/<name>.md and <name>.svg from specs/<name>.yaml.

The machine pages are derived data: a test fails when they differ from what
this module produces, so edit the spec, then regenerate::

    python -m hicache_fsm.docs_gen           # rewrite docs/machines/*.md and *.svg
    python -m hicache_fsm.docs_gen --check   # exit 1 and name the stale files

Each page embeds its machine as an SVG drawn by Graphviz (the docs site shows
it offline) and keeps the mermaid text, which GitHub renders. Graphviz versions
lay out the same dot text slightly differently, so an SVG is not compared byte
for byte: it records the SHA-256 of the dot text it was drawn from, and it is
stale when that differs from the spec's dot text now (checking needs no Graphviz;
regenerating does).
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from pathlib import Path

from hicache_fsm.diagrams import svg_from_dot, to_dot, to_mermaid
from hicache_fsm.errors import DiagramError
from hicache_fsm.spec import SPEC_DIR, Spec, load_spec, spec_paths

# A checkout's docs/ (this tool works on the repository, not on an installed package).
DOCS_DIR = Path(__file__).resolve().parent.parent / "docs" / "machines"
REGENERATE = "python -m hicache_fsm.docs_gen"


def _cell(text: str) -> str:
    """Text fit for one markdown table cell."""
    text = " ".join(str(text).split())
    return text.replace("\\", "\\\\").replace("|", "\\|") or " "


def _names(items: tuple[str, ...] | list[str], fmt: str = "`{}`") -> str:
    return ", ".join(fmt.format(x) for x in items)


def render_machine_page(spec: Spec) -> str:
    """The markdown page of one machine: doc, diagram, states, transitions, invariants."""
    source = _source(spec)
    out = [
        f"<!-- Generated from {source} by `{REGENERATE}`; do not edit by hand. -->",
        "",
        f"# Machine `{spec.name}`",
        "",
    ]
    if spec.doc:
        out += [" ".join(spec.doc.split()), ""]
    out += [
        f"Spec: `{source}` (in the package; its text is [at the end of this page](#spec-source)). "
        f"Initial state: `{spec.initial}`. {len(spec.states)} states, {_transition_count(spec)} transitions "
        f"(one per source state of the {len(spec.transitions)} entries below, as `list` and `check` count them).",
        "",
        f"![State diagram of {spec.name}]({spec.name}.svg)",
        "",
        "The same machine as mermaid text (GitHub draws it; the picture above is its Graphviz rendering):",
        "",
        "```mermaid",
        to_mermaid(spec).rstrip("\n"),
        "```",
        "",
        "## States",
        "",
        "| State | Tags | Description |",
        "| --- | --- | --- |",
    ]
    for st in spec.states:
        name = f"`{st.name}`" + (" (initial)" if st.name == spec.initial else "")
        out.append(f"| {name} | {_cell(_names(sorted(st.tags)))} | {_cell(st.doc)} |")
    out += [
        "",
        "## Transitions",
        "",
        "Guards listed as `not g` are the transition's `unless` guards. Effects run in order, after every guard "
        "passed and before the state changes; the jobs under Emits are returned with the transition for the caller to build. "
        "Events are the KV events a router hears (see the cluster page): `stored:TIER` when the pages become readable "
        "in a tier, `removed:TIER` when they stop being readable there.",
        "",
        "| Trigger | From | To | Guards | Effects | Emits | Events | Description |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for t in spec.transitions:
        guards = [*t.guards, *(f"not {u}" for u in t.unless)]
        out.append(
            "| "
            + " | ".join(
                [
                    f"`{t.trigger}`",
                    _cell(_names(t.sources)),
                    f"`{t.dest}`",
                    _cell(_names(guards)),
                    _cell(_names(t.effects)),
                    _cell(_names(t.emits)),
                    _cell(_names(t.events)),
                    _cell(t.doc),
                ]
            )
            + " |"
        )
    out += ["", "## Invariants", ""]
    if spec.invariants:
        out += [f"- `{inv}`" for inv in spec.invariants]
    else:
        out.append("None declared.")
    out += ["", "## Spec source", "", f"`{source}`:", "", "```yaml", _spec_text(spec).rstrip("\n"), "```"]
    return "\n".join(out) + "\n"


def _transition_count(spec: Spec) -> int:
    return len({(t.trigger, source, t.dest) for t in spec.transitions for source in t.sources})


def _spec_text(spec: Spec) -> str:
    """The spec file's text (the site cannot link to a file outside docs/, so the page carries it)."""
    path = Path(spec.path) if spec.path else SPEC_DIR / f"{spec.name}.yaml"
    return path.read_text(encoding="utf-8")


def _source(spec: Spec) -> str:
    return f"hicache_fsm/specs/{Path(spec.path).name}" if spec.path else f"hicache_fsm/specs/{spec.name}.yaml"


def dot_digest(spec: Spec) -> str:
    """SHA-256 of the spec's dot text: what an up-to-date SVG records."""
    return hashlib.sha256(to_dot(spec).encode("utf-8")).hexdigest()


_DIGEST = re.compile(r"<!-- Generated from \S+ by `[^`]*`; dot source sha256: ([0-9a-f]{64}) -->")


def render_machine_svg(spec: Spec) -> str:
    """The machine's SVG (needs Graphviz), stamped with the digest of its dot text."""
    svg = svg_from_dot(to_dot(spec), spec.name)
    stamp = f"<!-- Generated from {_source(spec)} by `{REGENERATE}`; dot source sha256: {dot_digest(spec)} -->"
    head, sep, rest = svg.partition("?>\n")
    return f"{head}{sep}{stamp}\n{rest}" if sep else f"{stamp}\n{svg}"


def svg_digest(text: str) -> str | None:
    """The dot-source digest an SVG written by ``render_machine_svg`` records, or None."""
    m = _DIGEST.search(text[:2000])
    return m.group(1) if m else None


def expected_pages(spec_dir: Path = SPEC_DIR) -> dict[str, str]:
    """File name (``residency.md``) -> page text, for every spec in ``spec_dir``."""
    return {f"{spec.name}.md": render_machine_page(spec) for spec in _specs(spec_dir)}


def _specs(spec_dir: Path) -> list[Spec]:
    return [load_spec(path) for path in spec_paths(spec_dir)]


def stale_pages(docs_dir: Path = DOCS_DIR, spec_dir: Path = SPEC_DIR) -> list[str]:
    """Pages and SVGs that are missing, differ from the generator's output, or have no spec."""
    specs = _specs(spec_dir)
    expected = {f"{spec.name}.md": render_machine_page(spec) for spec in specs}
    problems = []
    for name, text in expected.items():
        page = docs_dir / name
        if not page.is_file():
            problems.append(f"{name}: missing")
        elif page.read_text(encoding="utf-8") != text:
            problems.append(f"{name}: differs from its spec")
    for spec in specs:
        svg = docs_dir / f"{spec.name}.svg"
        if not svg.is_file():
            problems.append(f"{svg.name}: missing")
        elif svg_digest(svg.read_text(encoding="utf-8")) != dot_digest(spec):
            problems.append(f"{svg.name}: drawn from other dot text than its spec gives now")
    if docs_dir.is_dir():
        names = {spec.name for spec in specs}
        for path in sorted([*docs_dir.glob("*.md"), *docs_dir.glob("*.svg")]):
            if path.stem not in names:
                problems.append(f"{path.name}: no spec produces it")
    return problems


def write_pages(docs_dir: Path = DOCS_DIR, spec_dir: Path = SPEC_DIR) -> list[Path]:
    """Rewrite stale pages and SVGs, delete those no spec produces; return the files written.

    An SVG whose recorded digest is current is left alone, so another Graphviz
    version does not rewrite every drawing.
    """
    specs = _specs(spec_dir)
    docs_dir.mkdir(parents=True, exist_ok=True)
    names = {spec.name for spec in specs}
    for path in [*docs_dir.glob("*.md"), *docs_dir.glob("*.svg")]:
        if path.stem not in names:
            path.unlink()
    written = []
    for spec in specs:
        page = docs_dir / f"{spec.name}.md"
        text = render_machine_page(spec)
        if not page.is_file() or page.read_text(encoding="utf-8") != text:
            page.write_text(text, encoding="utf-8")
            written.append(page)
        svg = docs_dir / f"{spec.name}.svg"
        if not svg.is_file() or svg_digest(svg.read_text(encoding="utf-8")) != dot_digest(spec):
            svg.write_text(render_machine_svg(spec), encoding="utf-8")
            written.append(svg)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hicache_fsm.docs_gen", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale files (exit 1 if any)")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_pages()
        for line in stale:
            print(f"docs/machines/{line}", file=sys.stderr)
        if stale:
            print(f"regenerate with: {REGENERATE}", file=sys.stderr)
        return 1 if stale else 0
    try:
        written = write_pages()
    except DiagramError as err:
        print(f"{REGENERATE}: {err}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote docs/machines/{path.name}")
    if not written:
        print("docs/machines/ is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
