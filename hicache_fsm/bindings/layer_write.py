"""Guards, effects and invariants of the ``layer_write`` machine.

``obj`` is a node's ``LayerWrite`` record; ``ctx`` is a ``LayerEvent`` carrying
the runtime and, for ``submit_layer``, which layer of which model (target or
draft) just finished.
"""

from __future__ import annotations

from hicache_fsm.registry import machine_registry

layer_write = machine_registry("layer_write")


@layer_write.guard
def submits_copies(write, event) -> bool:
    """The rank copies the node layer by layer: it owns pages of it, or a rank group agrees its completions.

    A rank of a group that owns none submits empty copies, so its jobs line up
    with the other ranks' and a copy failed elsewhere fails its write too.
    """
    return write.owned_tokens > 0 or event.runtime.agreed


@layer_write.guard
def host_has_room(write, event) -> bool:
    return event.runtime.can_reserve(write)


@layer_write.guard
def layer_is_new(write, event) -> bool:
    return (event.source, event.layer) not in write.submitted


@layer_write.guard
def completes_all_layers(write, event) -> bool:
    pending = write.required_layers - write.submitted
    return pending <= {(event.source, event.layer)}


@layer_write.effect
def alloc_owned_slots(write, event) -> None:
    event.runtime.alloc_owned(write)


@layer_write.effect
def record_needed_slots(write, event) -> None:
    event.runtime.record_failure(write)


@layer_write.effect
def mark_layer_submitted(write, event) -> None:
    write.submitted = write.submitted | {(event.source, event.layer)}


@layer_write.invariant
def ack_exactly_once(rt) -> list[str]:
    return rt.ack_violations()


@layer_write.invariant
def owned_slots_only(rt) -> list[str]:
    return rt.ownership_violations()
