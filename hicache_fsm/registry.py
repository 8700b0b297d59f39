"""The explicit registry that binds names used in specs to Python.

Specs name guards, effects and invariants; this registry is the only place
those names meet code. Binding modules register plain functions with the
decorators below; loading a spec checks every name against the registry and
never imports anything a spec mentions.

Signatures:
- guard ``(obj, ctx) -> bool``: may the transition fire? Must not change anything.
- effect ``(obj, ctx) -> None``: runs after every guard passed, before the state
  changes; must not fail once its guards passed (that keeps rejection
  transactional).
- invariant ``(ctx) -> list[str]``: violations found in a runtime ``ctx``.
"""

from __future__ import annotations

import importlib
from typing import Callable

Guard = Callable[[object, object], bool]
Effect = Callable[[object, object], None]
Invariant = Callable[[object], list[str]]


class MachineRegistry:
    """Named guards, effects and invariants for one machine."""

    def __init__(self, machine: str) -> None:
        self.machine = machine
        self.guards: dict[str, Guard] = {}
        self.effects: dict[str, Effect] = {}
        self.invariants: dict[str, Invariant] = {}

    def _add(self, table: dict, fn: Callable, kind: str) -> Callable:
        name = fn.__name__
        if name in table:
            raise ValueError(f"{self.machine}: {kind} {name!r} registered twice")
        table[name] = fn
        return fn

    def guard(self, fn: Guard) -> Guard:
        return self._add(self.guards, fn, "guard")

    def effect(self, fn: Effect) -> Effect:
        return self._add(self.effects, fn, "effect")

    def invariant(self, fn: Invariant) -> Invariant:
        return self._add(self.invariants, fn, "invariant")


REGISTRIES: dict[str, MachineRegistry] = {}

# Our own binding modules; a fixed list, never derived from spec text.
_BINDING_MODULES = (
    "hicache_fsm.bindings.residency",
    "hicache_fsm.bindings.prefetch",
    "hicache_fsm.bindings.layer_write",
    "hicache_fsm.bindings.storage_link",
)
_loaded = False


def machine_registry(machine: str) -> MachineRegistry:
    """Create (once) and return the registry a binding module fills."""
    if machine not in REGISTRIES:
        REGISTRIES[machine] = MachineRegistry(machine)
    return REGISTRIES[machine]


def registry_for(machine: str) -> MachineRegistry | None:
    """The registry of one of the library's machines, or None for an unknown name."""
    global _loaded
    if not _loaded:
        for module in _BINDING_MODULES:
            importlib.import_module(module)
        _loaded = True
    return REGISTRIES.get(machine)
