"""`check` and `fuzz` never pass a run that checked nothing, say when a depth bound cut the search, report an
adapter's own failures without a traceback, and tell a broken adapter factory from a found bug."""

import json
from pathlib import Path

import pytest

from hicache_fsm.cli import main
from hicache_fsm.errors import ConfigError
from hicache_fsm.testing import Bounds, CacheAdapter, CacheProtocolMachine, HiCacheAdapter, MatchInfo, NotSupported
from hicache_fsm.testing import explore, run_fuzz
from hicache_fsm.testing.stateful import BrokenFactory, VariantRefused

HERE = Path(__file__).resolve()


class NoStateKey(CacheAdapter):
    """Refuses every insert ("no room"), and has neither ``state_key`` nor ``size``: the explorer cannot run it."""

    def insert(self, tokens):
        return False

    def match(self, tokens):
        return MatchInfo(0)

    def read_kv(self, tokens):
        return []

    def invariant_violations(self):
        return []


class Noop(NoStateKey):
    """Refuses every insert: nothing is ever cached, and there is one state."""

    name = "noop"

    def state_key(self):
        return 0

    def size(self):
        return 0


class CountsMatches(Noop):
    """Refuses every insert, but counts its matches: several states, none with anything cached."""

    def __init__(self):
        self.matches = 0

    def match(self, tokens):
        self.matches += 1
        return MatchInfo(0)

    def state_key(self):
        return min(self.matches, 3)


class InsertNotSupported(Noop):
    def insert(self, tokens):
        raise NotSupported("insert")


class Unhashable(Noop):
    def state_key(self):
        return [1]


class BreaksOnceFilled(HiCacheAdapter):
    """A working cache whose invariant check raises as soon as something is cached."""

    def invariant_violations(self):
        if self.size():
            raise RuntimeError("adapter bug")
        return super().invariant_violations()


def noop(**_):
    return Noop()


def noop_explorer(bounds):
    return Noop()


def no_state_key(bounds):
    return NoStateKey()


def unhashable(bounds):
    return Unhashable()


def breaks_once_filled(bounds):
    return BreaksOnceFilled(device_pages=bounds.device_pages, host_pages=bounds.host_pages, layers=1)


def check(capsys, *argv):
    """``hicache-fsm check ARGV --quiet``: exit status, stdout, stderr."""
    status = main(["check", *argv, "--quiet"])
    out = capsys.readouterr()
    return status, out.out, out.err


# ------------------------------------------------------------------ a run that checked nothing


def test_fuzz_fails_a_run_in_which_no_insert_was_accepted():
    result = run_fuzz(CacheProtocolMachine.bind(noop), examples=5, steps=5, seed=0)
    assert not result.ok and "accepted no insert" in result.checked_nothing
    assert result.test_code == "" and "checked nothing" in result.to_json()["failure"]


