"""The worked example of docs/fuzzing.md: fuzzing examples/tiny_lru_cache.py, a cache of its own."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from example_util import load_example

from hicache_fsm.cli import main
from hicache_fsm.spec import parse_spec
from hicache_fsm.testing import Bounds, CacheProtocolMachine, explore, replay, run_fuzz

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "tiny_lru_cache.py"


tiny = load_example("tiny_lru_cache.py")

TinyMachine = CacheProtocolMachine.bind(
    tiny.make_adapter, name="TinyMachine", variants=[{}, {"fast_pages": 1, "slow_pages": 2}, {"page_size": 2}],
    settings=settings(max_examples=30, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)),
)
TestTinyCache = TinyMachine.TestCase  # the correct cache passes the stateful machine


def test_example_runs_as_a_script(capsys):
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    out = capsys.readouterr().out
    assert "0 violations" in out and "kv_readback" in out


def test_explorer_on_the_correct_cache():
    result = explore(Bounds(nodes=3, device_pages=2, host_pages=2), tiny.explorer_factory)
    assert result.complete and not result.violations and result.states > 50


@pytest.mark.parametrize("bug", ["capacity", "demote_stale"])
def test_planted_bugs_are_found(bug):
    factory = lambda b: tiny.TinyLRUAdapter(b.device_pages, b.host_pages, b.page_size, bug=bug)
    result = explore(Bounds(nodes=3, device_pages=2, host_pages=1), factory, stop_on_first=True)
    assert result.violations
    machine = CacheProtocolMachine.bind(lambda **kw: tiny.TinyLRUAdapter(bug=bug, **kw), name=f"Buggy_{bug}")
    fuzz = run_fuzz(machine, examples=200, steps=30, seed=0, shrink=False)
    assert not fuzz.ok and fuzz.steps


def test_commands_on_the_example(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the docs run the commands from the repository root
    rc = main(["check", "--adapter", "examples/tiny_lru_cache.py:explorer_factory", "--quiet", "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert rc == 0 and summary["violations"] == 0 and summary["states"] > 50
    rc = main(["check", "--adapter", "examples/tiny_lru_cache.py:buggy_explorer_factory", "--host-pages", "1",
               "--stop-on-first", "--quiet", "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert rc == 1 and summary["violations"] == 1 and summary["counterexamples"][0]["steps"]
    rc = main(["fuzz", "--adapter", "examples/tiny_lru_cache.py:make_adapter", "--examples", "30", "--quiet"])
    assert rc == 0, capsys.readouterr().out
    out_test = tmp_path / "test_regression.py"
    rc = main(["fuzz", "--adapter", "examples/tiny_lru_cache.py:buggy_adapter", "--examples", "200", "--quiet",
               "--test-out", str(out_test)])
    out = capsys.readouterr().out
    assert rc == 1 and "def test_fuzz_regression" in out and out_test.exists()
    namespace: dict = {}
    exec(compile(out_test.read_text(), str(out_test), "exec"), namespace)  # noqa: S102 - our generated test
    with pytest.raises(AssertionError):
        namespace["test_fuzz_regression"]()


def test_trace_replay_with_the_example_spec(tmp_path, capsys):
    spec_file = tmp_path / "tiny_page.yaml"
    spec_file.write_text(tiny.TINY_SPEC)
    cache = tiny.TinyLRUCache(fast_pages=1, slow_pages=1)
    trace = tmp_path / "run.jsonl"
    close = tiny.record_trace(cache, str(trace))
    cache.put((1, 2, 3), [1, 2, 3])
    cache.get((1, 2))
    close()
    assert replay(trace, [parse_spec(tiny.TINY_SPEC)]).ok
    assert main(["replay", str(trace), "--spec", str(spec_file)]) == 0
    lines = trace.read_text().splitlines()
    lines[2] = lines[2].replace('"dest": "fast"', '"dest": "slow"')
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    assert main(["replay", str(bad), "--spec", str(spec_file)]) == 1
    assert "line 3" in capsys.readouterr().out
