"""Code in docs/ runs: every ```python block of docs/*.md is executed.

The blocks of one page run in order in one namespace (a later block may use
what an earlier one defined), in a temporary working directory. A block that
must not run (pseudo-code, a fragment of an engine) is marked by an HTML
comment ``<!-- no-test -->`` on the line (or lines) just before its fence; use
it sparingly.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
NO_TEST = "<!-- no-test -->"


def python_blocks(text: str) -> list[tuple[int, str, bool]]:
    """(line, code, runnable) of every ```python block of a Markdown text."""
    out = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip().splitlines()
        marked = bool(before) and before[-1].strip() == NO_TEST
        line = text.count("\n", 0, m.start()) + 2  # first line of the code
        out.append((line, m.group(1), not marked))
    return out


def pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def test_extractor():
    text = "a\n```python\nx = 1\n```\n<!-- no-test -->\n```python\nboom()\n```\n```bash\nls\n```\n"
    blocks = python_blocks(text)
    assert [(b[1], b[2]) for b in blocks] == [("x = 1\n", True), ("boom()\n", False)]
    assert blocks[0][0] == 3


def test_there_are_snippets_to_run():
    assert sum(1 for p in pages() for _, _, ok in python_blocks(p.read_text(encoding="utf-8")) if ok) >= 3


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_page_snippets_run(page, tmp_path, monkeypatch):
    blocks = [b for b in python_blocks(page.read_text(encoding="utf-8")) if b[2]]
    if not blocks:
        pytest.skip("no python blocks")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    for line, code, _ in blocks:
        # pad with newlines so tracebacks point at the page's own line numbers
        compiled = compile("\n" * (line - 1) + code, str(page), "exec")
        exec(compiled, namespace)
