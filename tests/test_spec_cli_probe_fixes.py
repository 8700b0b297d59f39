"""Defects an outside probe found in the spec loader, the diagrams and the command line, each pinned.

Bounds ``check`` cannot explore are usage errors before anything runs; any valid spec draws as valid
dot with its text escaped; spec lines are the file's own; every list of a spec holds each entry once;
an unknown option is named by the subcommand's parser; ``replay --spec`` with an invalid spec is a
failed check (exit 1), and ``parse_spec`` refuses arguments of the wrong type with a ``SpecError``.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from hicache_fsm.cli import main
from hicache_fsm.diagrams import to_dot, to_mermaid, to_svg
from hicache_fsm.errors import ConfigError, SpecError
from hicache_fsm.spec import MAX_SPEC_BYTES, parse_spec

SPEC = """\
name: mini
doc: A tiny machine.
initial: a
states:
  a:
    doc: {doc}
  b:
    doc: End state.
    tags: [{tags}]
transitions:
  - trigger: go
    source: a
    dest: b
    guards: [{guards}]
    effects: [{effects}]
    emits: [{emits}]
"""


def spec_text(doc: str = "Start.", tags: str = "terminal", guards: str = "g_one", effects: str = "e_one",
              emits: str = "d2h") -> str:
    return SPEC.format(doc=doc, tags=tags, guards=guards, effects=effects, emits=emits)


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of ``hicache-fsm ARGV`` (argparse's usage errors exit by SystemExit)."""
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


# --------------------------------------------------------------------------- check's bounds


def test_check_refuses_more_layers_than_the_test_kv_encodes(capsys):
    code, out, err = cli(capsys, "check", "--layers", "65", "--max-depth", "1", "--quiet")
    assert code == 2 and not out
    assert err.count("\n") == 1 and "hicache-fsm check: error:" in err and "--layers" in err and "64" in err


def test_bounds_refuse_more_layers_than_the_test_kv_encodes():
    from hicache_fsm.testing.explorer import Bounds
    from hicache_fsm.testing.kv import MAX_LAYERS

    assert Bounds(layers=MAX_LAYERS).layers == MAX_LAYERS
    with pytest.raises(ConfigError, match="Bounds.layers"):
        Bounds(layers=MAX_LAYERS + 1)


def test_check_refuses_more_namespaces_than_the_alphabet_has_first_tokens(capsys):
    code, out, err = cli(capsys, "check", "--namespaces", "3", "--max-depth", "1", "--quiet")
    assert code == 2 and not out
    assert err.count("\n") == 1 and "--namespaces 3" in err and "--alphabet 2" in err


def test_check_refuses_a_page_size_past_its_bound(capsys):
    """A page of 70,000 tokens ran for minutes and checked nothing: the bound is a usage error, at once."""
    code, out, err = cli(capsys, "check", "--page-size", "65", "--max-depth", "1", "--quiet")
    assert code == 2 and not out
    assert err.count("\n") == 1 and "--page-size" in err and "64" in err


def test_check_runs_at_the_largest_page_size(capsys):
    code, out, err = cli(capsys, "check", "--page-size", "64", "--max-depth", "1", "--quiet")
    assert code == 0, err


# --------------------------------------------------------------------------- diagrams


def test_a_doc_of_any_length_draws_as_dot_graphviz_reads():
    spec = parse_spec(spec_text(doc="x" * (MAX_SPEC_BYTES - 1024)), require_bindings=False)
    dot = to_dot(spec)
    longest = max(len(s.encode()) for s in re.findall(r'"(?:[^"\\]|\\.)*"', dot))
    assert longest <= 16384, "Graphviz refuses a quoted string past 16384 bytes"
    if shutil.which("dot"):
        assert "<svg" in to_svg(spec)


def test_diagrams_escape_control_characters_and_bidi_overrides_from_spec_text():
    spec = parse_spec(spec_text(doc=r'"St\u202eart \x1b[31m red"'), require_bindings=False)
    for text in (to_mermaid(spec), to_dot(spec)):
        assert "\x1b" not in text and "\u202e" not in text
        assert "\\x1b" in text and "\\u202e" in text


