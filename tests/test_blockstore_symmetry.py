"""The block-store explorer's symmetry reduction merges only states that behave alike, up to the names of keys.

Twins are two states the explorer merged under one reduced key: a state and a
renaming of it (page ids swapped under some prefix), or two states with one plain
key. Driven by the same random steps, the second renamed as the reduction says,
twins must stay renamings of each other (the renamed first has the second's state
key) and report the same kinds of problems; otherwise the explorer may have
dropped a branch that goes somewhere else. Also: the reduction keeps verdicts and
shortest counterexamples, and an adapter that keeps keys in a form the toolkit
cannot rename gets the reduction turned off, with the reason.
"""

from __future__ import annotations

import functools
import json
import random
from collections import deque

import pytest
from example_util import load_example
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_fsm.cli import main
from hicache_fsm.testing.blockstore import BlockStoreAdapter, StoreBounds, StoreJob, StoreWorld, explore_store
from hicache_fsm.testing.blockstore.explorer import prompts_for
from hicache_fsm.testing.blockstore.symmetry import ReducedKeys, Symmetry

keyed = load_example("keyed_offload_manager.py")
VARIANTS = [{"policy": p, "store_threshold": t} for p in ("lru", "arc") for t in (1, 2)]
BOUNDS = StoreBounds(alphabet=2, max_len=2, max_depth=None)
TWIN_SEARCH_STATES = 250
TWINS = 8
STEPS = 8


def _ids(variant: dict) -> str:
    return f"{variant['policy']}-t{variant['store_threshold']}"


@functools.cache
def twins(policy: str, threshold: int) -> tuple:
    """(reduced keys, [(a, b), ...]): states merged under one reduced key, renamed twins first."""
    def factory():
        return keyed.make_adapter(policy=policy, store_threshold=threshold)

    prompts = prompts_for(BOUNDS)
    keys = ReducedKeys(Symmetry(prompts), factory)
    root = StoreWorld(factory(), factory)
    seen = {keys(root): root}
    queue, renamed, plain = deque([root]), [], []
    while queue and len(seen) < TWIN_SEARCH_STATES:
        world = queue.popleft()
        for step in world.steps(prompts, BOUNDS.max_jobs):
            child = world.clone()
            if child.do(*step):
                continue
            key = keys(child)
            if key not in seen:
                seen[key] = child
                queue.append(child)
            elif seen[key].key() != child.key():
                renamed.append((seen[key], child))
            elif seen[key] is not world:
                plain.append((seen[key], child))
    return keys, (renamed[:TWINS] + plain[: TWINS // 2])


def _relation(keys: ReducedKeys, a: StoreWorld, b: StoreWorld) -> dict:
    """Names in ``a`` -> names in ``b``: a's renaming to the reduced names, then b's back."""
    _, to_reduced = keys.reduce(a)
    _, b_to_reduced = keys.reduce(b)
    back = {new: old for old, new in (b_to_reduced or {}).items()}
    names = set(to_reduced or {}) | set(back)
    return {n: back.get((to_reduced or {}).get(n, n), (to_reduced or {}).get(n, n)) for n in names}


def _renamed_step(step: tuple, a: StoreWorld, b: StoreWorld, sigma: dict) -> tuple:
    op, *args = step
    if op == "complete":  # job ids are the adapter's: b's job copying the renamed keys
        kind, keys = a.model.jobs[args[0]]
        want = (kind, tuple(sigma.get(k, k) for k in keys))
        job = next(j for j, spec in b.model.jobs.items() if spec == want)
        return (op, job, args[1])
    return (op, *(tuple(sigma.get(k, k) for k in x) if isinstance(x, tuple) else x for x in args))


def _kinds(problems: list[str]) -> list[str]:
    return sorted({p.split(":")[0] for p in problems})


def _drive(keys: ReducedKeys, a: StoreWorld, b: StoreWorld, seed: int) -> None:
    rng = random.Random(seed)
    sigma = _relation(keys, a, b)
    a, b = a.clone(), b.clone()
    assert a.renamed(sigma).key() == b.key(), "merged states are not renamings of each other"
    trail = []
    prompts = prompts_for(BOUNDS)
    for _ in range(STEPS):
        step = rng.choice(a.steps(prompts, BOUNDS.max_jobs))
        other = _renamed_step(step, a, b, sigma)
        trail.append(f"{step} / {other}")
        assert _kinds(a.do(*step)) == _kinds(b.do(*other)), f"twins answered {trail} differently"
        assert _kinds(a.violations()) == _kinds(b.violations()), f"after {trail} the invariants differ"
        assert a.renamed(sigma).key() == b.key(), f"after {trail} the twins are no longer renamings"


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids)
@settings(max_examples=10, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**16))
def test_merged_states_behave_alike_up_to_names(variant, seed):
    keys, pairs = twins(variant["policy"], variant["store_threshold"])
    for a, b in pairs:
        _drive(keys, a, b, seed)


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids)
def test_every_variant_has_renamed_twins_to_compare(variant):
    """The property above is not vacuous: the reduction merges states whose plain keys differ."""
    _, pairs = twins(variant["policy"], variant["store_threshold"])
    assert any(a.key() != b.key() for a, b in pairs)


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids)
def test_the_reduction_keeps_the_verdict_and_removes_states(variant):
    bounds = StoreBounds(max_len=2, max_depth=6)
    on = explore_store(lambda: keyed.make_adapter(**variant), bounds)
    off = explore_store(lambda: keyed.make_adapter(**variant), StoreBounds(max_len=2, max_depth=6, symmetry=False))
    assert on.symmetry == "on" and off.symmetry == "off"
    assert on.complete and off.complete and not on.violations and not off.violations
    assert on.states < off.states and on.max_depth == off.max_depth
    assert on.states <= on.states_before_symmetry <= off.states


