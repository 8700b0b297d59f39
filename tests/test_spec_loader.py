"""The spec loader: every malformed spec fails with a SpecError naming file and line.

Each malformed case is its own fixture under tests/fixtures/specs/bad_*.yaml:
``good_minimal.yaml`` with one defect. The table below gives, for each, the line
the error must point at and a piece of the message.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_fsm.errors import SpecError
from hicache_fsm.spec import (
    KNOWN_TAGS,
    RESERVED_TRIGGERS,
    SPEC_DIR,
    Spec,
    load_all,
    load_builtin,
    load_spec,
    parse_spec,
    spec_paths,
)

FIXTURES = Path(__file__).parent / "fixtures" / "specs"

# fixture (without bad_ and .yaml) -> (line the error points at, substring of the message)
BAD_CASES: dict[str, tuple[int, str]] = {
    "yaml_syntax": (11, "YAML syntax error"),
    "multi_document": (30, "YAML syntax error"),
    "empty": (1, "empty spec file"),
    "top_level_list": (2, "must be a mapping at the top level"),
    "unknown_top_key": (4, "unknown key 'intial' in spec (did you mean 'initial'?)"),
    "unknown_key": (25, "unknown key 'triger' in transition (did you mean 'trigger'?)"),
    "states_not_mapping": (5, "key 'states' must be a mapping, got a list"),
    "guards_not_list": (18, "key 'guards' must be a list, got str"),
    "dest_not_string": (27, "key 'dest' must be a string, got int"),
    "doc_not_string": (9, "state 'busy' key 'doc' must be a string, got a mapping"),
    "unknown_tag": (13, "unknown tag 'terminl'"),
    "missing_initial": (2, "missing required key 'initial'"),
    "unknown_initial": (4, "initial state 'idel' is not a declared state"),
    "unknown_dest": (25, "goes to unknown state 'dne'"),
    "unknown_source": (25, "comes from unknown state 'bsy'"),
    "duplicate_state": (11, "duplicate key 'busy' (first at line 8)"),
    "duplicate_key": (28, "duplicate key 'dest' (first at line 27)"),
    "non_string_key": (11, "keys must be strings"),
    "ambiguous": (21, "no guard tells them apart"),
    "overlapping_guards": (21, "can both be enabled"),
    "unreachable": (14, "state 'orphan' is unreachable"),
    "dead_end": (14, "state 'stuck' is not terminal but has no way out"),
    "unbound_guard": (15, "guard 'has_room' has no registered implementation"),
    "unbound_effect": (15, "effect 'alloc_host' has no registered implementation"),
    "unbound_invariant": (28, "invariant 'slots_owned_once' has no registered check"),
    "unknown_job_kind": (15, "job kind 'd2x' is unknown"),
    "reserved_trigger": (25, "trigger name 'to_done' is reserved"),
    "bad_state_name": (8, "state name 'Busy' must match"),
    "leaves_terminal": (28, "leaves terminal state 'done'"),
    "guard_and_unless": (15, "both requires and forbids"),
    "duplicate_source": (25, "lists a source state twice"),
    "empty_source": (25, "has no source state"),
    "missing_dest": (25, "transition is missing dest"),
    "python_tag": (3, "could not determine a constructor"),
    "python_tag_on_mapping": (4, "tag 'tag:yaml.org,2002:python/object:os.system' is not allowed"),
    "python_tag_on_list": (7, "is not allowed: a spec holds plain mappings and lists"),
    "dotted_guard": (11, "guard name 'os.system' must match"),
    "recursive_alias": (13, "recursive YAML alias"),
    "alias_bomb": (2, "spec too large"),
    "many_problems": (25, "goes to unknown state 'dne'"),
    "nine_mistakes": (8, "unknown tag 'sticky'"),
}


def test_every_bad_fixture_is_in_the_table_and_vice_versa():
    on_disk = {p.stem.removeprefix("bad_") for p in FIXTURES.glob("bad_*.yaml")}
    assert on_disk == set(BAD_CASES)


def test_good_fixture_validates():
    spec = load_spec(FIXTURES / "good_minimal.yaml")
    assert spec.initial == "idle"
    assert spec.state_names == ("idle", "busy", "done")
    assert [t.trigger for t in spec.transitions] == ["start", "start", "finish"]


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_spec_reports_file_and_line(case):
    line, fragment = BAD_CASES[case]
    path = FIXTURES / f"bad_{case}.yaml"
    with pytest.raises(SpecError) as info:
        load_spec(path)
    err = info.value
    assert err.path == str(path)
    assert err.line == line, f"{case}: expected line {line}, got {err.line} ({err.message})"
    assert fragment in err.message
    assert str(err).startswith(f"{path}:{line}: ")
    assert "\n" not in err.message, "one problem, one line"


def test_all_problems_are_collected():
    with pytest.raises(SpecError) as info:
        load_spec(FIXTURES / "bad_many_problems.yaml")
    found = [(p.line, p.message) for p in info.value.problems]
    assert len(found) == 4
    assert any("unknown state 'dne'" in m and ln == 25 for ln, m in found)
    assert any("guard 'has_room'" in m and ln == 15 for ln, m in found)
    assert any("guard 'has_room'" in m and ln == 21 for ln, m in found)
    assert any("job kind 'd2x'" in m and ln == 15 for ln, m in found)


def test_python_tags_are_never_constructed(monkeypatch):
    import os

    called = []
    monkeypatch.setattr(os, "system", lambda *a: called.append(a) or 0)
    text = "name: !!python/object/apply:os.system ['true']\ninitial: a\nstates: {a: {tags: [terminal]}}\ntransitions: []\n"
    with pytest.raises(SpecError):
        parse_spec(text)
    assert called == []


def test_unreadable_file_is_a_spec_error(tmp_path):
    with pytest.raises(SpecError) as info:
        load_spec(tmp_path / "missing.yaml")
    assert "cannot read spec" in info.value.message and info.value.line is None
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"name: caf\xe9\n")
    with pytest.raises(SpecError, match="cannot read spec"):
        load_spec(bad)


def test_unknown_builtin_name_lists_the_known_ones():
    with pytest.raises(SpecError, match="no spec named 'nope'; known: .*residency"):
        load_builtin("nope")


@pytest.mark.parametrize("name", ["../specs/residency", "/etc/passwd", "residency.yaml", "", 3])
def test_a_builtin_name_is_a_bare_name_never_a_path(name):
    """A recorded trace names its machines, and ``replay`` loads them by name: a path there reads nothing."""
    with pytest.raises(SpecError, match="no spec named"):
        load_builtin(name)


# --------------------------------------------------------------------------- the library's own specs


def test_every_builtin_spec_validates():
    specs = load_all()
    assert {s.name for s in specs} >= {"residency", "prefetch", "layer_write", "storage_link"}
    for spec in specs:
        assert isinstance(spec, Spec)
        assert Path(spec.path).stem == spec.name, "a spec file is named after its machine"
        assert spec.initial in spec.state_names
        for t in spec.transitions:
            assert t.line is not None
        for s in spec.states:
            assert s.tags <= KNOWN_TAGS
        assert not set(spec.triggers) & RESERVED_TRIGGERS


@pytest.mark.parametrize("path", spec_paths(), ids=lambda p: p.stem)
def test_builtin_specs_load_by_name_and_path(path):
    assert load_builtin(path.stem) == load_spec(SPEC_DIR / path.name)


# --------------------------------------------------------------------------- mutated real specs


REAL_TEXTS = {p.stem: p.read_text(encoding="utf-8") for p in spec_paths()}
REAL_DATA = {name: yaml.safe_load(text) for name, text in REAL_TEXTS.items()}
_Dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def _assert_clean_outcome(text: str, where: str) -> None:
    """Either the text is a valid spec, or it fails with SpecError carrying a line; nothing else."""
    try:
        spec = parse_spec(text, where)
    except SpecError as err:
        assert err.path == where
        assert isinstance(err.line, int) and err.line >= 1, f"no line for: {err}"
        for p in err.problems:
            assert isinstance(p.line, int) and p.line >= 1, f"no line for: {p}"
            assert "\n" not in p.message
    else:
        assert isinstance(spec, Spec)


def _mutate_data(data: dict, rnd: random.Random) -> dict:
    """One structural mutation of a spec loaded as plain data."""
    raw_states, raw_transitions = data.get("states"), data.get("transitions")
    states = list(raw_states) if isinstance(raw_states, dict) else []
    transitions = [t for t in raw_transitions if isinstance(t, dict) and t] if isinstance(raw_transitions, list) else []
    kind = rnd.choice(
        ["delete_state", "rename_dest", "rename_source", "drop_key", "drop_transition_key", "retype",
         "duplicate_transition", "swap_initial", "add_guard", "drop_transition", "tag_terminal", "rename_trigger"]
    )
    if kind == "delete_state" and states:
        del data["states"][rnd.choice(states)]
    elif kind == "rename_dest" and transitions:
        t = rnd.choice(transitions)
        t["dest"] = rnd.choice([*states, "nowhere", "Bad-Name", 42, None, ["a"]])
    elif kind == "rename_source" and transitions:
        t = rnd.choice(transitions)
        t["source"] = rnd.choice([*states, "nowhere", [], [rnd.choice(states or ["x"])] * 2, 7])
    elif kind == "drop_key" and data:
        data.pop(rnd.choice(list(data)), None)
    elif kind == "drop_transition_key" and transitions:
        t = rnd.choice(transitions)
        t.pop(rnd.choice(list(t)), None)
    elif kind == "retype" and data:
        key = rnd.choice(list(data))
        data[key] = rnd.choice([None, 3, "text", [], {}, [1, 2], {"a": None}])
    elif kind == "duplicate_transition" and transitions:
        raw_transitions.insert(rnd.randrange(len(raw_transitions) + 1), dict(rnd.choice(transitions)))
    elif kind == "swap_initial" and states:
        data["initial"] = rnd.choice(states)
    elif kind == "add_guard" and transitions:
        t = rnd.choice(transitions)
        t[rnd.choice(["guards", "unless", "effects", "emits"])] = [rnd.choice(["unlocked", "nope", "d2h", "d2x", 5])]
    elif kind == "drop_transition" and transitions:
        raw_transitions.remove(rnd.choice(transitions))
    elif kind == "tag_terminal" and states:
        name = rnd.choice(states)
        data["states"][name] = {"tags": [rnd.choice(["terminal", "in_flight", "bogus"])]}
    elif kind == "rename_trigger" and transitions:
        rnd.choice(transitions)["trigger"] = rnd.choice(["trigger", "to_x", "Bad", "ok_name", "", 1])
    return data


def _mutate_text(text: str, rnd: random.Random) -> str:
    """One textual mutation: delete, duplicate, indent or truncate lines."""
    lines = text.splitlines(keepends=True)
    i = rnd.randrange(len(lines))
    kind = rnd.choice(["delete", "duplicate", "indent", "dedent", "truncate", "swap"])
    if kind == "delete":
        del lines[i]
    elif kind == "duplicate":
        lines.insert(i, lines[i])
    elif kind == "indent":
        lines[i] = "  " + lines[i]
    elif kind == "dedent":
        lines[i] = lines[i][2:] if lines[i].startswith("  ") else lines[i].lstrip()
    elif kind == "truncate":
        return text[: rnd.randrange(len(text))]
    elif kind == "swap" and i + 1 < len(lines):
        lines[i], lines[i + 1] = lines[i + 1], lines[i]
    return "".join(lines)


MUTATION_SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@MUTATION_SETTINGS
@given(name=st.sampled_from(sorted(REAL_TEXTS)), seed=st.integers(0, 2**32 - 1), rounds=st.integers(1, 3))
def test_structurally_mutated_real_specs_fail_cleanly(name, seed, rounds):
    rnd = random.Random(seed)
    data = copy.deepcopy(REAL_DATA[name])
    for _ in range(rounds):
        data = _mutate_data(data, rnd)
    _assert_clean_outcome(yaml.dump(data, Dumper=_Dumper, sort_keys=False), f"specs/{name}.yaml")


@MUTATION_SETTINGS
@given(name=st.sampled_from(sorted(REAL_TEXTS)), seed=st.integers(0, 2**32 - 1), rounds=st.integers(1, 3))
def test_textually_mutated_real_specs_fail_cleanly(name, seed, rounds):
    rnd = random.Random(seed)
    text = REAL_TEXTS[name]
    for _ in range(rounds):
        text = _mutate_text(text, rnd) or "\n"
    _assert_clean_outcome(text, f"specs/{name}.yaml")


def test_one_path_given_to_load_all_is_refused_not_read_letter_by_letter(tmp_path):
    with pytest.raises(SpecError, match="load_all takes a list of spec paths") as info:
        load_all(str(tmp_path))  # was "/: cannot read spec: not a regular file", the path's first letter
    assert str(tmp_path) in str(info.value)


@pytest.mark.parametrize("spec", ["residency", None, {"name": "residency"}])
def test_a_machine_compiles_a_spec_object_only(spec):
    from hicache_fsm.errors import ConfigError
    from hicache_fsm.machine import compile_machine

    with pytest.raises(ConfigError, match="a machine compiles a Spec"):
        compile_machine(spec)


@pytest.mark.parametrize("text", [
    'name: "mach\\n"\ninitial: a\nstates: {a: {tags: [terminal]}}\ntransitions: []\n',
    'name: m\ninitial: a\nstates: {a: {}, "b\\n": {tags: [terminal]}}\ntransitions: [{trigger: go, source: a, dest: "b\\n"}]\n',
    'name: m\ninitial: a\nstates: {a: {}, b: {tags: [terminal]}}\ntransitions: [{trigger: "go\\n", source: a, dest: b}]\n',
])
def test_a_name_ending_in_a_newline_is_refused(text):
    """``$`` alone matches before a final newline: a state "b\\n" would validate and draw as a second "b"."""
    with pytest.raises(SpecError, match="must match"):
        parse_spec(text)
