"""`check` flags: an explicit bound equal to its default still counts, and incomplete runs never pass."""

from __future__ import annotations

import json

import pytest

from hicache_fsm.cli import build_parser, main
from hicache_fsm.commands.check import bounds_given


@pytest.mark.parametrize("argv, given", [
    (["check"], False),
    (["check", "--json"], False),
    (["check", "--nodes", "3"], True),  # 3 is the default: still an explicit single exploration
    (["check", "--write-policy", "write_through"], True),
    (["check", "--track-hits"], True),
    (["check", "--max-depth", "2"], True),
])
def test_an_explicit_bound_flag_selects_one_exploration(argv, given):
    assert bounds_given(build_parser().parse_args(argv)) is given


def test_explicit_default_nodes_runs_one_exploration_to_its_depth(capsys):
    assert main(["check", "--nodes", "3", "--max-depth", "2", "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "runs" not in out and out["bounds"]["nodes"] == 3 and out["complete"]
    assert "seconds" not in out  # the JSON does not depend on the machine


def test_a_state_budget_leaves_the_run_incomplete(capsys):
    assert main(["check", "--nodes", "2", "--max-states", "5", "--quiet"]) == 0
    assert "INCOMPLETE (state budget 5 spent)" in capsys.readouterr().out


def test_the_safety_stop_fails_the_run_loudly(capsys, monkeypatch):
    from hicache_fsm.testing import explorer

    ticks = iter(range(0, 10**6, 1000))  # a clock that jumps 1000 s per reading: the stop fires at once
    monkeypatch.setattr(explorer.time, "perf_counter", lambda: float(next(ticks)))
    assert main(["check", "--nodes", "2", "--max-seconds", "1", "--quiet"]) == 1
    assert "INCOMPLETE (safety stop: 1s reached)" in capsys.readouterr().out


def test_help_says_how_long_write_policy_all_takes(capsys):
    with pytest.raises(SystemExit):
        main(["check", "--help"])
    assert "tens of minutes" in " ".join(capsys.readouterr().out.split())


def test_every_explained_unreached_transition_is_a_transition_of_its_spec():
    from hicache_fsm.spec import load_builtin
    from hicache_fsm.testing.protocol import UNREACHED_REASONS

    for machine, edges in UNREACHED_REASONS.items():
        spec = load_builtin(machine)
        real = {f"{s} --{t.trigger}--> {t.dest}" for t in spec.transitions for s in t.sources}
        assert set(edges) <= real, set(edges) - real
        assert all(reason for reason in edges.values())


def test_fuzz_reports_the_runs_it_was_asked_for(capsys):
    assert main(["fuzz", "--examples", "7", "--steps", "5", "--quiet"]) == 0
    assert "fuzz: 7 runs of up to 5 steps" in capsys.readouterr().out


def test_fuzz_json_is_the_same_on_every_run(capsys):
    """It carried the seconds taken: two runs of one seed differed (check's JSON never did)."""
    outs = []
    for _ in range(2):
        assert main(["fuzz", "--examples", "3", "--steps", "5", "--seed", "7", "--json", "--quiet"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and "seconds" not in json.loads(outs[0])


def test_plain_check_reports_each_family_on_stderr_unless_quiet(capsys, monkeypatch):
    """The portfolio ran 35 s with no line on stderr inside a family; each family now reports as it goes."""
    from hicache_fsm.testing import protocol
    from hicache_fsm.testing.explorer import Bounds

    tiny = [(f"tiny/{w}", Bounds(nodes=1, device_pages=1, host_pages=1, write_policy=w, max_depth=2),
             protocol.protocol_factory) for w in ("write_through", "write_back")]
    monkeypatch.setattr(protocol, "default_families", lambda: tiny)
    assert main(["check"]) == 0
    err = capsys.readouterr().err
    assert "tiny/write_through (1/2): done:" in err and "tiny/write_back (2/2): done:" in err
    assert main(["check", "--quiet"]) == 0
    assert "done:" not in capsys.readouterr().err


class _InterruptingCache:
    """A prefix-cache factory whose 40th insert is interrupted (Ctrl-C arriving mid-search)."""

    inserts = [0]

    @classmethod
    def factory(cls, bounds):
        from hicache_fsm.testing.explorer import hicache_factory

        adapter = hicache_factory(bounds)
        insert = adapter.insert

        def interrupted_insert(tokens, *a):
            cls.inserts[0] += 1
            if cls.inserts[0] == 40:
                raise KeyboardInterrupt
            return insert(tokens, *a)

        adapter.insert = interrupted_insert
        return adapter


def test_an_interrupted_exploration_returns_what_it_found():
    from hicache_fsm.testing.explorer import Bounds, Explorer

    _InterruptingCache.inserts = [0]
    result = Explorer(_InterruptingCache.factory, Bounds(nodes=3, device_pages=2, host_pages=2)).run()
    assert result.stopped_by == "interrupted" and not result.complete and result.states > 1
    assert result.to_json()["complete"] is False and result.to_json()["stopped_by"] == "interrupted"


def test_sigterm_ends_check_with_its_partial_result(tmp_path):
    """The default bounds without a depth run for minutes: SIGTERM prints what was explored, exit 130."""
    import os
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "hicache_fsm.cli", "check", "--nodes", "3"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    read = []
    for line in proc.stderr:  # the first progress line: the search is running
        read.append(line)
        if line.startswith("explore: "):
            break
    else:  # it ended before searching (it could not start, say): show why
        proc.wait(timeout=120)
        pytest.fail(f"check ended before its first progress line (exit {proc.returncode}): {''.join(read)}")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out + "".join(read) + err
    assert "INCOMPLETE (interrupted), 0 violations" in out


def test_explicit_bounds_run_the_protocol_checks_of_the_families(capsys):
    """With bounds given, check ran the plain adapter: a policy obligation broken (a selective backup one hit
    early) passed `check --write-policy write_through_selective` yet failed plain `check`."""
    from hicache_fsm.testing.explorer import quiet_cache_logs
    from hicache_fsm.testing.mutants import mutant

    with quiet_cache_logs(), mutant("selective_threshold_off_by_one"):
        assert main(["check", "--write-policy", "write_through_selective", "--nodes", "2", "--max-depth", "3",
                     "--stop-on-first", "--quiet"]) == 1
    assert "policy_selective" in capsys.readouterr().out
