"""The compiled dispatch table and the `transitions` reference machine agree.

For every spec, every (state, trigger) pair and every assignment of outcomes to
the guards involved (all 2^k), three interpreters must give the same answer:
the spec read literally (first listed transition whose guards hold), the
``CompiledMachine`` table and a real ``transitions.Machine``. They agree on
whether the trigger fires, is rejected by guards or is illegal; on the
destination; on the effects run, in order; and on the jobs emitted. Guards and
effects come from a test registry built from the spec's own names: guards read
a dict of outcomes, effects record their names.
"""

from __future__ import annotations

import copy
import itertools
from types import SimpleNamespace

import pytest
import transitions
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_fsm.errors import GuardRejected, InvalidTransition
from hicache_fsm.jobs import JobKind
from hicache_fsm.machine import CompiledMachine, ReferenceModel, reference_machine
from hicache_fsm.registry import MachineRegistry
from hicache_fsm.spec import Spec, load_all

SPECS = load_all()
SPEC_IDS = [s.name for s in SPECS]


class Ctx:
    """What guards and effects see: the guard outcomes to return, and a log of calls."""

    def __init__(self, outcomes: dict[str, bool]) -> None:
        self.outcomes = outcomes
        self.effects: list[str] = []
        self.guards_called: list[str] = []


def outcome_registry(spec: Spec) -> MachineRegistry:
    registry = MachineRegistry(spec.name)

    def make_guard(name):
        def guard(obj, ctx):
            ctx.guards_called.append(name)
            return ctx.outcomes[name]

        guard.__name__ = name
        return guard

    def make_effect(name):
        def effect(obj, ctx):
            ctx.effects.append(name)

        effect.__name__ = name
        return effect

    for g in spec.guard_names():
        registry.guard(make_guard(g))
    for e in spec.effect_names():
        registry.effect(make_effect(e))
    return registry


def involved_guards(spec: Spec, state: str, trigger: str) -> list[str]:
    return list(dict.fromkeys(g for t in spec.transitions_from(state, trigger) for g in (*t.guards, *t.unless)))


def outcome_assignments(guards: list[str]):
    for values in itertools.product((False, True), repeat=len(guards)):
        yield dict(zip(guards, values))


def by_the_spec(spec: Spec, state: str, trigger: str, outcomes: dict[str, bool]):
    """What the spec says, read literally."""
    candidates = spec.transitions_from(state, trigger)
    if not candidates:
        return ("invalid",)
    for t in candidates:
        if all(outcomes[g] for g in t.guards) and not any(outcomes[u] for u in t.unless):
            return ("fired", t.dest, tuple(t.effects), tuple(JobKind(j) for j in t.emits))
    return ("rejected",)


def by_compiled(machine: CompiledMachine, state: str, trigger: str, outcomes: dict[str, bool]):
    obj = SimpleNamespace(state=state, payload=[1, 2])
    ctx = Ctx(outcomes)
    before = dict(vars(obj))
    try:
        taken = machine.fire(obj, trigger, ctx)
    except GuardRejected as err:
        assert vars(obj) == before and not ctx.effects, "a rejected trigger changed something"
        assert (err.machine, err.state, err.trigger) == (machine.name, state, trigger)
        return ("rejected",)
    except InvalidTransition as err:
        assert vars(obj) == before and not ctx.effects and not ctx.guards_called
        assert (err.machine, err.state, err.trigger) == (machine.name, state, trigger)
        text = str(err)
        assert machine.name in text and repr(state) in text and repr(trigger) in text
        return ("invalid",)
    assert obj.state == taken.dest
    return ("fired", obj.state, tuple(ctx.effects), tuple(taken.emits))


def by_reference(machine: transitions.Machine, model: ReferenceModel, state: str, trigger: str, outcomes):
    machine.set_state(state, model=model)
    model.emitted.clear()
    ctx = Ctx(outcomes)
    try:
        fired = model.trigger(trigger, ctx=ctx)
    except transitions.MachineError:
        assert model.state == state and not ctx.effects
        return ("invalid",)
    if not fired:
        assert model.state == state and not ctx.effects and not model.emitted
        return ("rejected",)
    return ("fired", model.state, tuple(ctx.effects), tuple(model.emitted))


@pytest.fixture(scope="module", params=SPECS, ids=SPEC_IDS)
def triple(request):
    spec = request.param
    registry = outcome_registry(spec)
    model = ReferenceModel()
    return spec, CompiledMachine(spec, registry), reference_machine(spec, model, registry), model


def test_every_state_trigger_and_guard_outcome_agrees(triple):
    spec, compiled, reference, model = triple
    checked = 0
    for state in spec.state_names:
        for trigger in spec.triggers:
            for outcomes in outcome_assignments(involved_guards(spec, state, trigger)):
                want = by_the_spec(spec, state, trigger, outcomes)
                got_compiled = by_compiled(compiled, state, trigger, outcomes)
                got_reference = by_reference(reference, model, state, trigger, outcomes)
                where = f"{spec.name}: ({state}, {trigger}) with guards {outcomes}"
                assert got_compiled == want, f"compiled table disagrees with the spec at {where}"
                assert got_reference == want, f"transitions disagrees with the spec at {where}"
                checked += 1
    assert checked >= len(spec.state_names) * len(spec.triggers)


