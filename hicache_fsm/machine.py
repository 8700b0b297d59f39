"""Compile a validated spec into something that runs.

Two products come from one spec:

* ``CompiledMachine``: the hot path. A dict of dicts ``trigger -> state ->
  candidates`` whose guards and effects are already bound to Python callables.
  It acts on any object with a ``state`` attribute, so a cache with a million
  nodes needs no per-node machine (``transitions.Machine.add_model`` costs about
  120 us per object and grows with the model count).
* ``reference_machine``: a real ``transitions.Machine`` built from the same
  spec, used as the reference interpreter (tests prove the two agree), for
  introspection and as the baseline of the dispatch benchmark.

Callbacks handed to ``transitions`` are always callables, never strings: it
would resolve a dotted string by importing it, and spec text must never reach
an import.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import attrs
import transitions

from hicache_fsm.errors import BindingError, ConfigError, GuardRejected, InvalidTransition
from hicache_fsm.jobs import JobKind
from hicache_fsm.registry import Effect, Guard, MachineRegistry, registry_for
from hicache_fsm.spec import Spec, TransitionSpec

Listener = Callable[[object, "CompiledTransition"], None]


@attrs.frozen(slots=True, eq=False)
class CompiledTransition:
    """One (source, trigger) candidate with its guard check and effects bound."""

    trigger: str
    source: str
    dest: str
    check: Callable[[object, object], bool] | None
    effects: tuple[Effect, ...]
    emits: tuple[JobKind, ...]
    spec: TransitionSpec


def _bind_check(t: TransitionSpec, registry: MachineRegistry) -> Callable[[object, object], bool] | None:
    guards = tuple(registry.guards[g] for g in t.guards)
    unless = tuple(registry.guards[g] for g in t.unless)
    if not guards and not unless:
        return None
    if len(guards) == 1 and not unless:
        return guards[0]
    if len(unless) == 1 and not guards:
        only = unless[0]
        return lambda obj, ctx: not only(obj, ctx)

    def check(obj: object, ctx: object) -> bool:
        return all(g(obj, ctx) for g in guards) and not any(u(obj, ctx) for u in unless)

    return check


def _require_bound(spec: Spec, registry: MachineRegistry | None) -> MachineRegistry:
    if registry is None:
        raise BindingError(f"machine {spec.name!r} has no registry of guards and effects")
    missing = [g for g in spec.guard_names() if g not in registry.guards]
    missing += [e for e in spec.effect_names() if e not in registry.effects]
    if missing:
        raise BindingError(f"machine {spec.name!r}: no implementation for {', '.join(missing)}")
    return registry


def _entry(cands: tuple[CompiledTransition, ...]) -> tuple:
    if len(cands) == 1:
        c = cands[0]
        return (c.check, c.effects or None, c.dest, c, None)
    return (None, None, None, None, cands)


class CompiledMachine:
    """Fast dispatch of one spec over many objects that each carry ``state``."""

    def __init__(self, spec: Spec, registry: MachineRegistry | None = None) -> None:
        if not isinstance(spec, Spec):
            raise ConfigError(f"a machine compiles a Spec (load_builtin(name), load_spec(path)), "
                              f"got {type(spec).__name__}")
        self.spec = spec
        self.name = spec.name
        self.initial = spec.initial
        self.registry = _require_bound(spec, registry if registry is not None else registry_for(spec.name))
        table: dict[str, dict[str, list[CompiledTransition]]] = {}
        for t in spec.transitions:
            check = _bind_check(t, self.registry)
            effects = tuple(self.registry.effects[e] for e in t.effects)
            emits = tuple(JobKind(j) for j in t.emits)
            for source in t.sources:
                table.setdefault(t.trigger, {}).setdefault(source, []).append(
                    CompiledTransition(t.trigger, source, t.dest, check, effects, emits, t)
                )
        self._table: dict[str, dict[str, tuple[CompiledTransition, ...]]] = {
            trig: {state: tuple(cands) for state, cands in row.items()} for trig, row in table.items()
        }
        self._listeners: list[Listener] = []
        # The hot path reads one flat entry per (trigger, state):
        # (check, effects or None, dest, transition, None) for a lone candidate,
        # (None, None, None, None, candidates) when guards choose among several.
        self._entries: dict[str, dict[str, tuple]] = {
            trig: {state: _entry(cands) for state, cands in row.items()} for trig, row in self._table.items()
        }
        self.fire = self._make_fire()

    # ------------------------------------------------------------------ dispatch

    fire: Callable[..., CompiledTransition]
    """``fire(obj, trigger, ctx=None)``: check guards, run effects, move ``obj.state``.

    Returns the transition taken (its ``emits`` name the jobs to build).
    Raises ``InvalidTransition`` when the trigger is illegal in the state and
    ``GuardRejected`` when every guard said no; in both cases nothing changed.
    Installed per instance by ``_make_fire``: a closure over the tables skips
    the bound-method and attribute lookups of every call (a third of its cost).
    """

    def _make_fire(self) -> Callable[..., CompiledTransition]:
        entries = self._entries
        listeners = self._listeners
        name = self.name
        invalid = self._invalid

        def fire(obj: Any, trigger: str, ctx: object = None) -> CompiledTransition:
            try:
                check, effects, dest, cand, many = entries[trigger][obj.state]
            except KeyError:
                raise invalid(obj, trigger) from None
            if many is not None:
                for cand in many:
                    check = cand.check
                    if check is None or check(obj, ctx):
                        break
                else:
                    raise GuardRejected(name, obj.state, trigger, "every guard rejected it")
                effects, dest = cand.effects, cand.dest
            elif check is not None and not check(obj, ctx):
                raise GuardRejected(name, obj.state, trigger, "every guard rejected it")
            if effects:
                for effect in effects:
                    effect(obj, ctx)
            obj.state = dest
            if listeners:
                for listener in listeners:
                    listener(obj, cand)
            return cand

        fire.__name__ = fire.__qualname__ = "fire"
        return fire

    # The fast ``fire`` closes over this instance's tables and listener list, so
    # copies (copy, deepcopy, pickle) rebuild it over their own.
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("fire", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.fire = self._make_fire()

    def select(self, obj: Any, trigger: str, ctx: object = None) -> CompiledTransition | None:
        """The transition ``fire`` would take, or None; changes nothing."""
        row = self._table.get(trigger)
        if row is None:
            return None
        for cand in row.get(obj.state, ()):
            if cand.check is None or cand.check(obj, ctx):
                return cand
        return None

    def can_fire(self, obj: Any, trigger: str, ctx: object = None) -> bool:
        return self.select(obj, trigger, ctx) is not None

    def _invalid(self, obj: Any, trigger: str) -> InvalidTransition:
        state = getattr(obj, "state", None)
        if trigger not in self._table:
            return InvalidTransition(self.name, str(state), trigger, f"unknown trigger; known: {', '.join(self._table)}")
        allowed = ", ".join(self.triggers_from(str(state))) or "none (terminal)"
        return InvalidTransition(self.name, str(state), trigger, f"allowed here: {allowed}")

    # ------------------------------------------------------------------ introspection

    def triggers_from(self, state: str) -> list[str]:
        return [trig for trig, row in self._table.items() if state in row]

    def candidates(self, state: str, trigger: str) -> tuple[CompiledTransition, ...]:
        return self._table.get(trigger, {}).get(state, ())

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(obj, transition)`` after every fired transition (tracing, coverage)."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        self._listeners.remove(listener)


# --------------------------------------------------------------------------- reference interpreter


class ReferenceModel:
    """A model object for ``transitions``; records the effects and jobs of each step."""

    def __init__(self) -> None:
        self.state: str = ""
        self.emitted: list[JobKind] = []


def _event_guard(fn: Guard, negate: bool) -> Callable[[Any], bool]:
    def condition(event: Any) -> bool:
        result = bool(fn(event.kwargs.get("obj", event.model), event.kwargs.get("ctx")))
        return not result if negate else result

    return condition


def _event_effect(fn: Effect) -> Callable[[Any], None]:
    def before(event: Any) -> None:
        fn(event.kwargs.get("obj", event.model), event.kwargs.get("ctx"))

    return before


def _event_emit(kinds: tuple[JobKind, ...]) -> Callable[[Any], None]:
    def after(event: Any) -> None:
        event.model.emitted.extend(kinds)

    return after


def transitions_config(spec: Spec, registry: MachineRegistry | None = None) -> list[dict[str, Any]]:
    """The spec's transitions as ``transitions`` dicts, with callables only."""
    registry = _require_bound(spec, registry if registry is not None else registry_for(spec.name))
    out = []
    for t in spec.transitions:
        out.append(
            {
                "trigger": t.trigger,
                "source": list(t.sources),
                "dest": t.dest,
                "conditions": [_event_guard(registry.guards[g], False) for g in t.guards]
                + [_event_guard(registry.guards[g], True) for g in t.unless],
                "before": [_event_effect(registry.effects[e]) for e in t.effects],
                "after": [_event_emit(tuple(JobKind(j) for j in t.emits))] if t.emits else [],
            }
        )
    return out


def reference_machine(
    spec: Spec,
    models: Iterable[ReferenceModel] | ReferenceModel | None = None,
    registry: MachineRegistry | None = None,
) -> transitions.Machine:
    """A real ``transitions.Machine`` for the spec.

    Trigger it as ``model.trigger(name, obj=..., ctx=...)``: guards and effects
    see ``obj`` (defaulting to the model) and ``ctx`` exactly as in
    ``CompiledMachine.fire``. An illegal trigger raises ``transitions.MachineError``;
    a guard rejection returns False.
    """
    return transitions.Machine(
        model=models if models is not None else ReferenceModel(),
        states=list(spec.state_names),
        transitions=transitions_config(spec, registry),
        initial=spec.initial,
        auto_transitions=False,
        send_event=True,
        ignore_invalid_triggers=False,
    )


def compile_machine(spec: Spec, registry: MachineRegistry | None = None) -> CompiledMachine:
    return CompiledMachine(spec, registry)
