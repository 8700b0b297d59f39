"""docs/cli.md documents every subcommand and option; links between docs pages resolve."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from hicache_fsm.cli import build_parser

DOCS = Path(__file__).resolve().parent.parent / "docs"
CLI_DOC = DOCS / "cli.md"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _long_options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}


def _section(text: str, heading: str) -> str | None:
    """The text under a Markdown heading, up to the next heading of the same or a higher level."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = text.splitlines()
    try:
        start = lines.index(heading)
    except ValueError:
        return None
    out = []
    for line in lines[start + 1 :]:
        m = re.match(r"^(#+) ", line)
        if m and len(m.group(1)) <= level:
            break
        out.append(line)
    return "\n".join(out)


def test_every_subcommand_and_option_is_documented():
    text = CLI_DOC.read_text(encoding="utf-8")
    problems = []
    for name, sub in _subparsers(build_parser()).items():
        if name == "bench":
            continue
        section = _section(text, f"## hicache-fsm {name}")
        if section is None:
            problems.append(f"no '## hicache-fsm {name}' section")
            continue
        problems += [f"{name}: option {o} not documented" for o in sorted(_long_options(sub)) if o not in section]
    assert not problems, "docs/cli.md is out of date:\n  " + "\n  ".join(problems)


def test_every_benchmark_and_option_is_documented():
    text = CLI_DOC.read_text(encoding="utf-8")
    bench = _subparsers(build_parser())["bench"]
    problems = []
    for name, sub in _subparsers(bench).items():
        section = _section(text, f"### bench {name}")
        if section is None:
            problems.append(f"no '### bench {name}' section")
            continue
        problems += [f"bench {name}: option {o} not documented" for o in sorted(_long_options(sub) - {"--json"})
                     if o not in section]
    assert not problems, "docs/cli.md is out of date:\n  " + "\n  ".join(problems)


LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


@pytest.mark.parametrize("page", [DOCS.parent / "README.md", *sorted(DOCS.glob("*.md"))], ids=lambda p: p.name)
def test_relative_links_resolve(page):
    text = page.read_text(encoding="utf-8")
    missing = []
    for target, _ in LINK.findall(text):
        if "://" in target or target.startswith("mailto:"):
            continue
        if not (page.parent / target).exists():
            missing.append(target)
    assert not missing, f"{page.name} links to missing files: {missing}"


def test_mkdocs_nav_lists_every_page():
    import yaml

    config = yaml.safe_load((DOCS.parent / "mkdocs.yml").read_text(encoding="utf-8"))

    def entries(nav):
        for item in nav:
            for value in item.values():
                if isinstance(value, list):
                    yield from entries(value)
                else:
                    yield value

    listed = set(entries(config["nav"]))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert not pages - listed, f"pages missing from mkdocs.yml nav: {sorted(pages - listed)}"
    assert not listed - pages, f"mkdocs.yml nav names missing pages: {sorted(listed - pages)}"
