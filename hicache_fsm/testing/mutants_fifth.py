"""The fifth set of planted controller bugs: thresholds and budgets a default config leaves at rest.

``eviction_headroom_tokens``, ``load_back_threshold`` / ``load_back_max_tokens``, ``write_behind_batch_tokens``
/ ``write_behind_idle_steps`` and ``write_through_threshold`` (``CacheConfig``), and the storage tier's
``prefetch_threshold``, ``prefetch_capacity_tokens`` and ``batch_pages`` (``TierOptions``) each change what the
cache owes only when set away from their defaults, so a bug in reading one passed every family until the
``check`` families of ``testing.memory_families.option_families`` and ``storage_option_family`` set them
(``Bounds.cache_options``, ``Bounds.storage_options``). Each bug here runs the real code with one field read
wrong (``_reads``, ``_prefetch_reads``: the field as the buggy code would see it) or one step added.
Registered into ``testing.mutants.MUTANTS`` as the other sets are; a mutant's ``cache_options`` or
``storage_options`` variant picks the families that set those fields.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from hicache_fsm.testing.mutants_more import Planted, hicache_class, planter

__all__ = ["FIFTH"]

FIFTH: list[Planted] = []
_fifth = planter(FIFTH)

HEADROOM = {"eviction_headroom_tokens": 1}
LOAD_BACK_LIMITS = {"load_back_threshold": 2, "load_back_max_tokens": 2}
WRITE_BEHIND_BATCH = {"write_behind_batch_tokens": 1, "write_behind_idle_steps": 1}


def _reads(p: Any, cls: type, method: str, holder: Callable[[Any], Any] = lambda self: self, attr: str = "config",
           **wrong: Callable[[Any], Any]) -> None:
    """Patch ``cls.method`` to run with ``holder(self).attr`` (its config or options) seeing each field of ``wrong``
    as ``wrong[field](value)``."""
    orig = getattr(cls, method)

    def patched(self, *args: Any, **kwargs: Any) -> Any:
        target = holder(self)
        value = getattr(target, attr)
        setattr(target, attr, attrs.evolve(value, **{name: read(value) for name, read in wrong.items()}))
        try:
            return orig(self, *args, **kwargs)
        finally:
            setattr(target, attr, value)

    p.setattr(cls, method, patched)


def _load_backs() -> type:
    from hicache_fsm.load_back import LoadBacks

    return LoadBacks


def _eviction() -> type:
    from hicache_fsm.eviction import Eviction

    return Eviction


# =========================================================================== eviction headroom


@_fifth("alloc_ignores_headroom", "an allocation that must evict frees only its shortfall, not the configured "
                                  "headroom beyond it", cache_options=HEADROOM)
def _alloc_ignores_headroom(p: Any) -> None:
    _reads(p, hicache_class(), "alloc_device", eviction_headroom_tokens=lambda c: 0)


@_fifth("load_back_ignores_headroom", "a load-back that must evict frees only its shortfall, not the configured "
                                      "headroom beyond it", cache_options=HEADROOM)
def _load_back_ignores_headroom(p: Any) -> None:
    _reads(p, _load_backs(), "load_back", eviction_headroom_tokens=lambda c: 0)


@_fifth("alloc_evicts_headroom_with_room", "an allocation that evicts the headroom even when the device has room "
                                           "for it (KV dropped for nothing)", cache_options=HEADROOM)
def _alloc_evicts_with_room(p: Any) -> None:
    HiCache = hicache_class()
    orig = HiCache.alloc_device

    def alloc_device(self, num_tokens):
        if self.device_allocator.available_tokens >= num_tokens:
            self.eviction.evict(self.config.eviction_headroom_tokens)
        return orig(self, num_tokens)

    p.setattr(HiCache, "alloc_device", alloc_device)


# =========================================================================== load-back limits


@_fifth("load_back_ignores_threshold", "a load-back shorter than load_back_threshold started (recomputing it "
                                       "is cheaper)", cache_options=LOAD_BACK_LIMITS)
def _ignores_threshold(p: Any) -> None:
    _reads(p, _load_backs(), "load_back", load_back_threshold=lambda c: 0)


@_fifth("load_back_threshold_inclusive", "a load-back of exactly load_back_threshold tokens refused (the bound "
                                         "taken as exclusive)", cache_options=LOAD_BACK_LIMITS)
def _threshold_inclusive(p: Any) -> None:
    _reads(p, _load_backs(), "load_back", load_back_threshold=lambda c: c.load_back_threshold + 1)


@_fifth("load_back_ignores_max_tokens", "a load-back longer than load_back_max_tokens started (the memory quota "
                                        "ignored)", cache_options=LOAD_BACK_LIMITS)
def _ignores_max(p: Any) -> None:
    _reads(p, _load_backs(), "load_back", load_back_max_tokens=lambda c: None)


@_fifth("load_back_max_tokens_exclusive", "a load-back of exactly load_back_max_tokens tokens refused (the cap "
                                          "taken as exclusive)", cache_options=LOAD_BACK_LIMITS)
def _max_exclusive(p: Any) -> None:
    _reads(p, _load_backs(), "load_back", load_back_max_tokens=lambda c: c.load_back_max_tokens - 1)


# =========================================================================== write_behind budget and idleness


@_fifth("write_behind_ignores_batch", "write_behind backing up every cold node in one poll, past "
                                      "write_behind_batch_tokens", cache_options=WRITE_BEHIND_BATCH)
def _ignores_batch(p: Any) -> None:
    _reads(p, _eviction(), "write_behind", write_behind_batch_tokens=lambda c: 1 << 40)


@_fifth("write_behind_skips_nodes_over_the_batch", "write_behind never backing up a node larger than the whole "
                                                   "batch (it waits for room in a budget it can never fit)",
        cache_options=WRITE_BEHIND_BATCH)
def _skips_big_nodes(p: Any) -> None:
    Eviction = _eviction()
    orig = Eviction.write_behind

    def write_behind(self):
        batch, backup = self.config.write_behind_batch_tokens, self.try_backup
        self.try_backup = lambda node: node.num_tokens <= batch and backup(node)  # over the budget: ends the pass
        try:
            return orig(self)
        finally:
            del self.try_backup

    p.setattr(Eviction, "write_behind", write_behind)


@_fifth("write_behind_one_poll_early", "write_behind backing up a node one poll before it is cold "
                                       "(write_behind_idle_steps read one short)", write_policy="write_behind")
def _one_poll_early(p: Any) -> None:
    _reads(p, _eviction(), "write_behind", write_behind_idle_steps=lambda c: max(0, c.write_behind_idle_steps - 1))


@_fifth("write_behind_one_poll_late", "write_behind leaving a cold node for one more poll "
                                      "(write_behind_idle_steps read one long)", write_policy="write_behind")
def _one_poll_late(p: Any) -> None:
    _reads(p, _eviction(), "write_behind", write_behind_idle_steps=lambda c: c.write_behind_idle_steps + 1)


# =========================================================================== write_through_selective


@_fifth("selective_threshold_fixed_at_two", "write_through_selective backing up at two hits whatever "
                                            "write_through_threshold says",
        cache_options={"write_through_threshold": 1})
def _threshold_fixed(p: Any) -> None:
    _reads(p, hicache_class(), "match_prefix", write_through_threshold=lambda c: 2)  # the match's backups read it


# =========================================================================== the storage tier's prefetch limits

PREFETCH_LIMITS = {"prefetch_threshold": 2, "prefetch_capacity_tokens": 3, "batch_pages": 1}


def _storage_tier() -> type:
    from hicache_fsm.storage.tier import StorageTier

    return StorageTier


def _prefetch_reads(p: Any, **wrong: Callable[[Any], Any]) -> None:
    """Patch ``StorageTier.prefetch`` (admission) to run with its prefetch runtime's options read wrong."""
    _reads(p, _storage_tier(), "prefetch", holder=lambda tier: tier.runtime, attr="options", **wrong)


