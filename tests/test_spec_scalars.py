"""Scalars YAML accepts but Python cannot build (a 5000-digit int, 2001-02-30) are a SpecError at their line."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_fsm import cli
from hicache_fsm.errors import SpecError
from hicache_fsm.spec import load_spec, parse_spec

HEAD = "machine: m\nstates: [a]\n"


@pytest.mark.parametrize("scalar, kind", [("9" * 5000, "int"), ("2001-02-30", "timestamp"),
                                          ("2001-13-01 10:00:00", "timestamp"), ("-" + "1" * 4400, "int")],
                         ids=["5000_digits", "feb_30", "month_13", "negative_4400_digits"])
def test_unbuildable_scalars_are_spec_errors_with_their_line(scalar, kind, tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(HEAD + f"note: {scalar}\n")
    with pytest.raises(SpecError, match=f"bad {kind} scalar") as info:
        load_spec(path)
    assert (info.value.path, info.value.line) == (str(path), 3)
    with pytest.raises(SpecError, match=f"{path}:3: bad {kind} scalar"):
        parse_spec(HEAD + f"note: {scalar}\n", str(path))


@pytest.mark.parametrize("command", ["validate", "list"])
def test_the_cli_prints_one_line_and_exits_1(command, tmp_path, capsys):
    path = tmp_path / "m.yaml"
    path.write_text(HEAD + "when: 2001-02-30\nbig: " + "7" * 5000 + "\n")
    assert cli.main([command, str(path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{path}:3: bad timestamp scalar" in err


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet="0123456789-:T .xob+e_", min_size=1, max_size=40), st.integers(0, 6000))
def test_any_scalar_parses_or_is_a_spec_error(scalar, digits):
    for value in (scalar, scalar + "1" * digits):
        try:
            parse_spec(HEAD + f"note: {value}\n", "m.yaml")
        except SpecError:
            pass


def test_a_merge_key_is_refused_by_name(tmp_path):
    """It was refused as "could not determine a constructor for the tag ...merge", which names no fix."""
    path = tmp_path / "m.yaml"
    path.write_text(HEAD + "base: &b\n  x: 1\nnote:\n  <<: *b\n")
    with pytest.raises(SpecError, match="merge keys") as info:
        load_spec(path)
    assert info.value.line == 6
