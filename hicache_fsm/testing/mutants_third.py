"""The third set of planted controller bugs: reset, insert priorities and recency, prefetch placement, and
what the engine is handed (load waits, load-backs refused, evictions that stop short or take everything, a prefetch's readiness,
hit query and transfer, write_behind and storage backups), a page number
taken for a slot number (right only with pages of one token), a split's upper half left without recency
and a CP group's host shortfall counted on one rank.

Registered into ``testing.mutants.MUTANTS`` as ``testing.mutants_more`` is (``mutants`` imports this module,
never the other way round). Each entry is ``(name, bug, apply, variant)``; ``apply`` patches through the
``Patcher`` it is given. They live in the classes the ``reset`` action, prioritised inserts and the
``storage/prefetch_anchor`` family opened: a reset that leaves something behind, an insert that ranks its path
wrongly, fetched pages hung in the wrong place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hicache_fsm.testing.mutants_more import Planted, hicache_class, planter

__all__ = ["THIRD"]

THIRD: list[Planted] = []
_third = planter(THIRD)


def _wrap_insert(p: Any, after: Callable[[Any, dict, int], None]) -> None:
    """Patch ``HiCache.insert``: ``after(cache, before, priority)`` runs once the real insert returned, with
    ``before`` = {node id: (last_access, priority)} of the nodes that were in the tree before it."""
    HiCache = hicache_class()
    orig = HiCache.insert

    def insert(self, tokens, device_indices, namespace=None, priority=0):
        before = {n.id: (n.last_access, n.priority) for n in self.tree.nodes()}
        result = orig(self, tokens, device_indices, namespace, priority)
        after(self, before, priority)
        return result

    p.setattr(HiCache, "insert", insert)


def _path_of(cache: Any, before: dict) -> list:
    """The nodes the insert just touched: those stamped with the cache's newest access time."""
    newest = max(n.last_access for n in cache.tree.nodes())
    return [n for n in cache.tree.nodes() if n.parent is not None and n.last_access == newest
            and (n.id not in before or before[n.id][0] != newest)]


# =========================================================================== insert recency and hits


@_third("insert_touches_new_node_only", "an insert refreshing the recency of its new node but not of the "
                                        "matched prefix above it (LRU evicts a prefix just re-used)")
def _new_node_only(p: Any) -> None:
    def after(cache, before, priority):
        for n in cache.tree.nodes():
            if n.id in before:
                n.last_access = before[n.id][0]

    _wrap_insert(p, after)


@_third("lfu_hit_on_insert", "an insert counted as an LFU hit on every node of its path", eviction_policy="lfu")
def _hit_on_insert(p: Any) -> None:
    def after(cache, before, priority):
        for n in _path_of(cache, before):
            n.hit_count += 1

    _wrap_insert(p, after)


# =========================================================================== priorities


@_third("priority_not_raised_on_matched_path", "a prioritised insert raising the priority of its new node only, "
                                               "not of the cached prefix it extends", eviction_policy="priority")
def _priority_new_only(p: Any) -> None:
    def after(cache, before, priority):
        for n in cache.tree.nodes():
            if n.id in before:
                n.priority = before[n.id][1]

    _wrap_insert(p, after)


@_third("priority_lowered_by_insert", "an insert overwriting its path's priority with its own (a low-priority "
                                      "request demotes a prefix a high-priority one holds)", eviction_policy="priority")
def _priority_lowered(p: Any) -> None:
    def after(cache, before, priority):
        for n in _path_of(cache, before):
            n.priority = priority

    _wrap_insert(p, after)


@_third("priority_order_inverted", "the priority policy evicting the highest priority first",
        eviction_policy="priority")
def _priority_inverted(p: Any) -> None:
    from hicache_fsm.eviction import POLICY_KEYS

    p.setitem(POLICY_KEYS, "priority", lambda node: (-node.priority, node.last_access, node.id))


# =========================================================================== reset


@_third("reset_keeps_pending_jobs", "a reset that drops the tree but keeps the jobs in flight pending (their acks "
                                    "are applied to nodes that are gone)", reset=True)
def _reset_keeps_jobs(p: Any) -> None:
    from hicache_fsm.outbox import Outbox

    p.setattr(Outbox, "cancel_all", lambda self: None)


@_third("reset_forgets_cancelled_jobs", "a reset that clears the job ledger too, so a late ack of a job it "
                                        "cancelled is refused as unknown", reset=True)