@_fifth("prefetch_admits_below_threshold", "a prefetch of fewer tokens than prefetch_threshold admitted (its "
                                           "hit query and host slots spent on what is cheaper to recompute)",
        storage=True, storage_options=PREFETCH_LIMITS)
def _admits_below_threshold(p: Any) -> None:
    _prefetch_reads(p, prefetch_threshold=lambda o: 0)


@_fifth("prefetch_capacity_ignored", "a prefetch admitted past prefetch_capacity_tokens (running prefetches "
                                     "hold more host memory than allowed)", storage=True,
        storage_options=PREFETCH_LIMITS)
def _capacity_ignored(p: Any) -> None:
    _prefetch_reads(p, prefetch_capacity_tokens=lambda o: 1 << 40)


@_fifth("prefetch_kept_below_threshold", "a hit query that found fewer pages than the threshold keeps its "
                                         "prefetch (the threshold is checked at admission only)", storage=True,
        storage_options=PREFETCH_LIMITS)
def _kept_below_threshold(p: Any) -> None:
    from hicache_fsm.registry import registry_for

    p.setitem(registry_for("prefetch").guards, "hits_reach_threshold", lambda op, rt: op.hit_tokens > 0)


@_fifth("storage_calls_ignore_batch_pages", "a hit query, transfer or backup sent to the backend in one call "
                                            "whatever batch_pages says", storage=True, storage_options=PREFETCH_LIMITS)
def _calls_ignore_batch_pages(p: Any) -> None:
    _reads(p, _storage_tier(), "run_queued", attr="options", batch_pages=lambda o: 1 << 30)


# =========================================================================== storage keys of another tenant


@_fifth("storage_keys_ignore_tenant", "storage keys that leave the tenant out: one tenant's prefetch hits "
                                      "another's pages of the same tokens and reads its KV", storage=True,
        remote_tenant=True)
def _keys_ignore_tenant(p: Any) -> None:
    from hicache_fsm.storage.keys import KeyNamespace

    def prefix(self) -> str:
        rank = "mla" if self.is_mla else f"{self.tp_rank}of{self.tp_size}"
        return f"{self.model}/-/{rank}/"  # every tenant's pages under one prefix

    p.setattr(KeyNamespace, "prefix", property(prefix))