# --------------------------------------------------------------------------- spec lines and lists


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\x85"])  # the characters themselves, not escapes
def test_a_line_separator_inside_a_quoted_scalar_does_not_shift_later_lines(separator):
    text = spec_text(doc=f'"line{separator}sep"').replace("    tags: [terminal]", "    tagz: [terminal]")
    with pytest.raises(SpecError) as info:
        parse_spec(text, "s.yaml", require_bindings=False)
    assert (info.value.line, "unknown key 'tagz'" in info.value.message) == (9, True)


@pytest.mark.parametrize("field, noun, line", [
    ("tags", "state 'b' lists a tag twice: 'terminal'", 9),
    ("guards", "transition 'go' lists a guard twice: 'g_one'", 11),
    ("effects", "transition 'go' lists an effect twice: 'e_one'", 11),
    ("emits", "transition 'go' lists a job kind twice: 'd2h'", 11),
])
def test_an_entry_listed_twice_is_refused_in_every_list(field, noun, line):
    entry = {"tags": "terminal", "guards": "g_one", "effects": "e_one", "emits": "d2h"}[field]
    with pytest.raises(SpecError) as info:
        parse_spec(spec_text(**{field: f"{entry}, {entry}"}), "s.yaml", require_bindings=False)
    assert [(p.line, p.message) for p in info.value.problems] == [(line, noun)]


# --------------------------------------------------------------------------- command line


@pytest.mark.parametrize("argv, prog, extras", [
    (["fuzz", "--max-seconds", "5"], "hicache-fsm fuzz", "--max-seconds 5"),
    (["diagram", "residency", "extra.yaml"], "hicache-fsm diagram", "extra.yaml"),
])
def test_an_unknown_argument_is_named_by_the_subcommand(capsys, argv, prog, extras):
    code, _, err = cli(capsys, *argv)
    assert code == 2
    assert err == f"{prog}: error: unrecognized arguments: {extras} (see {prog} --help)\n"


def test_replay_with_an_invalid_spec_is_a_failed_check_with_its_lines(capsys, tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"seq":0,"event":"header","version":1,"machines":["mini"]}\n')
    bad = tmp_path / "bad.yaml"
    bad.write_text(spec_text(emits="d2h, d2h"))
    code, _, err = cli(capsys, "replay", str(trace), "--spec", str(bad))
    assert code == 1
    assert err.splitlines() == [f"{bad}:11: transition 'go' lists a job kind twice: 'd2h'"]


# --------------------------------------------------------------------------- Python API


@pytest.mark.parametrize("kwargs, message", [
    ({"registry": "mini"}, "registry must be a MachineRegistry or None, got str"),
    ({"path": None}, "a spec path must be a str or os.PathLike, got NoneType"),
    ({"path": b"x.yaml"}, "a spec path must be a str or os.PathLike, got bytes"),
])
def test_parse_spec_refuses_arguments_of_the_wrong_type(kwargs, message):
    with pytest.raises(SpecError, match=re.escape(message)):
        parse_spec(spec_text(), **kwargs)


def test_parse_spec_names_a_pathlike_as_load_spec_does():
    assert parse_spec(spec_text(), Path("dir/x.yaml"), require_bindings=False).path == "dir/x.yaml"


def test_fuzz_names_the_failing_step_by_its_place_among_the_rules():
    """Steps that keep a result (``prompts_1 = state.insert(...)``) and the setup count: a failure at the seventh
    rule was reported "at step 3" (only bare ``state.`` lines were counted)."""
    from types import SimpleNamespace

    from hicache_fsm.commands.fuzz import failure_line

    steps = ["state = AdapterMachine()", "prompts_0 = state.setup(variant=0, pages=[0])", "state.check()",
             "state.evict(pages=1)", "state.check()", "prompts_1 = state.insert(pages=[1])", "state.check()",
             "state.evict_host(pages=1)", "state.check()", "prompts_2 = state.insert(pages=[0])", "state.check()",
             "prompts_3 = state.insert(pages=[1])", "state.check()",
             "state.reuse_then_evict(again=False, pages=1, tokens=prompts_3)", "state.teardown()"]
    result = SimpleNamespace(failure="AssertionError: lru_order: boom", steps=steps)
    assert failure_line(result) == "AssertionError: lru_order: boom (at step 7 of the failing steps)"