def _reset_forgets_ledger(p: Any) -> None:
    HiCache = hicache_class()
    orig = HiCache.reset

    def reset(self):
        orig(self)
        self.job_ledger.recent.clear()

    p.setattr(HiCache, "reset", reset)


@_third("reset_leaks_backup_slots", "a reset freeing settled host slots only: those of a backup in flight "
                                    "stay allocated", reset=True)
def _reset_leaks(p: Any) -> None:
    HiCache = hicache_class()
    orig = HiCache.reset

    def reset(self):
        flying = sum(n.num_tokens for n in self.tree.nodes()
                     if n.parent is not None and n.pending_jobs and n.host_indices is not None)
        orig(self)
        if flying:
            self.host_allocator.alloc(flying)

    p.setattr(HiCache, "reset", reset)


@_third("reset_keeps_candidates", "a reset that leaves the eviction candidate sets as they were (they name "
                                  "nodes that are gone)", reset=True)
def _reset_candidates(p: Any) -> None:
    HiCache = hicache_class()
    orig = HiCache.reset

    def reset(self):
        self.eviction.rebuild = lambda: None  # shadows the method for this call only
        try:
            orig(self)
        finally:
            del self.eviction.rebuild

    p.setattr(HiCache, "reset", reset)


# =========================================================================== prefetch placement


@_third("prefetch_inserted_under_root", "a prefetch's fetched pages inserted under the root instead of under "
                                        "its anchor", storage=True)
def _under_root(p: Any) -> None:
    from hicache_fsm.storage.prefetch import PrefetchRuntime

    orig = PrefetchRuntime.insert_fetched

    def insert_fetched(self, op):
        anchor = op.anchor
        op.anchor = self.ctx.tree.root
        try:
            orig(self, op)
        finally:
            op.anchor = anchor

    p.setattr(PrefetchRuntime, "insert_fetched", insert_fetched)


# =========================================================================== what the soundness probe planted


@_third("partial_backup_acked_as_stored", "a backup the backend stored only in part acknowledged as stored (pages "
                                          "never written counted as storage hits)", storage=True)
def _partial_backup_stored(p: Any) -> None:
    """Caught once a backup may come back refused in part (the explorer's ``partial_backup``)."""
    import hicache_fsm.storage.threads as threads

    orig = threads.one_per_page

    def one_per_page(results, asked, call):
        answers = orig(results, asked, call)
        return [any(answers)] * len(answers) if call == "batch_set_from" else answers

    p.setattr(threads, "one_per_page", one_per_page)


@_third("prefetch_release_inserts", "a revoked, failed or aborted prefetch inserts what arrived (its spec "
                                    "releases it all)", storage=True)
def _release_inserts(p: Any) -> None:
    """Every page inserted is whole and correct: only the spec's promise tells it (``PrefetchRuntime.fire``)."""
    from hicache_fsm.registry import registry_for

    effects = registry_for("prefetch").effects
    orig = effects["release_unused"]

    def release_unused(op, rt):
        rt.insert_fetched(op)
        orig(op, rt)

    p.setitem(effects, "release_unused", release_unused)


@_third("host_candidate_rule_ignores_pins", "the rule of which host copies may be evicted ignores pins (the "
                                            "maintained candidate set, kept by its own copy of it, still does not)")
def _host_rule_ignores_pins(p: Any) -> None:
    """Not yet a wrong eviction: the two copies of the rule disagree, and only recomputing the candidate sets
    at every check (``check_candidates``, which the adapters set) shows it."""
    from hicache_fsm.eviction import HOST_EVICTABLE, Eviction
    from hicache_fsm.registry import registry_for

    def is_host_candidate(node):
        return node.parent is not None and node.state in HOST_EVICTABLE and not node.children

    p.setattr(Eviction, "is_host_candidate", staticmethod(is_host_candidate))
    p.setitem(registry_for("residency").guards, "host_unpinned", lambda node, ctx: True)


@_third("refused_backup_drops_parent", "a device-only parent whose backup the full host refuses is dropped, "
                                       "orphaning its host-only children", write_policy="write_through")
