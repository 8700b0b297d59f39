"""The block-store profile (hicache_fsm.testing.blockstore) on the example offload manager.

The example's adapter stays under 100 lines; at default bounds the explorer
and the fuzzer each catch the three planted bugs and pass the correct store;
each contract the profile owns (reference model, slot accounting,
redelivery contracts, postconditions, job bound) fails when broken.
"""

from __future__ import annotations

import pytest
from example_util import EXAMPLES, load_example

from hicache_fsm.testing.adapter import Rejected
from hicache_fsm.testing.blockstore import StoreBounds, StoreWorld, chain, explore_store, run_store_fuzz

EXAMPLE = EXAMPLES / "block_offload_manager.py"
BUGS = ("evict_loading", "failed_store_leak", "ready_before_ack")


@pytest.fixture(scope="module")
def offload():
    return load_example("block_offload_manager.py")


def test_adapter_is_under_100_lines(offload):
    lines = EXAMPLE.read_text().splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("class OffloadAdapter"))
    assert len(lines) - start < 100


@pytest.mark.parametrize("bug", BUGS)
def test_explorer_and_fuzzer_catch_each_planted_bug(offload, bug):
    result = explore_store(lambda: offload.make_adapter(bug=bug), StoreBounds(), stop_on_first=True)
    assert result.violations, bug
    fuzz = run_store_fuzz(offload.make_adapter, variants=[{"bug": bug}], examples=100, shrink=False)
    assert not fuzz.ok, bug


def test_correct_store_passes_a_complete_exploration(offload):
    result = explore_store(offload.make_adapter, StoreBounds(max_len=2))
    assert result.complete and not result.violations and result.states > 100
    assert run_store_fuzz(offload.make_adapter, examples=30, shrink=False).ok


def test_job_bound_limits_jobs_in_flight(offload):
    small = explore_store(offload.make_adapter, StoreBounds(max_len=2, max_jobs=1))
    big = explore_store(offload.make_adapter, StoreBounds(max_len=2, max_jobs=2))
    assert small.complete and small.states < big.states


def _world(offload, **kw):
    world = StoreWorld(offload.make_adapter(**kw))
    return world, chain([0])


def test_unreported_eviction_is_caught(offload):
    world, keys = _world(offload)
    assert not world.do("store", keys)
    job = next(iter(world.model.jobs))
    assert not world.do("complete", job, True)
    world.adapter.manager.blocks.clear()  # gone without a report
    world.adapter.manager.free = [0, 1]
    problems = world.do("lookup", keys)
    assert any(p.startswith("lookup:") for p in problems)


@pytest.mark.parametrize("contract, raises, expect", [
    ("reject", False, "accepted again"), ("idempotent", True, "was refused"), ("reject", True, None),
    ("idempotent", False, None)])
def test_redelivery_contracts(offload, contract, raises, expect):
    world, keys = _world(offload)
    adapter = world.adapter
    adapter.redelivery = contract
    original = type(adapter).complete

    def complete(job, ok):
        if job.id not in adapter.jobs:
            if raises:
                raise Rejected("unknown job")
            return None
        return original(adapter, job, ok)

    adapter.complete = complete
    world.do("store", keys)
    world.do("complete", next(iter(world.model.jobs)), True)
    problems = world.do("redeliver")
    assert (expect is None and not problems) or any(expect in p for p in problems)


def test_postconditions_are_reported(offload):
    world, keys = _world(offload)
    world.adapter.postconditions = lambda op, args, result: ["lookups must hit"] if op == "lookup" and not result else []
    assert world.do("lookup", keys) == ["postcondition: lookups must hit"]


def test_cli_check_and_fuzz_take_the_adapter_and_a_variant(offload, capsys):
    from hicache_fsm.cli import main

    ref = f"{EXAMPLE}:make_adapter"
    assert main(["check", "--adapter", ref, "--variant", '{"bug": "ready_before_ack"}', "--quiet",
                 "--stop-on-first"]) == 1
    assert "reported readable" in capsys.readouterr().out
    assert main(["fuzz", "--adapter", ref, "--variant", '{"bug": "failed_store_leak"}', "--quiet",
                 "--no-shrink"]) == 1
    assert "slots leaked" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["fuzz", "--adapter", ref, "--variant", "[1]"])
    assert exc.value.code == 2
    assert main(["fuzz", "--variant", "{}"]) == 2 and main(["check", "--variant", "{}"]) == 2


@pytest.mark.parametrize("variants", [{"num_blocks": 2}, ["num_blocks"], []])
def test_store_variants_of_the_wrong_shape_are_refused(variants):
    from hicache_fsm.errors import ConfigError
    from hicache_fsm.testing.blockstore.machine import store_machine

    with pytest.raises(ConfigError, match="non-empty list of dicts"):  # each failed inside a run before
        store_machine(lambda **kw: None, variants=variants)
