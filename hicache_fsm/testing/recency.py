"""An independent record of how each cached node was used, to judge the eviction order by.

Why. The eviction policy (LRU, LFU; priority: lower priority first, ties by recency) is the
cache's promise about *which* entries go first, and the cache's own candidate
sets are checked only against its own keys (``last_access``, ``hit_count``): a
match that forgets to refresh recency, a split whose new half starts cold, an
insert counted as a hit all keep those sets consistent and evict the wrong
entry. ``UseLog`` keeps the engine's view instead: per live node, how many
lookups covered it since it entered the tree and which operation used it last,
counted by the adapter from the operations it ran (``insert`` uses a prompt's
whole path and raises each node's priority to the insert's, never lowers it;
``match``, ``lock``, ``load_back`` and ``prefetch`` look it up, which also
counts a hit). A node split in two gives its record to both halves;
a node the cache made by itself (a prefetch's insertion) has no record and is
never judged.

``order_problems`` compares an eviction's victims with the candidates it left:
no victim may have been used more recently (LFU: more often, then more
recently; priority: with a higher priority, then more recently) than a
candidate that stayed. ``rank_key`` lists where the records disagree with the
cache's own eviction order, and the nodes whose priority the cache holds
otherwise than the records, for the explorer's state key: a cache whose order
went wrong must not be merged into one where it is right.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = ["UseLog", "UseLogListener"]

Use = tuple[int, int, int]  # (hits since it entered the tree, the operation that used it last, its priority)


class UseLog:
    """Per live node id, its ``Use`` as the engine's operations imply it (``None``: made by the cache itself)."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.clock = 0
        self.uses: dict[int, Use | None] = {}

    def copy(self) -> UseLog:
        new = UseLog(self.policy)
        new.clock, new.uses = self.clock, dict(self.uses)
        return new

    def order(self, use: Use) -> tuple[int, ...]:
        """What the policy ranks by: hits then recency (LFU), priority then recency (priority), or recency."""
        if self.policy == "lfu":
            return use[:2]
        return (use[2], use[1]) if self.policy == "priority" else (use[1],)

    def sync(self, nodes: Iterable[Any]) -> None:
        """Forget nodes that left the tree; a node that entered it with no record is the cache's own (a split's
        upper half got its record as the split happened: ``split``)."""
        live = {n.id for n in nodes if n.parent is not None}
        uses = {i: u for i, u in self.uses.items() if i in live}
        for nid in live - uses.keys():
            uses[nid] = None
        self.uses = uses

    def split(self, node_id: int, upper_id: int) -> None:
        """Node ``node_id`` was split: its new upper half takes its record (both halves were used alike; None
        for a node the cache made, even one not synced yet). Told as the split happens, since the lower half
        may leave the tree before the operation ends (a host eviction for room), its record with it."""
        self.uses[upper_id] = self.uses.get(node_id)

    def knows(self, node_id: int) -> bool:
        """Whether ``node_id`` has a record (None included): one that entered the tree since the last ``sync``
        without a split has none."""
        return node_id in self.uses

    def forget_all(self) -> None:
        """Every node left the tree at once (a reset: ids start again from 1)."""
        self.uses.clear()

    def used(self, path: Sequence[Any], *, hit: bool, new: set[int] | frozenset[int] = frozenset(),
             priority: int = 0) -> None:
        """One operation used ``path`` (a lookup when ``hit``; an insert at ``priority`` otherwise); ids in
        ``new`` entered the tree with it."""
        self.clock += 1
        for node in path:
            use = (0, 0, priority) if node.id in new else self.uses.get(node.id)
            if use is not None:
                self.uses[node.id] = (use[0] + hit, self.clock, max(use[2], priority))

    def rank_key(self, ranked: Sequence[Any]) -> tuple:
        """The pairs of ``ranked`` (the cache's eviction order, by position) whose records order them the other
        way, then the positions whose recorded priority the cache's node lacks: empty while they agree, so a
        correct cache's states are not split by the records."""
        keys = [self.uses.get(n.id) for n in ranked]
        pairs = tuple((i, j) for i, a in enumerate(keys) for j in range(i + 1, len(keys))
                      if a is not None and keys[j] is not None and self.order(keys[j]) < self.order(a))
        return pairs, tuple(i for i, (n, u) in enumerate(zip(ranked, keys)) if u is not None and u[2] != n.priority)

    def order_problems(self, tier: str, victims: Iterable[Any], stayed: Iterable[Any],
                       describe: Callable[[Any], str]) -> list[str]:
        """``policy_eviction_order``: no victim was used later (LFU: more) than a candidate left in place."""
        stayed = [(self.uses.get(n.id), n) for n in stayed]
        problems = []
        for v in victims:
            vu = self.uses.get(v.id)
            if vu is None:
                continue
            for su, s in stayed:
                if su is not None and self.order(su) < self.order(vu):
                    problems.append(f"policy_eviction_order: {self.policy} {tier} eviction took {describe(v)} "
                                    f"(hits, last use {vu}) before {describe(s)} ({su}), which stayed")
                    break
        return problems


class UseLogListener:
    """A residency listener that tells its owner's ``UseLog`` (``owner.uses``, read at each call: a reset or a
    fork replaces it) of every split as it happens, and of a reset, so that a live node without a record is
    one that entered the tree since the last ``sync``."""

    __slots__ = ("owner",)

    def __init__(self, owner: Any) -> None:
        self.owner = owner

    def split(self, node: Any, upper: Any) -> None:
        self.owner.uses.split(node.id, upper.id)

    def state_changed(self, node: Any, old: str) -> None:
        pass

    def removed(self, node: Any, parent: Any) -> None:
        pass  # its record stays until the next ``sync``: an eviction's order is judged on its victims' records

    def cleared(self) -> None:
        self.owner.uses.forget_all()  # node ids start again from 1