def _refused_backup_drops_parent(p: Any) -> None:
    """Device eviction may drop a device-only node only when no child hangs below it: a host-only child would
    be left without its prefix. Reached when a prompt too long for the host is split and its tail backed up
    and pinned (``memory/write_through_host_full``)."""
    from hicache_fsm.eviction import Eviction

    orig = Eviction.try_backup

    def try_backup(self, node):
        if orig(self, node):
            return True
        if node.state == "device" and node.children and node.lock_ref == 0 and not node.resident_children:
            self.driver.fire(node, "drop")  # room for the parent's children, taken as if it were a leaf
            self.driver.remove(node)
        return False

    p.setattr(Eviction, "try_backup", try_backup)


# =========================================================================== what the engine is handed


@_third("load_back_waits_for_no_ancestor", "a load-back below an ancestor still loading hands the engine a wait "
                                           "that does not cover the ancestor's load")
def _load_back_waits_for_no_ancestor(p: Any) -> None:
    from hicache_fsm.load_back import LoadBacks

    p.setattr(LoadBacks, "loading_deps", lambda self, nodes: [])


@_third("load_back_waits_for_adjacent_loads_only", "a load-back waits only for the loads right above its chain: "
                                                  "not for an ancestor's load above a node an insert revived")
def _load_back_waits_for_adjacent_loads_only(p: Any) -> None:
    from hicache_fsm.bindings.residency import LOADING
    from hicache_fsm.load_back import LoadBacks

    def loading_above(self, anchor):
        run = []
        for n in () if anchor.is_root else self.tree.path_to_root(anchor):
            if n.state not in LOADING:
                break  # a revived node between: the loads above it are left out
            run.append(n)
        return run

    p.setattr(LoadBacks, "loading_above", loading_above)


@_third("load_back_refused_with_room", "a load-back refused though the device has room for the chain (the "
                                       "engine recomputes KV the host holds)")
def _load_back_refused_with_room(p: Any) -> None:
    from hicache_fsm.load_back import LoadBacks

    p.setattr(LoadBacks, "load_back", lambda self, node: None)


@_third("load_back_never_evicts", "a load-back refused for device room without evicting for it")
def _load_back_never_evicts(p: Any) -> None:
    from hicache_fsm.load_back import LoadBacks

    orig = LoadBacks.load_back

    def load_back(self, node):
        chain, _ = self.evicted_chain(node)
        if chain and self.device_allocator.available_tokens < sum(n.num_tokens for n in chain):
            return None
        return orig(self, node)

    p.setattr(LoadBacks, "load_back", load_back)


@_third("evict_frees_nothing", "a device eviction that frees nothing (every allocation on a full device fails)")
def _evict_frees_nothing(p: Any) -> None:
    from hicache_fsm.eviction import Eviction

    p.setattr(Eviction, "evict", lambda self, num_tokens: 0)


@_third("evict_stops_after_one_token", "a device eviction asked for several tokens that stops after the first")
def _evict_stops_after_one_token(p: Any) -> None:
    from hicache_fsm.eviction import Eviction

    orig = Eviction.evict
    p.setattr(Eviction, "evict", lambda self, num_tokens: orig(self, min(num_tokens, 1)))


@_third("evict_takes_everything", "a device eviction that takes every candidate, however few tokens it was asked "
                                  "for")
def _evict_takes_everything(p: Any) -> None:
    from hicache_fsm.eviction import Eviction

    orig = Eviction.evict
    p.setattr(Eviction, "evict", lambda self, num_tokens: orig(self, 1 << 40))


@_third("evict_host_takes_everything", "a host eviction that takes every candidate, however few tokens it was "
                                       "asked for")
def _evict_host_takes_everything(p: Any) -> None:
    from hicache_fsm.eviction import Eviction

    orig = Eviction.evict_host
    p.setattr(Eviction, "evict_host", lambda self, num_tokens: orig(self, 1 << 40))


@_third("alloc_device_never_evicts", "an allocation on a full device that fails without evicting (the engine "
                                     "cannot admit a request while backed-up KV could go)")
def _alloc_device_never_evicts(p: Any) -> None:
    HiCache = hicache_class()
    orig = HiCache.alloc_device

    def alloc_device(self, num_tokens):
        if self.device_allocator.available_tokens < num_tokens:
            return None
        return orig(self, num_tokens)

    p.setattr(HiCache, "alloc_device", alloc_device)


@_third("hit_query_stops_after_first_page", "a prefetch's hit query that counts only the first stored page "
                                            "(the rest is recomputed though storage holds it)", storage=True)
