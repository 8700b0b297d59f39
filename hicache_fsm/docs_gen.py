"""Generate docs/machines/<name>.md from specs/<name>.yaml.

The machine pages are derived data: a test fails when they differ from what
this module produces, so edit the spec, then regenerate::

    python -m hicache_fsm.docs_gen           # rewrite docs/machines/*.md
    python -m hicache_fsm.docs_gen --check   # exit 1 and name the stale pages
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hicache_fsm.diagrams import to_mermaid
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
    source = f"specs/{Path(spec.path).name}" if spec.path else f"specs/{spec.name}.yaml"
    out = [
        f"<!-- Generated from {source} by `{REGENERATE}`; do not edit by hand. -->",
        "",
        f"# Machine `{spec.name}`",
        "",
    ]
    if spec.doc:
        out += [" ".join(spec.doc.split()), ""]
    out += [
        f"Spec: [`{source}`](../../{source}). Initial state: `{spec.initial}`. "
        f"{len(spec.states)} states, {len(spec.transitions)} transitions.",
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
        "passed and before the state changes; the jobs under Emits are returned with the transition for the caller to build.",
        "",
        "| Trigger | From | To | Guards | Effects | Emits | Description |",
        "| --- | --- | --- | --- | --- | --- | --- |",
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
    return "\n".join(out) + "\n"


def expected_pages(spec_dir: Path = SPEC_DIR) -> dict[str, str]:
    """File name (``residency.md``) -> page text, for every spec in ``spec_dir``."""
    pages = {}
    for path in spec_paths(spec_dir):
        spec = load_spec(path)
        pages[f"{spec.name}.md"] = render_machine_page(spec)
    return pages


def stale_pages(docs_dir: Path = DOCS_DIR, spec_dir: Path = SPEC_DIR) -> list[str]:
    """Pages that are missing, differ from the generator's output, or have no spec."""
    expected = expected_pages(spec_dir)
    problems = []
    for name, text in expected.items():
        page = docs_dir / name
        if not page.is_file():
            problems.append(f"{name}: missing")
        elif page.read_text(encoding="utf-8") != text:
            problems.append(f"{name}: differs from its spec")
    if docs_dir.is_dir():
        for page in sorted(docs_dir.glob("*.md")):
            if page.name not in expected:
                problems.append(f"{page.name}: no spec produces it")
    return problems


def write_pages(docs_dir: Path = DOCS_DIR, spec_dir: Path = SPEC_DIR) -> list[Path]:
    """Rewrite every machine page and delete pages no spec produces; return the pages written."""
    expected = expected_pages(spec_dir)
    docs_dir.mkdir(parents=True, exist_ok=True)
    for page in docs_dir.glob("*.md"):
        if page.name not in expected:
            page.unlink()
    written = []
    for name, text in expected.items():
        page = docs_dir / name
        if not page.is_file() or page.read_text(encoding="utf-8") != text:
            page.write_text(text, encoding="utf-8")
        written.append(page)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hicache_fsm.docs_gen", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale pages (exit 1 if any)")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_pages()
        for line in stale:
            print(f"docs/machines/{line}", file=sys.stderr)
        if stale:
            print(f"regenerate with: {REGENERATE}", file=sys.stderr)
        return 1 if stale else 0
    for page in write_pages():
        print(f"wrote docs/machines/{page.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
