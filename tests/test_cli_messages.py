"""What a newcomer reads: a typo gets a suggestion, paths make sense from anywhere, counts agree, --version."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import hicache_fsm
from hicache_fsm.cli import main
from hicache_fsm.spec import load_builtin
from hicache_fsm.testing.paths import edges

ROOT = Path(__file__).resolve().parents[1]


def test_a_misspelt_machine_gets_a_suggestion_and_no_made_up_path(capsys):
    assert main(["diagram", "residencey"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "did you mean 'residency'?" in line and ".yaml" not in line


def test_version(capsys):
    try:
        main(["--version"])
    except SystemExit as done:
        assert done.code == 0
    assert capsys.readouterr().out.strip() == f"hicache-fsm {hicache_fsm.__version__}"


def _run_outside(tmp_path, *argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "hicache_fsm", *argv], cwd=tmp_path, env=env, capture_output=True,
                          text=True, check=True)


def test_list_and_validate_outside_the_checkout_print_package_paths(tmp_path):
    rows = [json.loads(line) for line in _run_outside(tmp_path, "list", "--json").stdout.splitlines()]
    assert {r["file"] for r in rows} == {f"hicache_fsm/specs/{r['name']}.yaml" for r in rows}
    for line in _run_outside(tmp_path, "validate").stdout.splitlines():
        assert line.startswith("ok hicache_fsm/specs/") and line.endswith(".yaml")


def test_list_counts_transitions_as_check_covers_them(capsys):
    assert main(["list", "--json"]) == 0
    for row in map(json.loads, capsys.readouterr().out.splitlines()):
        spec = load_builtin(row["name"])
        assert row["transitions"] == len({(e.trigger, e.source, e.dest) for e in edges(spec)})
        assert row["entries"] == len(spec.transitions)
    assert main(["list"]) == 0
    residency = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("residency"))
    assert residency.split()[1:4] == ["13", "35", "34"]
