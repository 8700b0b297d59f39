"""`hicache-fsm list / validate / diagram` through the CLI entry point."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hicache_fsm import diagrams
from hicache_fsm.cli import main
from hicache_fsm.spec import spec_paths

FIXTURES = Path(__file__).parent / "fixtures" / "specs"
GOOD = FIXTURES / "good_minimal.yaml"
BAD = FIXTURES / "bad_unknown_dest.yaml"
MANY = FIXTURES / "bad_many_problems.yaml"
BUILTIN = [p.stem for p in spec_paths()]
PROBLEM_LINE = re.compile(r"^(?P<file>[^:\n]+):(?P<line>\d+): (?P<message>.+)$")


def test_validate_all_builtin_specs(capsys):
    assert main(["validate"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert len(lines) == len(BUILTIN)
    for name, line in zip(BUILTIN, lines):
        assert line.startswith("ok ") and line.endswith(f"{name}.yaml")


def test_validate_good_file_and_directory(capsys):
    assert main(["validate", str(GOOD)]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("ok ") and out.endswith("good_minimal.yaml") and "\n" not in out
    assert main(["validate", str(Path(spec_paths()[0]).parent)]) == 0


def test_validate_bad_file_prints_file_line_message(capsys):
    assert main(["validate", str(BAD)]) != 0
    out, err = capsys.readouterr()
    assert out == ""
    [line] = err.splitlines()
    m = PROBLEM_LINE.match(line)
    assert m, line
    assert m["file"].endswith("bad_unknown_dest.yaml") and m["line"] == "25"
    assert "unknown state 'dne'" in m["message"]


def test_validate_prints_every_problem_and_keeps_going(capsys):
    code = main(["validate", str(MANY), str(GOOD)])
    out, err = capsys.readouterr()
    assert code == 1
    assert out.strip().endswith("good_minimal.yaml")
    problems = [PROBLEM_LINE.match(line) for line in err.splitlines()]
    assert len(problems) == 4 and all(problems)
    assert sorted(int(m["line"]) for m in problems) == [15, 15, 21, 25]


def test_validate_missing_file(capsys, tmp_path):
    assert main(["validate", str(tmp_path / "nope.yaml")]) == 1
    assert "cannot read spec" in capsys.readouterr().err


def test_validate_subprocess_exit_status_and_output():
    proc = subprocess.run(
        [sys.executable, "-m", "hicache_fsm.cli", "validate", str(BAD)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert proc.stdout == ""
    assert re.search(r"bad_unknown_dest\.yaml:25: transition 'finish' goes to unknown state 'dne'", proc.stderr)


def test_list_shows_every_spec(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["name", "states", "transitions", "spec", "entries", "file"]
    rows = {line.split()[0]: line.split() for line in out[1:]}
    assert set(rows) == set(BUILTIN)
    for name, (_, states, trans, entries, path) in rows.items():
        assert int(states) > 0 and int(trans) >= int(entries) > 0 and path.endswith(f"{name}.yaml")


def test_list_json_and_bad_file(capsys):
    assert main(["list", "--json", str(GOOD), str(BAD)]) == 1
    out, err = capsys.readouterr()
    assert '"name": "storage_link"' in out and '"states": 3' in out
    assert PROBLEM_LINE.match(err.splitlines()[0])


def test_list_of_no_spec_is_a_usage_error_and_of_only_bad_ones_prints_no_table(tmp_path, capsys):
    assert main(["list", str(tmp_path)]) == 2
    assert capsys.readouterr() == ("", "hicache-fsm list: error: no spec files found (see hicache-fsm list --help)\n")
    assert main(["validate", ""]) == 2
    assert capsys.readouterr() == ("", "hicache-fsm validate: error: an empty PATH names no spec file "
                                       "(see hicache-fsm validate --help)\n")
    assert main(["list", str(BAD)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and PROBLEM_LINE.match(err.splitlines()[0])


@pytest.mark.parametrize("name", BUILTIN)
def test_diagram_mermaid_by_name(capsys, name):
    assert main(["diagram", name]) == 0
    out = capsys.readouterr().out
    assert out.startswith("stateDiagram-v2\n")


def test_diagram_by_path_formats(capsys, tmp_path):
    assert main(["diagram", str(GOOD), "--format", "mermaid"]) == 0
    mermaid = capsys.readouterr().out
    assert mermaid.startswith("stateDiagram-v2") and "idle --> busy : start [nothing_in_flight] / d2h" in mermaid
    assert main(["diagram", str(GOOD), "--format", "dot"]) == 0
    dot = capsys.readouterr().out
    assert dot.startswith('digraph "storage_link" {') and '"idle" -> "busy"' in dot
    target = tmp_path / "out.mmd"
    assert main(["diagram", str(GOOD), "-o", str(target)]) == 0
    assert target.read_text() == mermaid


def test_diagram_all(capsys, tmp_path):
    assert main(["diagram", "--all"]) == 0
    out = capsys.readouterr().out
    assert out.count("stateDiagram-v2") == len(BUILTIN)
    assert main(["diagram", "--all", "--format", "dot", "-o", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{n}.dot" for n in BUILTIN)


def test_diagram_errors(capsys):
    assert main(["diagram", "no_such_machine"]) == 2  # a usage error: the name is not a machine
    assert "no machine named 'no_such_machine'" in capsys.readouterr().err
    assert main(["diagram", str(BAD)]) == 1
    assert PROBLEM_LINE.match(capsys.readouterr().err.splitlines()[0])
    assert main(["diagram"]) == 2


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` is not installed")
def test_diagram_svg(capsys, tmp_path):
    target = tmp_path / "residency.svg"
    assert main(["diagram", "residency", "--format", "svg", "-o", str(target)]) == 0
    svg = target.read_text()
    assert "<svg" in svg and "</svg>" in svg and "residency" in svg


def test_diagram_svg_without_graphviz_says_how_to_install(capsys, monkeypatch):
    monkeypatch.setattr(diagrams.shutil, "which", lambda name: None)
    assert main(["diagram", "residency", "--format", "svg"]) == 1
    err = capsys.readouterr().err
    assert "Graphviz" in err and "apt-get install graphviz" in err


def test_bench_dispatch_smoke(capsys):
    import json

    assert main(["bench", "dispatch", "--objects", "200", "--repeats", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    for key in ("compiled_ns", "transitions_ns", "dict_ns", "speedup_vs_transitions", "ratio_vs_dict"):
        assert result[key] > 0
    assert result["objects"] == 200


def test_a_file_name_that_is_not_utf8_is_shown_escaped(tmp_path, capsys):
    """A strict UTF-8 stdout could not print its bytes: the report stopped with UnicodeEncodeError."""
    name = os.fsdecode(b"\xff\x1b.yaml")  # a byte no UTF-8 holds, and an ESC a terminal would act on
    shutil.copy(GOOD, tmp_path / name)
    assert main(["validate", str(tmp_path / name)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ok ") and "\\udcff\\x1b.yaml" in out and "\x1b" not in out
    out.encode("utf-8")  # strict: no surrogate left
    assert main(["list", str(tmp_path)]) == 0
    assert "\\udcff\\x1b.yaml" in capsys.readouterr().out