def test_fuzz_command_exits_1_when_it_checked_nothing(capsys):
    assert main(["fuzz", "--adapter", f"{HERE}:noop", "--examples", "3", "--steps", "3", "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "checked nothing" in out and "regression test" not in out


def test_explore_of_a_cache_that_never_changes_is_no_pass():
    result = explore(Bounds(), noop_explorer)
    assert result.complete and not result.violations
    assert not result.ok and result.checked_nothing() == "no step led to a second state"


def test_explore_with_every_insert_refused_is_no_pass():
    result = explore(Bounds(), lambda b: CountsMatches())
    assert result.states > 1 and not result.ok and result.checked_nothing() == "the adapter accepted no insert"


def test_check_command_reports_a_run_that_checked_nothing(capsys):
    status, out, _ = check(capsys, "--adapter", f"{HERE}:noop_explorer")
    assert status == 1 and "CHECKED NOTHING" in out
    status, out, _ = check(capsys, "--adapter", f"{HERE}:noop_explorer", "--json")
    assert status == 1 and json.loads(out)["checked_nothing"]


def test_an_insert_raising_not_supported_is_a_failure_not_a_skip():
    result = explore(Bounds(), lambda b: InsertNotSupported())
    assert result.violations and "NotSupported" in result.violations[0].problems[0]
    fuzz = run_fuzz(CacheProtocolMachine.bind(lambda: InsertNotSupported()), examples=3, steps=3, seed=0)
    assert not fuzz.ok and "NotSupported" in fuzz.failure and fuzz.test_code


def test_the_real_cache_checks_something():
    result = explore(Bounds(nodes=2, max_depth=3))
    assert result.ok and result.inserts and not result.checked_nothing()
    assert run_fuzz(CacheProtocolMachine.bind(HiCacheAdapter), examples=3, steps=5, seed=0).ok


# ------------------------------------------------------------------ depth bounds


def test_a_depth_cut_is_reported_as_such():
    cut = explore(Bounds(max_depth=1))
    assert cut.complete and cut.depth_bounded and cut.to_json()["depth_bounded"]
    dry = explore(Bounds(nodes=1, device_pages=1, host_pages=1, alphabet=1, max_depth=40))
    assert dry.complete and dry.max_depth < 40 and not dry.depth_bounded


def test_check_says_complete_to_depth_n(capsys):
    status, out, _ = check(capsys, "--max-depth", "1")
    assert status == 0 and "complete to depth 1" in out
    status, out, _ = check(capsys, "--max-depth", "1", "--json")
    summary = json.loads(out)
    assert status == 0 and summary["complete"] and summary["depth_bounded"]


# ------------------------------------------------------------------ the adapter's own failures


def test_check_refuses_an_adapter_without_state_key(capsys):
    status, _, err = check(capsys, "--adapter", f"{HERE}:no_state_key")
    assert status == 2 and "lacks state_key and size" in err and "Traceback" not in err
    with pytest.raises(ConfigError, match="state_key"):
        explore(Bounds(), no_state_key)


def test_a_raising_invariant_check_is_reported_with_its_trace(capsys):
    status, out, err = check(capsys, "--adapter", f"{HERE}:breaks_once_filled", "--max-depth", "2")
    assert status == 1 and "adapter_error" in out and "RuntimeError: adapter bug" in out
    assert "1. insert(" in out and "Traceback" not in err


def test_an_unhashable_state_key_is_reported(capsys):
    status, out, err = check(capsys, "--adapter", f"{HERE}:unhashable")
    assert status == 1 and "state_key() returned [1], which is not hashable" in out and "Traceback" not in err


# ------------------------------------------------------------------ unbuildable variants


def strict(device_pages=4):
    return HiCacheAdapter(device_pages=device_pages)


@pytest.mark.parametrize("examples", [1, 20])
def test_a_factory_failing_with_its_own_error_is_a_broken_factory(examples):
    machine = CacheProtocolMachine.bind(strict, variants=[{}, {"devce_pages": 3}])
    with pytest.raises(BrokenFactory, match="TypeError"):
        run_fuzz(machine, examples=examples, steps=5, seed=0, shrink=False)


def test_a_factory_returning_no_adapter_is_a_broken_factory():
    with pytest.raises(BrokenFactory, match="not a CacheAdapter"):
        run_fuzz(CacheProtocolMachine.bind(lambda: None), examples=2, steps=2, seed=0)


@pytest.mark.parametrize("examples", [1, 20])
def test_a_refused_variant_stays_variant_refused(examples):
    machine = CacheProtocolMachine.bind(HiCacheAdapter, variants=[{}, {"devce_pages": 3}])
    with pytest.raises(VariantRefused, match="devce_pages"):
        run_fuzz(machine, examples=examples, steps=5, seed=0, shrink=False)


@pytest.mark.parametrize("command", ["check", "fuzz"])
def test_an_adapter_module_that_exits_at_import_is_a_usage_error_not_a_pass(tmp_path, command, capsys):
    """``sys.exit(0)`` while importing the adapter ended the command with status 0 and no output: a CI pass."""
    module = tmp_path / "exits.py"
    module.write_text("import sys\nsys.exit(0)\n")
    assert main([command, "--quiet", "--adapter", f"{module}:make"]) == 2
    assert "cannot import" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--max-jobs", "3"], ["--max-entries", "1"], ["--no-symmetry"]])
def test_block_store_flags_without_a_block_store_adapter_are_refused(argv, capsys):
    """``--max-jobs`` and ``--max-entries`` were taken and ignored (``--no-symmetry`` was refused)."""
    assert main(["check", "--quiet", "--max-depth", "1", *argv]) == 2
    assert "is for a block-store --adapter" in capsys.readouterr().err


def test_a_block_store_alphabet_beyond_the_prompt_bound_is_refused(capsys):
    """The prefix cache's bound on prompts per state now holds for block stores (10**30 overflowed)."""
    adapter = f"{Path(__file__).resolve().parents[1] / 'examples' / 'block_offload_manager.py'}:make_adapter"
    assert main(["check", "--quiet", "--adapter", adapter, "--max-depth", "1", "--alphabet", str(10**30)]) == 2
    assert "prompts to try in every state" in capsys.readouterr().err


def test_replaying_steps_reports_a_required_op_that_raises_not_supported():
    """``replay_steps`` (the regression tests' runner) skipped it: a do-nothing insert replayed clean."""
    from hicache_fsm.testing.checks import Step, replay_steps

    problems = replay_steps(InsertNotSupported(), [Step("insert", ((0, 1),))])
    assert problems and "NotSupported" in problems[0]


def test_a_failing_fuzz_counts_the_runs_to_its_failure_not_shrinkings_tries():
    """``examples`` counted every machine hypothesis built, the shrinker's included: 242 "runs" of 5."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tiny_lru_cache", HERE.parents[1] / "examples" / "tiny_lru_cache.py")
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    shrunk = run_fuzz(CacheProtocolMachine.bind(tiny.buggy_adapter), examples=5, steps=10, seed=0)
    found = run_fuzz(CacheProtocolMachine.bind(tiny.buggy_adapter), examples=5, steps=10, seed=0, shrink=False)
    assert not shrunk.ok and not found.ok
    assert shrunk.examples == found.examples <= 5
    assert len(shrunk.steps) <= len(found.steps)


def test_fuzz_refuses_a_later_variant_the_factory_cannot_build(capsys):
    """Only the first --variant is built to tell a block store from a cache; run_fuzz builds the others once."""
    argv = ["fuzz", "--quiet", "--examples", "2", "--adapter", "hicache_fsm.testing:HiCacheAdapter",
            "--variant", "{}", "--variant", '{"devce_pages": 3}']
    assert main(argv) == 2
    assert "devce_pages" in capsys.readouterr().err
