"""A spec with nine mistakes: ``validate`` reports all nine in one pass, identically on every run."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from hicache_fsm.errors import SpecError
from hicache_fsm.spec import load_spec

NINE = pathlib.Path(__file__).parent / "fixtures" / "specs" / "bad_nine_mistakes.yaml"
EXPECTED = [  # (line, words of the message): one per mistake, from parsing to the graph to job kinds
    (8, "unknown tag 'sticky'"), (17, "unknown key 'emitz'"), (18, "'state' is reserved"),
    (24, "unknown key 'colour'"), (25, "lists a source state twice"), (32, "leaves terminal state"),
    (35, "both requires and forbids"), (9, "'orphan' is unreachable"), (28, "job kind 'teleport'"),
]


def test_every_mistake_is_reported_once():
    with pytest.raises(SpecError) as info:
        load_spec(NINE)
    got = [(p.line, p.message) for p in info.value.problems]
    assert len(got) == len(EXPECTED) == 9
    for (line, message), (want_line, words) in zip(got, EXPECTED):
        assert line == want_line and words in message


def test_validate_prints_the_same_nine_lines_whatever_the_hash_seed():
    outputs = set()
    for seed in ("0", "1", "42"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        run = subprocess.run([sys.executable, "-m", "hicache_fsm", "validate", str(NINE)], capture_output=True,
                             text=True, env=env)
        assert run.returncode == 1
        assert len(run.stderr.splitlines()) == 9
        outputs.add(run.stderr)
    assert len(outputs) == 1
