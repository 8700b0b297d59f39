"""The explorer's reductions and narrowed families: what they remove is reported, and the families still
reach (and catch bugs in) what they are there for.

- token renaming: every state is counted once per distinct renaming of its token ids as well
  (``ExploreResult.raw_states``, ``check --json``'s ``"reductions"``), so the report says what it merged;
- ``Bounds.omit`` (a narrower action set) and ``Bounds.start`` (steps run before the search, at the head
  of every counterexample);
- ``memory/load_back_pressure`` (3 nodes, 3-page device) reaches load-backs refused for device room with
  a locked occupant and catches the locks they leak; ``storage/host_full`` catches a prefetch refused for
  host room that keeps its anchor locked.
"""

from __future__ import annotations

import pytest

from hicache_fsm.testing.checks import Step
from hicache_fsm.testing.explorer import Bounds, Explorer, explore, quiet_cache_logs
from hicache_fsm.testing.mutants import mutant
from hicache_fsm.testing.memory_families import pressure_family
from hicache_fsm.testing.protocol import default_families, protocol_factory


def _family(name: str):
    [(bounds, factory)] = [(b, f) for n, b, f in default_families() if n == name]
    return bounds, factory


def test_token_renaming_reports_the_states_it_merged():
    with quiet_cache_logs():
        r = explore(Bounds(nodes=2, device_pages=2, host_pages=2, max_depth=3), protocol_factory)
        concrete = Explorer(_no_renaming(protocol_factory), Bounds(nodes=2, device_pages=2, host_pages=2,
                                                                   max_depth=3)).run()
    red = r.to_json()["reductions"]["token_renaming"]
    assert red["states"] == r.states < red["without"]
    assert red["without"] == concrete.states  # exact from the empty cache: a search without renaming keeps these


def test_storage_families_rename_nothing():
    bounds, factory = _family("storage/host_full")
    with quiet_cache_logs():
        r = explore(bounds, factory)
    assert r.complete and not r.violations
    assert r.reductions()["token_renaming"] == {"states": r.states, "without": r.states}


def _no_renaming(factory):
    def make(bounds):
        adapter = factory(bounds)
        adapter.symmetric = False
        return adapter

    return make


def test_omitted_operations_are_never_tried():
    b = Bounds(nodes=2, device_pages=2, host_pages=2, omit=("match", "evict_host"), max_depth=2)
    explorer = Explorer(protocol_factory, b)
    adapter = protocol_factory(b)
    adapter.insert((1,))
    assert {s.op for s in explorer.steps(adapter)}.isdisjoint({"match", "evict_host"})
    assert {"insert", "lock", "evict"} <= {s.op for s in explorer.steps(adapter)}
    assert explorer.run().reductions()["omitted_ops"] == ["match", "evict_host"]


def test_start_steps_head_every_counterexample():
    start = (Step("insert", ((1,),)), Step("complete_job", (0,)))
    with quiet_cache_logs(), mutant("backup_keeps_lock"):
        r = explore(Bounds(nodes=2, device_pages=2, host_pages=2, start=(Step("insert", ((2,),)),), max_depth=2),
                    protocol_factory, stop_on_first=True)
        refused = explore(Bounds(nodes=2, device_pages=2, host_pages=2, start=start, max_depth=2), protocol_factory)
    assert r.violations and r.violations[0].trace[0] == Step("insert", ((2,),))
    assert "job_keeps_no_lock" in r.violations[0].problems[0]
    assert refused.violations and refused.violations[0].trace == start  # the start itself broke a check


def test_a_start_step_that_is_refused_is_reported():
    with quiet_cache_logs():
        r = explore(Bounds(nodes=2, device_pages=2, host_pages=2, start=(Step("unlock", (0,)),), max_depth=2),
                    protocol_factory)
    assert not r.complete and r.violations
    assert "start: step 1 unlock(#0) was skipped" in r.violations[0].problems[0]


def test_pressure_family_is_three_nodes_on_three_pages_and_deterministic():
    name, bounds, factory = pressure_family(protocol_factory)
    assert (bounds.nodes, bounds.device_pages) == (3, 3) and bounds.start
    with quiet_cache_logs():
        a, b = explore(bounds, factory), explore(bounds, factory)
    assert a.complete and not a.violations
    assert a.to_json() == b.to_json()


@pytest.mark.parametrize("name, family, steps", [
    ("lock_leak_on_refused_load_back", "memory/load_back_pressure", 6),
    ("failed_load_reported_done", "memory/load_back_pressure", 6),
    ("anchor_lock_leak_on_host_full", "storage/host_full", 2),
])
def test_narrow_families_catch_their_bugs(name, family, steps):
    bounds, factory = _family(family)
    with quiet_cache_logs(), mutant(name):
        r = explore(bounds, factory, stop_on_first=True)
    assert r.violations, f"{family} missed {name}"
    assert len(r.violations[0].trace) <= steps


def test_a_load_back_refused_with_a_locked_occupant_is_reached():
    """The scenario of the pressure family: its start, an occupant inserted and locked, the load-back
    refused for device room (replayed from the family's own start)."""
    from hicache_fsm.testing.checks import perform

    name, bounds, factory = pressure_family(protocol_factory)
    with quiet_cache_logs():
        adapter = factory(bounds)
        for step in bounds.start + (Step("insert", ((2, 2),)), Step("lock", ((2, 2),)), Step("load_back", ((1, 1),))):
            out = perform(adapter, step)
            assert not out.problems and out.rejected is None, (step, out)
    assert adapter.cache.counters["load_back_device_full"] == 1
    assert adapter.invariant_violations() == []