@pytest.mark.parametrize("bug", keyed.BUGS)
def test_counterexamples_stay_shortest(bug):
    on = explore_store(lambda: keyed.make_adapter(bug=bug), StoreBounds(), stop_on_first=True)
    off = explore_store(lambda: keyed.make_adapter(bug=bug), StoreBounds(symmetry=False), stop_on_first=True)
    assert on.violations and off.violations
    assert len(on.violations[0][1]) == len(off.violations[0][1])
    assert _kinds(list(on.violations[0][0])) == _kinds(list(off.violations[0][0]))


class NamedStore(BlockStoreAdapter):
    """Keeps keys as strings: a renamed copy cannot rename them, so the reduction must turn itself off."""

    name = "named_store"
    redelivery = "caller_guarantees_once"

    def __init__(self) -> None:
        self.held: dict[str, bool] = {}
        self.jobs: dict[int, tuple] = {}

    def lookup(self, keys):
        return next((i for i, k in enumerate(keys) if not self.held.get(str(k))), len(keys))

    def store(self, keys):
        new = tuple(k for k in keys if str(k) not in self.held)
        if not new:
            return StoreJob.nothing()
        if len(self.held) + len(new) > 2:
            return None
        for k in new:
            self.held[str(k)] = False
        job = max(self.jobs, default=0) + 1
        self.jobs[job] = new
        return StoreJob(job, new)

    def load(self, keys):
        return None

    def complete(self, job, ok):
        for k in self.jobs.pop(job.id):
            if ok:
                self.held[str(k)] = True
            else:
                del self.held[str(k)]


def test_an_adapter_that_hides_keys_gets_no_reduction():
    on = explore_store(NamedStore, StoreBounds(max_len=2, max_depth=4))
    off = explore_store(NamedStore, StoreBounds(max_len=2, max_depth=4, symmetry=False))
    assert on.symmetry.startswith("off: after ") and "cannot rename" in on.symmetry
    assert (on.states, on.transitions, on.complete) == (off.states, off.transitions, off.complete)


def test_check_reports_the_reduction(capsys):
    ref = f"{keyed.__file__}:make_adapter"
    assert main(["check", "--adapter", ref, "--max-depth", "4", "--quiet", "--json"]) == 0
    on = json.loads(capsys.readouterr().out)
    assert main(["check", "--adapter", ref, "--max-depth", "4", "--no-symmetry", "--quiet", "--json"]) == 0
    off = json.loads(capsys.readouterr().out)
    assert on["symmetry"] == "on" and off["symmetry"] == "off"
    assert on["complete"] and on["depth_bounded"] and on["states"] < on["states_before_symmetry"] <= off["states"]
