"""The explorer's state key merges only states that behave alike (soundness of ``check``).

Twins are two states reached by different paths that share a key (the
explorer keeps one and drops the other). Driven by the same random steps,
twins must keep sharing a key and must produce the same observations (results,
refusals, the invariants that fire); otherwise the explorer may have dropped a
branch that goes somewhere else, and the failure names the key field that
missed the difference. Run over every default family of ``check``; token
renaming is off here (a renamed twin takes renamed steps), so twins are
concrete.
"""

from __future__ import annotations

import functools
import random
from collections import deque

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_fsm.testing.checks import catalogue, perform
from hicache_fsm.testing.explorer import Explorer, quiet_cache_logs
from hicache_fsm.testing.mutants import mutant
from hicache_fsm.testing.protocol import default_families
from hicache_fsm.testing.statekey import KEY_FIELDS, describe_difference

FAMILIES = [name for name, _, _ in default_families()]
TWIN_SEARCH_STATES = 150
TWINS = 6
STEPS = 6


def _concrete(factory):
    def make(bounds):
        adapter = factory(bounds)
        adapter.symmetric = False
        return adapter

    return make


@functools.cache
def twins(family: str) -> tuple:
    """(explorer, [(a, b), ...]): pairs of states with one key, reached by different paths."""
    [(bounds, factory)] = [(b, f) for n, b, f in default_families() if n == family]
    explorer = Explorer(_concrete(factory), attrs.evolve(bounds, max_states=None))
    with quiet_cache_logs():
        root = explorer.factory(explorer.bounds)
        seen = {root.state_key(): root}
        queue = deque([root])
        pairs = []
        while queue and len(seen) < TWIN_SEARCH_STATES and len(pairs) < TWINS:
            world = queue.popleft()
            for step in explorer.steps(world):
                child = world.clone()
                out = perform(child, step)
                if out.skipped or out.problems:
                    continue
                key = child.state_key()
                if key in seen:
                    if seen[key] is not world and len(pairs) < TWINS:
                        pairs.append((seen[key], child))
                    continue
                if child.size() <= explorer.bounds.nodes:
                    seen[key] = child
                    queue.append(child)
    return explorer, pairs


def _observe(out) -> tuple:
    """What a step shows the engine, without fresh ids (lock handles, request ids, node ids)."""
    return (out.skipped, out.rejected is not None, sorted({p.split(":")[0] for p in out.problems}),
            type(out.error).__name__ if out.error else None)


def _drive(explorer, a, b, seed: int) -> None:
    rng = random.Random(seed)
    a, b = a.clone(), b.clone()
    trail = []
    for _ in range(STEPS):
        steps = explorer.steps(a)
        assert [str(s) for s in steps] == [str(s) for s in explorer.steps(b)], \
            f"twins offer different steps after {trail}"
        if not steps:
            return
        step = rng.choice(steps)
        trail.append(str(step))
        out_a, out_b = perform(a, step), perform(b, step)
        if step.op in ("lock", "pin_host", "prefetch"):  # fresh handles: only whether one was given
            res_a, res_b = out_a.result is not None, out_b.result is not None
        else:
            res_a, res_b = out_a.result, out_b.result
        assert (_observe(out_a), res_a) == (_observe(out_b), res_b), f"twins answered {trail} differently"
        cat_a = sorted({p.split(":")[0] for p in catalogue(a, explorer.prompts)})
        cat_b = sorted({p.split(":")[0] for p in catalogue(b, explorer.prompts)})
        assert cat_a == cat_b, f"after {trail} the invariants differ: {cat_a} vs {cat_b}"
        if a.state_key() != b.state_key():
            fields = describe_difference(a.key_fields(), b.key_fields())
            pytest.fail(f"after {trail} twins no longer share a key: fields {fields} differ")


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=12, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**16))
def test_states_with_one_key_behave_alike(family, seed):
    explorer, pairs = twins(family)
    with quiet_cache_logs():
        for a, b in pairs:
            _drive(explorer, a, b, seed)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_default_family_has_twins_to_compare(family):
    """The property above is not vacuous: the explorer does merge states in every family."""
    _, pairs = twins(family)
    assert pairs


def test_key_fields_are_named():
    explorer, pairs = twins(FAMILIES[0])
    a, _ = pairs[0]
    assert set(a.key_fields()) == set(KEY_FIELDS)


def test_a_page_counted_but_never_written_is_a_different_state():
    """Issue 28's bug: a transfer one page short, counted complete, must not merge into the good branch,
    so ``check`` finds the damage at insertion within the ``storage/wait_complete`` family."""
    [(bounds, factory)] = [(b, f) for n, b, f in default_families() if n == "storage/wait_complete"]
    with mutant("prefetch_short_counted_complete"):
        result = Explorer(factory, bounds, stop_on_first=True).run()
    assert result.violations
    problems = " ".join(result.violations[0].problems)
    assert "kv_readback" in problems or "stored_means_stored" in problems
    assert len(result.violations[0].trace) <= 6
