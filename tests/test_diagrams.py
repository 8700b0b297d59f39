"""Diagrams: mermaid text every line of which a stateDiagram-v2 checker recognises; dot; svg.

The checker below follows the mermaid state-diagram lexer: a description after
`` : `` ends at ``:``, ``;`` or a newline; ``%%`` starts a comment;
``direction XX`` anywhere on a line is a statement; a state id may not be a
keyword nor start with ``default``.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from hicache_fsm import diagrams
from hicache_fsm.diagrams import edge_label, to_dot, to_mermaid, to_svg
from hicache_fsm.errors import DiagramError, HiCacheError
from hicache_fsm.registry import MachineRegistry
from hicache_fsm.spec import Spec, load_all, parse_spec

SPECS = load_all()

ID = r"(?P<{}>[A-Za-z_][A-Za-z0-9_]*)"
TEXT = r"(?P<{}>[^:;\n%\"]+)"
MERMAID_LINE = {
    "start": re.compile(rf"^\[\*\] --> {ID.format('dst')}$"),
    "end": re.compile(rf"^{ID.format('src')} --> \[\*\]$"),
    "edge": re.compile(rf"^{ID.format('src')} --> {ID.format('dst')}(?: : {TEXT.format('label')})?$"),
    "description": re.compile(rf"^{ID.format('id')} : {TEXT.format('text')}$"),
    "alias": re.compile(rf'^state "(?P<label>[^"\n]+)" as {ID.format("id")}$'),
    "note": re.compile(rf"^note (?:left|right) of {ID.format('id')} : {TEXT.format('text')}$"),
    "classdef": re.compile(r"^classDef (?P<cls>\w+) (?P<style>[^\n]+)$"),
    "class": re.compile(r"^class (?P<ids>\w+(?:,\w+)*) (?P<cls>\w+)$"),
    "comment": re.compile(r"^%%.*$"),
    "direction": re.compile(r"^direction (?:TB|BT|LR|RL)$"),
}
KEYWORDS = {"state", "note", "class", "classdef", "scale", "direction", "hide", "acctitle", "accdescr", "end", "as",
            "statediagram", "style", "click"}


def check_mermaid(text: str) -> list[tuple[str, dict[str, str]]]:
    """Parse stateDiagram-v2 text; fail on any line the grammar would not read as intended."""
    lines = text.splitlines()
    assert lines[0] == "stateDiagram-v2", "the first line declares the diagram type"
    parsed = []
    for number, raw in enumerate(lines[1:], start=2):
        line = raw.strip()
        if not line:
            continue
        assert not re.search(r"(?i)direction\s+(tb|bt|lr|rl)", line) or MERMAID_LINE["direction"].match(line), (
            f"line {number} would be read as a direction statement: {raw!r}"
        )
        for kind, pattern in MERMAID_LINE.items():
            m = pattern.match(line)
            if m:
                break
        else:
            pytest.fail(f"line {number} is not stateDiagram-v2 syntax: {raw!r}")
        fields = {k: v for k, v in m.groupdict().items() if v is not None}
        for key in ("src", "dst", "id"):
            if key in fields:
                ident = fields[key]
                assert ident.lower() not in KEYWORDS and not ident.lower().startswith("default"), (
                    f"line {number}: state id {ident!r} collides with a mermaid keyword"
                )
        if kind != "comment" and kind != "classdef":
            assert "%%" not in line
        parsed.append((kind, fields))
    return parsed


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_mermaid_of_every_spec_parses_and_matches_the_spec(spec):
    parsed = check_mermaid(to_mermaid(spec))
    starts = [f["dst"] for k, f in parsed if k == "start"]
    assert starts == [spec.initial]
    ends = {f["src"] for k, f in parsed if k == "end"}
    assert ends == {s.name for s in spec.states if s.terminal}
    edges = sorted((f["src"], f["dst"], f.get("label", "")) for k, f in parsed if k == "edge")
    expected = sorted((s, t.dest, edge_label(t)) for t in spec.transitions for s in t.sources)
    assert edges == expected
    described = {f["id"] for k, f in parsed if k == "description"}
    assert described == {s.name for s in spec.states if s.doc}


def test_edge_label_format():
    spec = SPECS[0]
    for t in spec.transitions:
        label = edge_label(t)
        assert label.startswith(t.trigger)
        if t.guards or t.unless:
            assert "[" in label and all(g in label for g in t.guards)
            assert all(f"not {u}" in label for u in t.unless)
        if t.emits:
            assert label.endswith(" / " + ", ".join(t.emits))


HOSTILE = '''
name: hostile
doc: "Docs with: colons; semicolons %% comments # hashes \\"quotes\\" {braces} <tags> and direction LR."
initial: state
states:
  state:
    doc: "Named like a keyword: it must be aliased; direction TB here."
  note:
    doc: "50% done; see #3 {x} <y>"
  default_x:
    doc: A name the lexer would read as the keyword default.
  s_note:
    doc: Clashes with the alias of note.
  end:
    tags: [terminal, in_flight]
transitions:
  - trigger: go
    source: state
    dest: note
    doc: 'He said "go": now; then \\\\ back.'
  - trigger: go
    source: note
    dest: default_x
  - trigger: go
    source: default_x
    dest: s_note
  - trigger: stop
    source: [s_note, state]
    dest: end
'''


def hostile_spec() -> Spec:
    return parse_spec(HOSTILE, "<hostile>", MachineRegistry("hostile"))


def test_mermaid_escapes_hostile_names_and_docs():
    spec = hostile_spec()
    text = to_mermaid(spec)
    parsed = check_mermaid(text)
    aliases = {f["label"]: f["id"] for k, f in parsed if k == "alias"}
    assert set(aliases) == {"state", "note", "default_x", "end"}
    assert len(set(aliases.values()) | {"s_note"}) == 5, "aliases never collide with real state names"
    assert [f["dst"] for k, f in parsed if k == "start"] == [aliases["state"]]


def test_dot_quotes_hostile_text_and_renders():
    text = to_dot(hostile_spec())
    assert text.startswith('digraph "hostile" {') and text.rstrip().endswith("}")
    assert '\\"go\\"' in text and "\\\\" in text
    if shutil.which("dot") is None:
        pytest.skip("Graphviz `dot` is not installed")
    proc = subprocess.run(["dot", "-Tsvg"], input=text, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` is not installed")
@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_svg_of_every_spec(spec):
    svg = to_svg(spec)
    assert svg.lstrip().startswith("<?xml") and "</svg>" in svg
    for st in spec.states:
        assert f">{st.name}</text>" in svg


def test_svg_without_dot_raises_a_typed_error(monkeypatch):
    monkeypatch.setattr(diagrams.shutil, "which", lambda name: None)
    with pytest.raises(DiagramError) as info:
        to_svg(SPECS[0])
    assert isinstance(info.value, HiCacheError)
    assert "Graphviz" in str(info.value) and "apt-get install graphviz" in str(info.value)


def test_svg_timeout_and_failure_are_typed(monkeypatch):
    monkeypatch.setattr(diagrams.shutil, "which", lambda name: "/bin/dot")

    def timeout(*args, **kwargs):
        raise subprocess.TimeoutExpired(args[0], kwargs.get("timeout"))

    monkeypatch.setattr(diagrams.subprocess, "run", timeout)
    with pytest.raises(DiagramError, match="longer than"):
        to_svg(SPECS[0], timeout=0.5)

    def failing(*args, **kwargs):
        return subprocess.CompletedProcess(args[0], 1, "", "Error: syntax error in line 3")

    monkeypatch.setattr(diagrams.subprocess, "run", failing)
    with pytest.raises(DiagramError, match="syntax error in line 3"):
        to_svg(SPECS[0])


def test_render_rejects_unknown_format():
    with pytest.raises(DiagramError, match="unknown diagram format"):
        diagrams.render(SPECS[0], "png")


@pytest.mark.parametrize("spec", ["residency", None])
def test_render_draws_a_spec_object_only(spec):
    with pytest.raises(DiagramError, match="render draws a Spec"):  # an AttributeError before
        diagrams.render(spec, "mermaid")


def test_output_is_deterministic():
    for spec in SPECS:
        assert to_mermaid(spec) == to_mermaid(spec) and to_dot(spec) == to_dot(spec)
