"""Any spec file validates and draws without Python bindings; bindings are checked for the library's machines."""

from __future__ import annotations

import shutil

import pytest

from hicache_fsm.cli import main
from hicache_fsm.errors import BindingError, SpecError
from hicache_fsm.machine import compile_machine
from hicache_fsm.spec import load_spec, parse_spec

DOOR = """\
name: door
doc: A door that opens only when unlocked.
initial: closed
states:
  closed: {doc: Shut.}
  open: {doc: Swung open.}
transitions:
  - trigger: push
    source: closed
    dest: open
    guards: [unlocked]
    effects: [creak]
  - trigger: pull
    source: open
    dest: closed
invariants: [hinges_on]
"""


@pytest.fixture
def door(tmp_path):
    path = tmp_path / "my.yaml"
    path.write_text(DOOR, encoding="utf-8")
    return path


def test_a_users_spec_loads_without_bindings(door):
    spec = load_spec(door)
    assert spec.guard_names() == ("unlocked",) and spec.invariants == ("hinges_on",)


def test_bindings_are_checked_when_asked(door):
    with pytest.raises(SpecError) as info:
        load_spec(door, require_bindings=True)
    messages = [p.message for p in info.value.problems]
    assert any("guard 'unlocked' has no registered implementation for machine 'door'" in m for m in messages)
    assert any("effect 'creak'" in m for m in messages) and any("invariant 'hinges_on'" in m for m in messages)


def test_running_a_spec_still_needs_its_bindings(door):
    with pytest.raises(BindingError, match="door"):
        compile_machine(load_spec(door))


def test_the_librarys_own_machines_are_still_checked():
    text = DOOR.replace("name: door", "name: storage_link")
    with pytest.raises(SpecError, match="guard 'unlocked' has no registered implementation"):
        parse_spec(text, "<own>")
    parse_spec(text, "<own>", require_bindings=False)


def test_job_kinds_are_checked_without_bindings():
    text = DOOR.replace("    effects: [creak]\n", "    emits: [d2x]\n")
    with pytest.raises(SpecError, match="job kind 'd2x' is unknown"):
        parse_spec(text, "<door>")


@pytest.mark.parametrize("fmt", ["mermaid", "dot"] + (["svg"] if shutil.which("dot") else []))
def test_diagram_draws_a_users_spec(door, capsys, fmt):
    assert main(["diagram", str(door), "--format", fmt]) == 0
    out = capsys.readouterr().out
    assert "closed" in out and "push [unlocked]" in out


def test_validate_a_users_spec_and_require_bindings(door, capsys):
    assert main(["validate", str(door)]) == 0
    assert capsys.readouterr().out.strip().endswith("my.yaml")
    assert main(["validate", "--require-bindings", str(door)]) == 1
    err = capsys.readouterr().err
    assert "my.yaml:" in err and "guard 'unlocked'" in err
    assert main(["diagram", "--require-bindings", str(door)]) == 1
    assert "guard 'unlocked'" in capsys.readouterr().err
