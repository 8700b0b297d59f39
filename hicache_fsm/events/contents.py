"""What a cache holds per tier, as int64 block hashes, read from its tree (not from events).

The reference a router's event-built index is checked against: each node's
page keys are hashed afresh top-down, and counted in every tier its state's
tags make readable (``on_device``, ``on_host``). Storage is left out: L3
copies outlive the nodes (a removed node's pages stay in L3), so the tree
does not say what L3 holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache_fsm.events.hashes import int64_hash
from hicache_fsm.events.hook import TIER_TAGS
from hicache_fsm.storage.keys import page_keys
from hicache_fsm.storage.tier import namespace_seed

if TYPE_CHECKING:
    from hicache_fsm.cache import HiCache

MEMORY_TIERS = ("device", "host")


def cache_contents(cache: "HiCache") -> dict[str, set[int]]:
    """Tier (``device``, ``host``) -> the block hashes readable there now."""
    out: dict[str, set[int]] = {tier: set() for tier in MEMORY_TIERS}
    tags = {s.name: s.tags for s in cache.driver.machine.spec.states}
    ps = cache.page_size
    stack = [(child, namespace_seed(child.namespace)) for child in cache.tree.root.children.values()]
    while stack:
        node, prior = stack.pop()
        keys = page_keys(node.key, ps, prior)
        state_tags = tags.get(node.state, frozenset())
        for tier in MEMORY_TIERS:
            if TIER_TAGS[tier] in state_tags:
                out[tier].update(int64_hash(k) for k in keys)
        stack.extend((child, keys[-1]) for child in node.children.values())
    return out
