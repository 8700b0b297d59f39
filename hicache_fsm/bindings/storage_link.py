"""Guards, effects and invariants of the ``storage_link`` machine.

``obj`` is the ``StorageLink`` (backend handle and threads); ``ctx`` is the
``StorageTier`` that owns it, asked how many storage transfers are in flight.
"""

from __future__ import annotations

from hicache_fsm.registry import machine_registry

storage_link = machine_registry("storage_link")


@storage_link.guard
def nothing_in_flight(link, tier) -> bool:
    return tier.transfers_in_flight() == 0


@storage_link.guard
def threads_dead(link, tier) -> bool:
    return not link.threads_alive()


@storage_link.effect
def rollback_attach(link, tier) -> None:
    link.rollback()


@storage_link.effect
def signal_threads_stop(link, tier) -> None:
    link.signal_stop()


@storage_link.effect
def close_backend(link, tier) -> None:
    link.close_backend()


@storage_link.invariant
def no_transfer_while_detached(tier) -> list[str]:
    return tier.link_violations()
