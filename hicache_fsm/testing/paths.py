"""Model-based paths through each spec, and coverage of a fuzzing run.

Paths, in the style of XState's ``getShortestPaths``: for every spec, the
shortest sequence of transitions from the initial state that reaches each
state, and one that ends by firing each transition. ``spec_paths()`` returns
them all as ``SpecPath`` values with readable ids, ready for
``pytest.mark.parametrize(..., ids=str)``.

``run_path`` executes a path on the spec's *compiled* machine (and
optionally on the ``transitions`` reference interpreter) with *oracle*
bindings: each guard answers what the intended transition needs (true for its
``guards``, false for its ``unless`` and for guards it does not mention) and
each effect only records its name. The path therefore tests the spec and the
dispatch table themselves: a transition that cannot be selected, or two
candidates that both claim the same event, fails the path.

``CoverageTracker`` listens to compiled machines (``add_listener``) during a
fuzzing or exploration run and reports which states and transitions of each
spec were reached, and which were not.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable

import attrs

from hicache_fsm.machine import (
    CompiledMachine,
    ReferenceModel,
    compile_machine,
    reference_machine,
)
from hicache_fsm.registry import MachineRegistry
from hicache_fsm.spec import Spec, TransitionSpec, load_all

__all__ = [
    "CoverageTracker",
    "Edge",
    "SpecPath",
    "edges",
    "oracle_registry",
    "run_path",
    "shortest_paths",
    "spec_paths",
]


@attrs.frozen
class Edge:
    """One (trigger, source, dest) of a spec; a multi-source transition is one edge per source."""

    trigger: str
    source: str
    dest: str
    spec: TransitionSpec = attrs.field(eq=False, repr=False)

    def __str__(self) -> str:
        return f"{self.source} --{self.trigger}--> {self.dest}"


@attrs.frozen
class SpecPath:
    """A path from ``spec``'s initial state; ``goal`` is ``state:NAME`` or ``transition:EDGE``."""

    spec: Spec = attrs.field(eq=False, repr=False)
    goal: str
    steps: tuple[Edge, ...]

    @property
    def machine(self) -> str:
        return self.spec.name

    @property
    def final_state(self) -> str:
        return self.steps[-1].dest if self.steps else self.spec.initial

    def __str__(self) -> str:
        return f"{self.spec.name}:{self.goal}"


def edges(spec: Spec) -> list[Edge]:
    return [Edge(t.trigger, s, t.dest, t) for t in spec.transitions for s in t.sources]


def shortest_paths(spec: Spec) -> dict[str, tuple[Edge, ...]]:
    """BFS from the initial state: the shortest edge sequence reaching each reachable state."""
    out: dict[str, tuple[Edge, ...]] = {spec.initial: ()}
    by_source: dict[str, list[Edge]] = defaultdict(list)
    for e in edges(spec):
        by_source[e.source].append(e)
    queue = deque([spec.initial])
    while queue:
        state = queue.popleft()
        for e in by_source[state]:
            if e.dest not in out:
                out[e.dest] = out[state] + (e,)
                queue.append(e.dest)
    return out


def spec_paths(specs: Iterable[Spec] | None = None, *, states: bool = True, transitions: bool = True) -> list[SpecPath]:
    """For every spec: a path to each state and a path ending with each transition."""
    out = []
    for spec in specs if specs is not None else load_all():
        reach = shortest_paths(spec)
        if states:
            for name in spec.state_names:
                if name in reach:
                    out.append(SpecPath(spec, f"state:{name}", reach[name]))
        if transitions:
            seen = set()
            for e in edges(spec):
                key = (e.trigger, e.source, e.dest)
                if key in seen or e.source not in reach:
                    continue
                seen.add(key)
                out.append(SpecPath(spec, f"transition:{e}", reach[e.source] + (e,)))
    return out


# --------------------------------------------------------------------------- running a path


@attrs.define
class _PathObject:
    state: str
    effects: list[str] = attrs.Factory(list)


@attrs.frozen
class _Intent:
    """The ``ctx`` of an oracle step: the transition the path wants to take."""

    transition: TransitionSpec

    def answer(self, guard: str) -> bool:
        return guard in self.transition.guards


def oracle_registry(spec: Spec) -> MachineRegistry:
    """Guards answer what the intended transition (``ctx``) needs; effects record their name."""
    reg = MachineRegistry(spec.name)
    for g in spec.guard_names():
        reg.guards[g] = lambda obj, ctx, _g=g: ctx.answer(_g)
    for e in spec.effect_names():
        reg.effects[e] = lambda obj, ctx, _e=e: obj.effects.append(_e)
    return reg


