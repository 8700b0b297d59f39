"""Guards, effects and invariants of the ``prefetch`` machine.

``obj`` is a ``PrefetchOp``; ``ctx`` is the prefetch runtime that owns the
host slots, the anchor pin and the stop policy. Effects that release slots or
insert nodes delegate to the runtime, which does it exactly once per op.
"""

from __future__ import annotations

from hicache_fsm.registry import machine_registry

prefetch = machine_registry("prefetch")


@prefetch.guard
def hits_reach_threshold(op, rt) -> bool:
    return op.hit_tokens >= rt.threshold_tokens and op.hit_tokens > 0


@prefetch.guard
def all_pages_arrived(op, rt) -> bool:
    return op.completed_tokens >= op.hit_tokens


@prefetch.guard
def stop_policy_allows(op, rt) -> bool:
    return rt.stop_allowed(op)


@prefetch.effect
def trim_to_hits(op, rt) -> None:
    rt.trim_to_hits(op)


@prefetch.effect
def mark_terminated(op, rt) -> None:
    op.mark_terminated()


@prefetch.effect
def insert_fetched(op, rt) -> None:
    rt.insert_fetched(op)


@prefetch.effect
def release_unused(op, rt) -> None:
    rt.release_unused(op)


@prefetch.effect
def unpin_anchor(op, rt) -> None:
    rt.unpin_anchor(op)


@prefetch.invariant
def prefetch_slots_released_once(rt) -> list[str]:
    return rt.slot_release_violations()


@prefetch.invariant
def anchor_pinned_while_active(rt) -> list[str]:
    return rt.anchor_pin_violations()


@prefetch.invariant
def prefetch_capacity_respected(rt) -> list[str]:
    return rt.capacity_violations()
