"""`fuzz` at its defaults reaches what it promises: every residency and prefetch state (transfers that
complete, fail and land partially), the residency ``storage_lost`` transitions, and with ``--cp`` the
layer_write states; its report lists per-machine coverage like ``check``.

The runs are seeded hypothesis runs (no database, ``deadline=None``): the same code gives the same
runs, so the coverage asserted here does not depend on the machine's speed.
"""

from __future__ import annotations

import argparse

import pytest

from hicache_fsm.commands import fuzz as fuzz_command
from hicache_fsm.commands.args import UsageError
from hicache_fsm.testing.explorer import quiet_cache_logs
from hicache_fsm.testing.paths import CoverageTracker
from hicache_fsm.testing.stateful import cp_machine, hicache_machine, run_fuzz

def _defaults(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    fuzz_command.configure(parser)
    args = parser.parse_args(argv)
    args.steps = fuzz_command.default_steps(args)
    return args


def _fuzz_at_defaults(make_machine, *argv: str) -> dict:
    """``hicache-fsm fuzz`` (or ``fuzz --cp``) at its default examples, steps and seed, in-process."""
    args = _defaults(*argv)
    cov = CoverageTracker()
    with quiet_cache_logs():
        result = run_fuzz(make_machine(coverage=cov), examples=args.examples, steps=args.steps, seed=args.seed)
    assert result.ok, result.failure
    return cov.report()


def test_fuzz_defaults_reach_every_residency_and_prefetch_state_and_storage_lost():
    report = _fuzz_at_defaults(hicache_machine)
    for machine in ("residency", "prefetch", "storage_link"):
        assert report[machine]["missing_states"] == [], (machine, report[machine]["missing_states"])
    unfired = report["residency"]["missing_transitions"]
    assert "device_host_stored --storage_lost--> device_host" not in unfired
    assert "host_stored --storage_lost--> host" not in unfired
    # a prefetch's transfer completes, lands one page short; its query fails
    missing = report["prefetch"]["missing_transitions"]
    for edge in ("transferring --batch_done--> completed", "transferring --batch_short--> partial",
                 "querying --query_failed--> failed"):
        assert edge not in missing, edge


def test_fuzz_cp_defaults_reach_every_layer_write_state_and_transition():
    """In-process: the seeded run draws the same steps whatever earlier tests imported
    (``testing.fixed_draws``); a reservation on a full host fails (``failed``) under the host-pressure
    variant."""
    report = _fuzz_at_defaults(cp_machine, "--cp")
    assert report["layer_write"]["missing_states"] == []
    assert report["layer_write"]["missing_transitions"] == []


def test_fuzz_report_lists_per_machine_coverage(capsys):
    assert fuzz_command.run(_parse(["--cp", "--examples", "3", "--steps", "5", "--quiet"])) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("fuzz: 3 runs of up to 5 steps, seed 0: no failure")
    assert any(line.startswith("layer_write: ") and " states, " in line and line.endswith(" transitions")
               for line in out)
    assert any(line.startswith("residency: ") for line in out)


def test_fuzz_cp_with_adapter_is_a_usage_error():

    with pytest.raises(UsageError, match="--cp"):
        fuzz_command.run(_parse(["--cp", "--adapter", "examples/tiny_lru_cache.py:make_adapter"]))


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    fuzz_command.configure(parser)
    return parser.parse_args(argv)


def test_a_failed_load_reported_done_is_caught():
    """Planted (``failed_load_reported_done``): the failure path of a locked node's load declares it loaded
    (``load_done``) instead of retrying it; the toolkit's ``failed_load_not_done`` check flags the step, and
    ``check``'s ``memory/load_back_pressure`` family finds it on its own."""
    from hicache_fsm.testing.checks import Step, replay_steps
    from hicache_fsm.testing.explorer import explore
    from hicache_fsm.testing.mutants import mutant
    from hicache_fsm.testing.memory_families import pressure_family
    from hicache_fsm.testing.protocol import ProtocolAdapter, protocol_factory

    steps = [Step("insert", ((1,),)), Step("complete_job", (0,)), Step("evict", (1,)), Step("load_back", ((1,),)),
             Step("lock", ((1,),)), Step("fail_job", (0,))]
    _, bounds, factory = pressure_family(protocol_factory)
    with quiet_cache_logs():
        assert replay_steps(ProtocolAdapter(device_pages=2, host_pages=2, write_policy="write_through"), steps) == []
        with mutant("failed_load_reported_done"):
            problems = replay_steps(ProtocolAdapter(device_pages=2, host_pages=2, write_policy="write_through"), steps)
            found = explore(bounds, factory, stop_on_first=True)
    assert problems and "after step 6 fail_job(#0): failed_load_not_done" in problems[0]
    assert found.violations and any(p.startswith("failed_load_not_done") for p in found.violations[0].problems)


@pytest.mark.parametrize("machine, options, named", [
    (object, {}, "state machine class"),  # an AttributeError inside hypothesis before
    (None, {"examples": 0}, "examples"),  # hypothesis's InvalidArgument before
    (None, {"steps": 0}, "steps"),
    (None, {"examples": "5"}, "examples"),
])
def test_run_fuzz_names_what_it_cannot_run(machine, options, named):
    from hicache_fsm.errors import ConfigError

    with pytest.raises(ConfigError, match=named):
        run_fuzz(machine if machine is not None else hicache_machine(examples=1, steps=2), **options)


@pytest.mark.parametrize("variants, named", [
    ({"write_policy": "write_back"}, "non-empty list of dicts"),  # a dict, not a list of them
    (["write_back"], "non-empty list of dicts"),
    ([], "non-empty list of dicts"),  # a ZeroDivisionError inside the run before
])
def test_variants_of_the_wrong_shape_are_refused_when_the_machine_is_made(variants, named):
    from hicache_fsm.errors import ConfigError

    with pytest.raises(ConfigError, match=named):
        hicache_machine(variants=variants)


def test_a_variant_the_adapter_refuses_is_a_usage_error_not_a_found_bug():
    """run_fuzz reported it as a failing run, with a regression test, as if the protocol were wrong."""
    from hicache_fsm.errors import ConfigError

    with pytest.raises(ConfigError, match="variant {'bogus': 1}: HiCacheAdapter: unknown option"):
        run_fuzz(hicache_machine(variants=[{"bogus": 1}], examples=1, steps=2), examples=1, steps=2)
