"""docs/ must not drift from specs/: machine pages are generated, the format doc names every key."""

from __future__ import annotations

from pathlib import Path

from hicache_fsm.docs_gen import DOCS_DIR, REGENERATE, render_machine_page, stale_pages
from hicache_fsm.spec import (
    KNOWN_TAGS,
    RESERVED_PREFIXES,
    RESERVED_TRIGGERS,
    SPEC_DIR,
    STATE_KEYS,
    TOP_KEYS,
    TRANSITION_KEYS,
    load_all,
)

REPO = Path(__file__).resolve().parent.parent
FORMAT_DOC = REPO / "docs" / "spec-format.md"


def test_machine_pages_match_the_specs():
    stale = stale_pages()
    assert not stale, (
        "docs/machines/ is out of date with specs/:\n  "
        + "\n  ".join(stale)
        + f"\nRegenerate with: {REGENERATE}   (then commit docs/machines/)"
    )


def test_machine_page_has_every_state_transition_and_invariant():
    for spec in load_all():
        page = render_machine_page(spec)
        assert page.count("```mermaid") == 1 and "stateDiagram-v2" in page
        for st in spec.states:
            assert f"| `{st.name}`" in page
        for t in spec.transitions:
            assert f"| `{t.trigger}` |" in page
            if t.doc:
                assert " ".join(t.doc.split()).replace("|", "\\|") in page
        for inv in spec.invariants:
            assert f"- `{inv}`" in page
        assert Path(spec.path).name in page


def test_pages_name_no_absolute_paths():
    for page in DOCS_DIR.glob("*.md"):
        text = page.read_text(encoding="utf-8")
        assert str(REPO) not in text and str(SPEC_DIR) not in text


def test_spec_format_doc_defines_every_key_tag_and_reserved_name():
    text = FORMAT_DOC.read_text(encoding="utf-8")
    for key in {*TOP_KEYS, *STATE_KEYS, *TRANSITION_KEYS}:
        assert f"`{key}`" in text, f"docs/spec-format.md does not define key {key!r}"
    for tag in KNOWN_TAGS:
        assert f"`{tag}`" in text, f"docs/spec-format.md does not define tag {tag!r}"
    for name in (*RESERVED_TRIGGERS, *RESERVED_PREFIXES):
        assert f"`{name}`" in text, f"docs/spec-format.md does not list reserved trigger name {name!r}"
