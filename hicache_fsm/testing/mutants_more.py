"""More planted controller bugs: eviction order, write_through retries, lock and slot bookkeeping.

Registered into ``testing.mutants.MUTANTS`` (which imports this module, never the other way round), so
``with mutant(name):`` and the sweep in the tests cover them like the others. Each entry is
``(name, bug, apply, variant)``; ``apply`` patches through the ``Patcher`` it is given, so the block's end
undoes it. Like the first set, each re-creates a mistake an engineer plausibly makes: a lookup that forgets
to refresh recency, a retry loop dropped, a slice off by one page.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

__all__ = ["MORE", "Planted", "hicache_class", "planter"]

Planted = tuple[str, str, Callable[[Any], None], dict]  # (name, bug, apply, variant)
MORE: list[Planted] = []


def planter(registry: list[Planted]) -> Callable[..., Callable[[Callable[[Any], None]], Callable[[Any], None]]]:
    """``@planter(registry)(name, bug, **variant)``: a decorator that records its ``apply`` in ``registry``."""
    def plant(name: str, bug: str, **variant: Any) -> Callable[[Callable[[Any], None]], Callable[[Any], None]]:
        def deco(fn: Callable[[Any], None]) -> Callable[[Any], None]:
            registry.append((name, bug, fn, dict(variant)))
            return fn

        return deco

    return plant


_more = planter(MORE)


def hicache_class() -> type:
    """``HiCache``, imported when a mutant is applied (this module is imported by the library's testing only)."""
    from hicache_fsm.cache import HiCache

    return HiCache


def _eviction() -> type:
    from hicache_fsm.eviction import Eviction

    return Eviction


def _driver() -> type:
    from hicache_fsm.residency_driver import ResidencyDriver

    return ResidencyDriver


# =========================================================================== eviction order


@_more("match_keeps_stale_recency", "a lookup that does not refresh recency (LRU evicts a prefix just used)")
def _stale_recency(p: Any) -> None:
    HiCache = hicache_class()
    orig = HiCache.match_prefix

    def match_prefix(self, tokens, namespace=None):
        before = {n.id: n.last_access for n in self.tree.nodes()}
        result = orig(self, tokens, namespace)
        for n in self.tree.nodes():
            if n.id in before:
                n.last_access = before[n.id]  # only nodes split off by this lookup keep a fresh stamp
        return result

    p.setattr(HiCache, "match_prefix", match_prefix)


@_more("evict_host_newest_first", "host eviction taking the most recently used leaf first (order inverted)")
def _host_newest_first(p: Any) -> None:
    Eviction = _eviction()

    def evict_host(self, num_tokens):
        freed = 0
        while freed < num_tokens:
            nodes = sorted(self.host.nodes(), key=self.sort_key, reverse=True)
            if not nodes:
                break
            freed += nodes[0].num_tokens
            self.driver.fire(nodes[0], "evict_host")
            self.driver.remove(nodes[0])
        self.counters["evicted_host_tokens"] += freed
        return freed

    p.setattr(Eviction, "evict_host", evict_host)


@_more("evict_host_count_off_by_one", "a host eviction reporting one page more than it freed")
def _host_count(p: Any) -> None:
    Eviction = _eviction()
    orig = Eviction.evict_host

    def evict_host(self, num_tokens):
        freed = orig(self, num_tokens)
        return freed + self.tree.page_size if freed else freed

    p.setattr(Eviction, "evict_host", evict_host)


# =========================================================================== policies


@_more("write_through_no_retry", "write_through never retrying a cached node whose earlier backup failed",
       write_policy="write_through")
def _no_retry(p: Any) -> None:
    """Insert backs up its new node only: a path node left device-only by a failed backup stays so for good."""
    HiCache, Eviction = hicache_class(), _eviction()
    orig_insert, orig_backup = HiCache.insert, Eviction.try_backup
    skip: set[int] = set()

    def insert(self, tokens, device_indices, namespace=None, priority=0):
        skip.update(n.id for n in self.tree.nodes() if n.state == "device")
        try:
            return orig_insert(self, tokens, device_indices, namespace, priority)
        finally:
            skip.clear()

    def try_backup(self, node):
        return False if node.id in skip else orig_backup(self, node)

    p.setattr(HiCache, "insert", insert)
    p.setattr(Eviction, "try_backup", try_backup)


# =========================================================================== locks and candidates


@_more("lock_leaf_only", "lock count not propagated to ancestors (a locked prefix's parent evictable)")
def _lock_leaf(p: Any) -> None:
    Eviction = _eviction()

    def lock_path(self, node):
        node.lock_ref += 1

    def unlock_path(self, node):
        node.lock_ref -= 1
        self.refresh(node)

    p.setattr(Eviction, "lock_path", lock_path)
    p.setattr(Eviction, "unlock_path", unlock_path)


@_more("evict_host_pinned", "host eviction ignoring host pins")
def _host_pinned(p: Any) -> None:
    Eviction = _eviction()
    orig = Eviction.refresh

    def refresh(self, node):
        orig(self, node)
        if node.parent is not None and node.state in ("host", "host_stored") and not node.children:
            self.host.add(node)

    p.setattr(Eviction, "refresh", refresh)


@_more("parent_evictable_while_child_loading", "a parent made a device candidate while a child is still loading")
def _parent_over_loading(p: Any) -> None:
    from hicache_fsm.eviction import RESIDENT

    Eviction = _eviction()
    orig = Eviction.refresh

    def refresh(self, node):
        orig(self, node)
        kids = node.children.values()
        if node.parent is not None and node.state == "device_host" and node.lock_ref == 0 \
                and all(c.state not in ("device", "device_host") for c in kids) \
                and any(c.state in RESIDENT for c in kids):
            self.device.add(node)  # only settled children counted

    p.setattr(Eviction, "refresh", refresh)


# =========================================================================== slots


@_more("host_freed_at_load_done", "host slots freed at the load ack while the node still references them")
def _host_freed_at_load(p: Any) -> None:
    Driver = _driver()
    orig = Driver.fire

    def fire(self, node, trigger, *a, **kw):
        t = orig(self, node, trigger, *a, **kw)
        if trigger == "load_done" and node.host_indices is not None:
            self.ctx.host_allocator.free(node.host_indices)
        return t

    p.setattr(Driver, "fire", fire)


@_more("revive_reversed_slots", "an evicted node revived with the engine's slots in the wrong order")
def _revive_reversed(p: Any) -> None:
    Driver = _driver()
    orig = Driver.fire

    def fire(self, node, trigger, *a, **kw):
        if trigger == "revive" and a:
            grant = a[0]
            field = attrs.fields(type(grant))[0].name
            a = (attrs.evolve(grant, **{field: getattr(grant, field).flip(0)}),) + a[1:]
        return orig(self, node, trigger, *a, **kw)

    p.setattr(Driver, "fire", fire)


@_more("split_host_off_by_one", "off-by-one page in the host slots at a node split")
def _split_host(p: Any) -> None:
    from hicache_fsm.radix import RadixTree

    split = RadixTree.split

    def split_(self, node, at):
        host = node.host_indices
        upper = split(self, node, at)
        if host is not None and host.numel() > at:
            node.host_indices = host[at - self.page_size: host.numel() - self.page_size]  # starts a page early
        return upper

    p.setattr(RadixTree, "split", split_)