def _hit_query_stops_after_first_page(p: Any) -> None:
    from hicache_fsm.storage.admission import PrefetchCalls

    orig = PrefetchCalls.query_answered
    p.setattr(PrefetchCalls, "query_answered", lambda self, op, keys: orig(self, op, tuple(keys[:1])))


@_third("transfer_counts_one_page_short", "a prefetch transfer whose last landed page is not counted (reported "
                                          "short, though storage served it)", storage=True)
def _transfer_counts_one_page_short(p: Any) -> None:
    from hicache_fsm.storage.admission import PrefetchCalls

    orig = PrefetchCalls.batch_landed

    def batch_landed(self, op, tokens, short, error):
        if tokens > 0 and not short:
            tokens, short, error = tokens - op.page_size, True, "dropped"
        orig(self, op, tokens, short, error)

    p.setattr(PrefetchCalls, "batch_landed", batch_landed)


@_third("storage_backups_never_start", "host copies never backed up to storage: neither when their D2H lands "
                                       "nor by the retry sweep", storage=True)
def _storage_backups_never_start(p: Any) -> None:
    from hicache_fsm.residency_driver import ResidencyDriver

    orig = ResidencyDriver.can_fire  # both paths ask it before firing ``store``
    p.setattr(ResidencyDriver, "can_fire", lambda self, node, trigger: trigger != "store" and orig(self, node, trigger))


@_third("wait_complete_stops_early", "a wait_complete prefetch is stopped (ready) before its transfer ended",
        storage=True)
def _wait_complete_stops_early(p: Any) -> None:
    from hicache_fsm.storage.prefetch import PrefetchRuntime

    orig = PrefetchRuntime.stop_allowed

    def stop_allowed(self, op):
        return self.options.stop_policy == "wait_complete" or orig(self, op)

    p.setattr(PrefetchRuntime, "stop_allowed", stop_allowed)


@_third("write_behind_never_backs_up", "write_behind never backs up a cold device-only node (its poll pass "
                                       "is skipped)", write_policy="write_behind")
def _write_behind_never_backs_up(p: Any) -> None:
    from hicache_fsm.eviction import Eviction

    p.setattr(Eviction, "write_behind", lambda self: None)


@_third("backup_host_start_in_pages", "a backup writes its run at the host page number taken for a slot number "
                                      "(right only with pages of one token)")
def _backup_host_start_in_pages(p: Any) -> None:
    from hicache_fsm import executors

    orig = executors.backup_to_host

    def backup_to_host(device_pool, host_pool, *args, runs=None, **kwargs):
        ps = host_pool.page_size
        if runs is not None:
            runs = [(d, h // ps // ps * ps, n) for d, h, n in runs]  # the page number, kept page aligned
        return orig(device_pool, host_pool, *args, runs=runs, **kwargs)

    p.setattr(executors, "backup_to_host", backup_to_host)


# =========================================================================== split recency, CP group room


@_third("split_upper_loses_recency", "a node split leaving the new upper half's recency unset (it copies the hit "
                                     "count and priority, not last_access), so LRU ranks it first", storage=True)
def _split_upper_loses_recency(p: Any) -> None:
    """An insert or a lookup stamps the path it splits at once, hiding the slip: only a split nothing stamps
    shows it, a prefetch's fetched pages landing partway into a node (``storage/prefetch_split``)."""
    from hicache_fsm.radix import RadixTree

    orig = RadixTree.split

    def split(self, node, at):
        upper = orig(self, node, at)
        upper.last_access = 0  # a new node's default: the copy of node.last_access left out
        return upper

    p.setattr(RadixTree, "split", split)


@_third("cp_shortfall_own_rank_only", "a CP backup evicting host KV for this rank's own shortfall, not the most any "
                                      "rank of the group lacks (ranks evict differently, their trees part)", cp=True)
def _cp_shortfall_own_rank_only(p: Any) -> None:
    """Shows only when one rank's host is full of its own pages while another's has room
    (``cp/2_ranks_host_full``)."""
    from hicache_fsm.layer_write import LayerWriteRuntime

    def group_shortfall(self, node):
        owners = self.layout.owner_for_logical_pages(node.device_indices[:: self.page_size] // self.page_size)
        return int((owners == self.rank).sum()) * self.page_size - self.host_room()

    p.setattr(LayerWriteRuntime, "group_shortfall", group_shortfall)
