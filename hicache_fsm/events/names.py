"""The vocabulary of a spec's ``events:`` entries (no msgspec or zmq needed to read it).

A transition's ``events:`` lists what a KV-event subscriber (a router) must
learn when it is taken: ``stored:TIER`` when the node's pages become readable
in a tier, ``removed:TIER`` when they stop being readable there. Tiers are the
cache's own names; :data:`MEDIUMS` maps them onto the ``medium`` strings that
SGLang HiCache publishes to NVIDIA Dynamo's KV router (``GPU`` for L1,
``CPU_TIER1`` for host memory L2, ``CPU_TIER2`` for L3 storage).
"""

from __future__ import annotations

EVENT_KINDS = ("stored", "removed")
TIERS = ("device", "host", "storage")
MEDIUMS = {"device": "GPU", "host": "CPU_TIER1", "storage": "CPU_TIER2"}
TIER_OF_MEDIUM = {medium: tier for tier, medium in MEDIUMS.items()}


def parse_event(entry: str) -> tuple[str, str]:
    """``"stored:device"`` -> ``("stored", "device")``; ``ValueError`` naming what is wrong."""
    kind, sep, tier = entry.partition(":")
    if not sep:
        raise ValueError(f"event {entry!r} must be KIND:TIER (e.g. stored:device)")
    if kind not in EVENT_KINDS:
        raise ValueError(f"event kind {kind!r} is unknown; known: {', '.join(EVENT_KINDS)}")
    if tier not in TIERS:
        raise ValueError(f"event medium {tier!r} is unknown; known: {', '.join(TIERS)}")
    return kind, tier