def test_select_agrees_with_fire_and_changes_nothing(triple):
    spec, compiled, _, _ = triple
    for state in spec.state_names:
        for trigger in spec.triggers:
            for outcomes in outcome_assignments(involved_guards(spec, state, trigger)):
                obj, ctx = SimpleNamespace(state=state), Ctx(outcomes)
                chosen = compiled.select(obj, trigger, ctx)
                assert obj.state == state and not ctx.effects
                assert compiled.can_fire(obj, trigger, Ctx(outcomes)) == (chosen is not None)
                want = by_the_spec(spec, state, trigger, outcomes)
                assert (chosen.dest if chosen else None) == (want[1] if want[0] == "fired" else None)


def test_unknown_trigger_is_invalid_and_names_everything(triple):
    spec, compiled, _, _ = triple
    obj = SimpleNamespace(state=spec.initial)
    with pytest.raises(InvalidTransition) as info:
        compiled.fire(obj, "no_such_trigger", Ctx({}))
    err = info.value
    assert not isinstance(err, GuardRejected)
    assert (err.machine, err.state, err.trigger) == (spec.name, spec.initial, "no_such_trigger")
    assert spec.name in str(err) and "unknown trigger" in str(err)
    assert obj.state == spec.initial


def test_illegal_trigger_message_lists_what_is_allowed(triple):
    spec, compiled, _, _ = triple
    for state in spec.state_names:
        legal = set(compiled.triggers_from(state))
        assert legal == {t.trigger for t in spec.transitions if state in t.sources}
        for trigger in set(spec.triggers) - legal:
            with pytest.raises(InvalidTransition, match="allowed here") as info:
                compiled.fire(SimpleNamespace(state=state), trigger, Ctx({}))
            assert not isinstance(info.value, GuardRejected)


def test_listeners_see_each_fired_transition_and_not_rejections(triple):
    spec, compiled, _, _ = triple
    seen = []

    def listener(obj, taken):
        seen.append((taken.source, taken.trigger, taken.dest))

    compiled.add_listener(listener)
    try:
        for t in spec.transitions:
            for source in t.sources:
                outcomes = {g: g in t.guards for g in involved_guards(spec, source, t.trigger)}
                obj = SimpleNamespace(state=source)
                want = by_the_spec(spec, source, t.trigger, outcomes)
                compiled.fire(obj, t.trigger, Ctx(outcomes))
                assert seen[-1] == (source, t.trigger, want[1])
        count = len(seen)
        for state in spec.state_names:
            for trigger in spec.triggers:
                guards = involved_guards(spec, state, trigger)
                for outcomes in outcome_assignments(guards):
                    if by_the_spec(spec, state, trigger, outcomes)[0] != "fired":
                        with pytest.raises(InvalidTransition):
                            compiled.fire(SimpleNamespace(state=state), trigger, Ctx(outcomes))
        assert len(seen) == count
    finally:
        compiled.remove_listener(listener)


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_random_walks_agree(spec, data):
    """Walk both machines through the same random triggers and guard outcomes, step by step."""
    registry = outcome_registry(spec)
    compiled = CompiledMachine(spec, registry)
    model = ReferenceModel()
    reference_machine(spec, model, registry)  # gives ``model`` its triggers and state
    obj = SimpleNamespace(state=spec.initial)
    guards = list(spec.guard_names())
    for _ in range(data.draw(st.integers(1, 25), label="steps")):
        trigger = data.draw(st.sampled_from(spec.triggers), label="trigger")
        outcomes = {g: data.draw(st.booleans(), label=g) for g in guards}
        ctx_c, ctx_r = Ctx(outcomes), Ctx(outcomes)
        model.emitted.clear()
        try:
            taken = compiled.fire(obj, trigger, ctx_c)
            got_c = ("fired", obj.state, tuple(ctx_c.effects), tuple(taken.emits))
        except GuardRejected:
            got_c = ("rejected",)
        except InvalidTransition:
            got_c = ("invalid",)
        try:
            fired = model.trigger(trigger, ctx=ctx_r)
            got_r = ("fired", model.state, tuple(ctx_r.effects), tuple(model.emitted)) if fired else ("rejected",)
        except transitions.MachineError:
            got_r = ("invalid",)
        assert got_c == got_r
        assert obj.state == model.state


@pytest.mark.parametrize("copier", [copy.copy, copy.deepcopy], ids=["copy", "deepcopy"])
def test_copies_dispatch_through_their_own_tables_and_listeners(copier):
    spec = SPECS[0]
    original = CompiledMachine(spec, outcome_registry(spec))
    clone = copier(original)
    seen_original, seen_clone = [], []
    original.add_listener(lambda obj, t: seen_original.append(t.trigger))
    clone.add_listener(lambda obj, t: seen_clone.append(t.trigger))
    t = next(t for t in spec.transitions if spec.initial in t.sources)
    outcomes = {g: g in t.guards for g in involved_guards(spec, spec.initial, t.trigger)}
    clone.fire(SimpleNamespace(state=spec.initial), t.trigger, Ctx(outcomes))
    if copier is copy.deepcopy:
        assert seen_clone == [t.trigger] and seen_original == []
    else:  # a shallow copy shares the listener list, as shallow copies do
        assert seen_clone == [t.trigger] and seen_original == [t.trigger]