def run_path(path: SpecPath, *, reference: bool = True, machine: CompiledMachine | None = None) -> list[str]:
    """Fire ``path`` on the compiled machine (and the ``transitions`` interpreter); the states visited.

    Raises ``AssertionError`` naming the step when a trigger lands elsewhere
    than the path says or an effect list differs from the spec.
    """
    spec = path.spec
    compiled = machine or compile_machine(spec, oracle_registry(spec))
    obj = _PathObject(spec.initial)
    visited = [obj.state]
    ref_model = None
    if reference:
        ref_model = ReferenceModel()
        reference_machine(spec, ref_model, oracle_registry(spec))
        ref_obj = _PathObject(spec.initial)
    for n, step in enumerate(path.steps):
        intent = _Intent(step.spec)
        before = len(obj.effects)
        taken = compiled.fire(obj, step.trigger, intent)
        where = f"{path}: step {n + 1} ({step})"
        assert obj.state == step.dest, f"{where}: compiled machine went to {obj.state}"
        assert taken.spec is step.spec, f"{where}: another transition claimed the event: {taken.spec.doc!r}"
        assert tuple(obj.effects[before:]) == step.spec.effects, f"{where}: effects {obj.effects[before:]}"
        if ref_model is not None:
            ok = ref_model.trigger(step.trigger, obj=ref_obj, ctx=intent)
            assert ok and ref_model.state == step.dest, f"{where}: transitions went to {ref_model.state}"
        visited.append(obj.state)
    return visited


# --------------------------------------------------------------------------- coverage


class CoverageTracker:
    """Which states and transitions of each spec a run reached.

    ``attach(machine)`` adds a listener to a ``CompiledMachine``; every fired
    transition is recorded as (trigger, source, dest). ``report()`` gives, per
    spec, counts and the missing states and transitions.
    """

    def __init__(self, specs: Iterable[Spec] | None = None) -> None:
        self.specs = {s.name: s for s in (specs if specs is not None else load_all())}
        self.states: dict[str, set[str]] = defaultdict(set)
        self.transitions: dict[str, set[tuple[str, str, str]]] = defaultdict(set)
        self.fired = 0
        self._attached: list[tuple[CompiledMachine, object]] = []

    def attach(self, machine: CompiledMachine) -> None:
        if any(m is machine for m, _ in self._attached):
            return
        name = machine.name
        self.states[name].add(machine.initial)

        def listener(obj, transition) -> None:
            self.fired += 1
            self.states[name].add(transition.source)
            self.states[name].add(transition.dest)
            self.transitions[name].add((transition.trigger, transition.source, transition.dest))

        machine.add_listener(listener)
        self._attached.append((machine, listener))

    def attach_all(self, machines: Iterable[CompiledMachine]) -> None:
        for m in machines:
            self.attach(m)

    def detach_all(self) -> None:
        for machine, listener in self._attached:
            try:
                machine.remove_listener(listener)
            except ValueError:
                pass
        self._attached.clear()

    def record(self, machine: str, trigger: str, source: str, dest: str) -> None:
        self.states[machine].update((source, dest))
        self.transitions[machine].add((trigger, source, dest))

    def merge(self, other: CoverageTracker) -> None:
        for name, s in other.states.items():
            self.states[name] |= s
        for name, t in other.transitions.items():
            self.transitions[name] |= t
        self.fired += other.fired

    def report(self, machines: Iterable[str] | None = None) -> dict[str, dict]:
        names = list(machines) if machines is not None else [n for n in self.specs if n in self.states]
        out = {}
        for name in names:
            spec = self.specs[name]
            all_edges = {(e.trigger, e.source, e.dest) for e in edges(spec)}
            hit_states = self.states.get(name, set()) & set(spec.state_names)
            hit_edges = self.transitions.get(name, set()) & all_edges
            out[name] = {
                "states": len(hit_states),
                "states_total": len(spec.state_names),
                "transitions": len(hit_edges),
                "transitions_total": len(all_edges),
                "missing_states": sorted(set(spec.state_names) - hit_states),
                "missing_transitions": sorted(f"{s} --{t}--> {d}" for t, s, d in all_edges - hit_edges),
            }
        return out

    def format(self, machines: Iterable[str] | None = None) -> str:
        lines = []
        for name, r in self.report(machines).items():
            lines.append(f"{name}: {r['states']}/{r['states_total']} states, "
                         f"{r['transitions']}/{r['transitions_total']} transitions")
            if r["missing_states"]:
                lines.append(f"  states not reached: {', '.join(r['missing_states'])}")
            if r["missing_transitions"]:
                lines.append(f"  transitions not fired: {'; '.join(r['missing_transitions'])}")
        return "\n".join(lines)
