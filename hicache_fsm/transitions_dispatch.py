"""Dispatch a spec through ``transitions`` itself, one model per object.

``TransitionsDispatcher`` offers the interface ``HiCache`` uses on its
residency machine (``fire / select / can_fire / spec / add_listener``) but
every trigger goes through a real ``transitions.Machine``: the first time an
object (a radix node) is seen, a model for it is added with ``add_model``,
exactly as an engine driving ``transitions`` directly would do, and every
``fire`` is ``model.trigger(name, obj=..., ctx=...)``. It exists as the
baseline of ``hicache-fsm bench controller`` and as a second interpreter
that tests can run the cache under; the hot path uses ``CompiledMachine``.

Guards, effects and emitted jobs are the spec's own, bound through
``machine.transitions_config``, so both dispatchers run the same logic.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import transitions

from hicache_fsm.errors import GuardRejected, InvalidTransition
from hicache_fsm.jobs import JobKind
from hicache_fsm.machine import CompiledMachine, reference_machine
from hicache_fsm.registry import MachineRegistry
from hicache_fsm.spec import Spec


@attrs.frozen(slots=True)
class FiredTransition:
    """What a fire did: the parts of ``CompiledTransition`` the cache reads."""

    trigger: str
    source: str
    dest: str
    emits: tuple[JobKind, ...]


class _Model:
    """The per-object ``transitions`` model; its ``state`` mirrors the object's."""

    def __init__(self, obj: object) -> None:
        self.obj = obj
        self.state = ""
        self.emitted: list[JobKind] = []


class TransitionsDispatcher:
    """``CompiledMachine``'s interface, dispatched by ``transitions.Machine`` with one model per object."""

    def __init__(self, spec: Spec, registry: MachineRegistry | None = None) -> None:
        self.spec = spec
        self.name = spec.name
        self.initial = spec.initial
        terminal = {s.name for s in spec.states if getattr(s, "terminal", False)}
        self._terminal = terminal
        self.machine = reference_machine(spec, [], registry)  # models are added per object, on first sight
        self._models: dict[int, _Model] = {}
        self._listeners: list[Callable[[object, Any], None]] = []
        # only for select(): which candidate a trigger would take (introspection, not dispatch)
        self._compiled = CompiledMachine(spec, registry)

    def _model(self, obj: Any) -> _Model:
        model = self._models.get(id(obj))
        if model is None or model.obj is not obj:
            model = _Model(obj)
            self.machine.add_model(model, initial=obj.state)
            self._models[id(obj)] = model
        elif model.state != obj.state:  # the object was moved outside the machine (e.g. copied on split)
            self.machine.set_state(obj.state, model=model)
        return model

    def fire(self, obj: Any, trigger: str, ctx: object = None) -> FiredTransition:
        model = self._model(obj)
        source = model.state
        model.emitted = []
        try:
            ok = model.trigger(trigger, obj=obj, ctx=ctx)
        except (transitions.MachineError, AttributeError) as exc:
            raise InvalidTransition(self.name, source, trigger, str(exc)) from None
        if not ok:
            raise GuardRejected(self.name, source, trigger, "every guard rejected it")
        obj.state = model.state
        fired = FiredTransition(trigger, source, model.state, tuple(model.emitted))
        for listener in self._listeners:
            listener(obj, fired)
        if model.state in self._terminal:
            self.machine.remove_model(model)
            del self._models[id(obj)]
        return fired

    def can_fire(self, obj: Any, trigger: str, ctx: object = None) -> bool:
        model = self._model(obj)
        try:
            return bool(model.may_trigger(trigger, obj=obj, ctx=ctx))
        except transitions.MachineError:
            return False

    def select(self, obj: Any, trigger: str, ctx: object = None):
        return self._compiled.select(obj, trigger, ctx) if self.can_fire(obj, trigger, ctx) else None

    def triggers_from(self, state: str) -> list[str]:
        return self._compiled.triggers_from(state)

    def candidates(self, state: str, trigger: str):
        return self._compiled.candidates(state, trigger)

    def add_listener(self, listener: Callable[[object, Any], None]) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[object, Any], None]) -> None:
        self._listeners.remove(listener)

    @property
    def model_count(self) -> int:
        return len(self._models)


__all__ = ["TransitionsDispatcher", "FiredTransition"]
