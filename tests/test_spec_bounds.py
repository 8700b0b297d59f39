"""Hostile spec text is refused by bounds checked before a tree is built: a SpecError naming
the file (and the line where one exists), quickly, for every input up to the size limit."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hang_guard import raised_by

from hicache_fsm.errors import SpecError
from hicache_fsm.spec import MAX_DEPTH, MAX_EVENTS, MAX_SPEC_BYTES, SPEC_DIR, load_spec, parse_spec


def refused(fn, *args) -> SpecError:
    """``fn(*args)`` must finish raising a SpecError whose one line starts with its file (and line)."""
    err = raised_by(fn, *args)
    assert isinstance(err, SpecError), f"expected SpecError, got {err!r}"
    where = f"{err.path}:{err.line}: " if err.line is not None else f"{err.path}: "
    assert str(err).startswith(where) and "\n" not in str(err)
    return err


def write(tmp_path: Path, data: str | bytes) -> Path:
    p = tmp_path / "hostile.yaml"
    p.write_bytes(data.encode() if isinstance(data, str) else data)
    return p


HOSTILE = {
    "flow_list_4mb": ("[" + ",".join(["1"] * 2_000_000) + "]", None, "larger than"),
    "keys_2mb": ("\n".join(f"k{i}: 1" for i in range(200_000)), None, "larger than"),
    "flow_list_under_limit": ("[" + ",".join(["1"] * 100_000) + "]", 1, f"more than {MAX_EVENTS} YAML events"),
    "keys_under_limit": ("\n".join(f"k{i}: 1" for i in range(25_000)), 10_000, "YAML events"),
    "nested_flow_400": ("x: " + "[" * 400 + "]" * 400, 1, f"nested deeper than {MAX_DEPTH}"),
    "nested_block_400": ("".join(f"{'  ' * i}k{i}:\n" for i in range(400)) + "  " * 400 + "v: 1\n",
                         MAX_DEPTH + 1, "nested deeper"),
    "nul_byte": ("name: a\ninitial: b\x00\n", 2, "not allowed in YAML"),
    "control_char": ("name: a\n\x07\n", 2, "not allowed in YAML"),
    "lone_surrogate": ("name: a\udc80\n", 1, "not allowed in YAML"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_text_is_refused_with_file_and_line(case, tmp_path):
    text, line, fragment = HOSTILE[case]
    err = refused(parse_spec, text, "t.yaml")
    assert err.path == "t.yaml" and fragment in err.message
    if line is None:
        assert err.line is None
    elif case == "keys_under_limit":
        assert err.line > MAX_EVENTS // 2 - 10  # where the event budget ran out
    else:
        assert err.line == line
    if case != "lone_surrogate":  # a lone surrogate cannot be written as UTF-8
        err = refused(load_spec, write(tmp_path, text))
        assert fragment in err.message or "larger than" in err.message


def test_depth_through_aliases_is_bounded():
    # each anchor nests the previous one inside 8 more levels: text depth stays small,
    # the expanded tree does not
    lines = ["a0: &a0 [1]"]
    for i in range(1, 8):
        lines.append(f"a{i}: &a{i} " + "[" * 8 + f"*a{i - 1}" + "]" * 8)
    err = refused(parse_spec, "\n".join(lines) + "\n", "t.yaml")
    assert "nested deeper" in err.message and "aliases" in err.message and err.line is not None


def test_binary_and_invalid_utf8_files_name_the_line(tmp_path):
    err = refused(load_spec, write(tmp_path, b"name: a\ninitial: caf\xe9\n"))
    assert err.line == 2 and "not UTF-8" in err.message
    err = refused(load_spec, write(tmp_path, bytes(range(256)) * 4))
    assert err.line is not None and ("not UTF-8" in err.message or "not allowed" in err.message)


def test_size_limit_is_read_not_trusted(tmp_path):
    big = write(tmp_path, b"# " + b"x" * MAX_SPEC_BYTES)
    err = refused(load_spec, big)
    assert err.line is None and str(err) == f"{big}: spec file is larger than {MAX_SPEC_BYTES} bytes"


def test_not_a_regular_file(tmp_path):
    err = refused(load_spec, tmp_path)
    assert "not a regular file" in err.message and err.line is None


def test_non_text_argument():
    err = refused(parse_spec, b"name: a", "t.yaml")
    assert "must be a str" in err.message


def test_builtin_specs_are_well_inside_the_bounds():
    for p in SPEC_DIR.glob("*.yaml"):
        assert p.stat().st_size * 8 < MAX_SPEC_BYTES
        load_spec(p)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=600))
def test_any_bytes_give_a_spec_or_a_spec_error(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("fuzz") / "f.yaml"
    path.write_bytes(data)
    try:
        load_spec(path)
    except SpecError as err:
        assert str(err).startswith(f"{path}:")


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=400))
def test_any_text_gives_a_spec_or_a_spec_error(text):
    try:
        parse_spec(text, "t.yaml")
    except SpecError as err:
        assert str(err).startswith("t.yaml:")


def _spec(states: str, transitions: str) -> str:
    return f"name: m\ninitial: s0\nstates:\n{states}transitions:\n{transitions}"


def test_validation_work_is_bounded():
    """Shapes whose checks were quadratic: one (state, trigger) with many transitions, long chains."""
    many = "".join(f"  - {{trigger: go, source: s0, dest: s1, guards: [g{i}]}}\n" for i in range(1500))
    err = refused(parse_spec, _spec("  s0: {}\n  s1: {}\n", many), "t.yaml")
    assert "more than 32 transitions on ('s0', 'go')" in err.message and err.line == 39
    states = "".join(f"  s{i}: {{}}\n" for i in range(1200))
    chain = "".join(f"  - {{trigger: t{i}, source: s{i}, dest: s{i + 1}}}\n" for i in range(1199))
    err = refused(parse_spec, _spec(states, chain), "t.yaml")
    assert "'s1199' is not terminal" in err.message


def test_problems_stop_at_a_bound():
    states = "".join(f"  s{i}: {{}}\n" for i in range(300))  # 299 unreachable, non-terminal dead ends
    err = refused(parse_spec, _spec(states, "  - {trigger: go, source: s0, dest: s0}\n"), "t.yaml")
    assert len(err.problems) == 100
