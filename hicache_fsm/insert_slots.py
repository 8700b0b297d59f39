"""Which pages of an insert are the cache's own: the matched part of the engine's slots against the tree's.

``insert`` takes the engine's slot indices for the whole prefix. For the part
already in the tree the engine may pass back the cache's own slots (as
``match_prefix`` returned them) or fresh ones (duplicates, freed); evicted
nodes are revived with the engine's. These helpers read the tree's side.
"""

from __future__ import annotations

from typing import Hashable

from hicache_fsm.eviction import RESIDENT
from hicache_fsm.radix import RadixTree, TreeNode
from hicache_fsm.slots import node_page_ids, page_ids
from hicache_fsm.tokens import TokenIds


def own_prefix(path: list[TreeNode], partial: int) -> bytes | None:
    """The packed device page ids of ``path`` when every node is resident in compact form (and no node
    matches in part), else None: then an engine passing the same pages back frees and revives nothing."""
    if partial:
        return None
    parts = []
    for node in path:
        slots = node.device_slots
        if type(slots) is not bytes or node.state not in RESIDENT:
            return None
        parts.append(slots)
    return b"".join(parts)


def own_pages(path: list[TreeNode], partial: int, tree: RadixTree, tokens: TokenIds, namespace: Hashable,
              matched: int) -> list[int | None]:
    """Per page of the matched part (a partly matched next node included): the cache's device page, or None."""
    ps = tree.page_size
    own: list[int | None] = []
    for node in path:
        if node.state in RESIDENT:
            own.extend(node_page_ids(node, ps))
        else:
            own.extend([None] * (node.num_tokens // ps))
    if partial:
        child = (path[-1] if path else tree.root).children[tree.child_key(namespace, tokens, matched)]
        if child.state in RESIDENT:
            own.extend(page_ids(child.device_indices[:partial], ps))
        else:
            own.extend([None] * (partial // ps))
    return own
