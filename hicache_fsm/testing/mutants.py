"""Planted controller bugs, to prove the fuzzer and the explorer catch them.

Each mutant re-creates one class of bug from the reference's history (see
``HICACHE_SEMANTICS.md``) by patching ``HiCache`` methods, ``RadixTree`` or
the residency bindings (or the storage tier and its prefetch runtime)
*for the duration of a* ``with mutant(name):`` block
only; nothing here is imported by the library itself, so no production path
can reach a mutant. Caches must be created inside the block (each
``HiCacheAdapter`` compiles its residency machine from the registry as it is
then, so patched guards and effects take effect).

    from hicache_fsm.testing.mutants import MUTANTS, mutant
    with mutant("double_free_host"):
        result = explore(Bounds(nodes=2, device_pages=2, host_pages=2), stop_on_first=True)
    assert result.violations

``MUTANTS[name].variant`` names the cache configuration the bug lives in
(e.g. ``write_back``, ``storage=True`` for the L3 / prefetch bugs, ``reset=True`` for those only a
``reset`` shows); the
fuzzer draws it among its variants anyway, the explorer should be run with it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import attrs

__all__ = ["MUTANTS", "Mutant", "Patcher", "mutant"]


class Patcher:
    """Record attribute / item replacements and undo them in reverse order."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def setattr(self, obj: Any, name: str, value: Any) -> None:
        missing = object()
        old = obj.__dict__.get(name, missing) if isinstance(obj, type) else getattr(obj, name, missing)
        if old is missing and not hasattr(obj, name):
            raise AttributeError(f"{obj!r} has no attribute {name!r} to patch (the code moved?)")
        setattr(obj, name, value)
        if old is missing:
            self._undo.append(lambda: delattr(obj, name))
        else:
            self._undo.append(lambda: setattr(obj, name, old))

    def setitem(self, mapping: dict, key: Any, value: Any) -> None:
        if key not in mapping:
            raise KeyError(f"{key!r} is not bound (the code moved?)")
        old = mapping[key]
        mapping[key] = value
        self._undo.append(lambda: mapping.__setitem__(key, old))

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()


@attrs.frozen
class Mutant:
    name: str
    bug: str  # the bug class, in the reference's words
    apply: Callable[[Patcher], None] = attrs.field(repr=False)
    variant: dict = attrs.Factory(dict)  # cache configuration the bug needs (write policy, storage, ...)


MUTANTS: dict[str, Mutant] = {}


def _mutant(name: str, bug: str, **variant: Any):
    def deco(fn: Callable[[Patcher], None]) -> Callable[[Patcher], None]:
        MUTANTS[name] = Mutant(name, bug, fn, dict(variant))
        return fn

    return deco


def _cache():
    from hicache_fsm import cache

    return cache


def _driver():
    from hicache_fsm.residency_driver import ResidencyDriver

    return ResidencyDriver


def _eviction():
    from hicache_fsm.eviction import Eviction

    return Eviction


def _outbox():
    from hicache_fsm.outbox import Outbox

    return Outbox


def _residency():
    from hicache_fsm.registry import registry_for

    return registry_for("residency")


@contextlib.contextmanager
def mutant(name: str) -> Iterator[Mutant]:
    """Apply the named mutant for the duration of the block."""
    m = MUTANTS[name]
    p = Patcher()
    try:
        m.apply(p)
        yield m
    finally:
        p.undo()


# =========================================================================== slot bookkeeping


@_mutant("double_free_host", "double free of host slots released on two paths")
def _double_free_host(p: Patcher) -> None:
    """A failed backup's host slots are freed by the transition and again by the completion path."""
    Driver = _driver()
    orig = Driver.fire

    def fire(self, node, trigger, *a, **kw):
        held = node.host_indices
        t = orig(self, node, trigger, *a, **kw)
        if trigger == "write_failed" and held is not None:
            self.ctx.host_allocator.free(held)
        return t

    p.setattr(Driver, "fire", fire)


@_mutant("leak_host_on_failed_backup", "leaked host slots (bookkeeping dropped before the slots were released)")
def _leak_host(p: Patcher) -> None:
    reg = _residency()
    orig = reg.effects["free_host"]

    def free_host(node, cache):
        if node.state == "writing_host":  # the failure path forgets the allocator
            node.host_indices = None
            return
        orig(node, cache)

    p.setitem(reg.effects, "free_host", free_host)


@_mutant("leak_device_on_failed_load", "leaked device slots when a load fails")
def _leak_device(p: Patcher) -> None:
    reg = _residency()
    orig = reg.effects["free_device"]

    def free_device(node, cache):
        if node.state in ("loading", "loading_storing", "loading_stored"):
            node.device_indices = None
            return
        orig(node, cache)

    p.setitem(reg.effects, "free_device", free_device)


# =========================================================================== host copies


@_mutant("evict_host_while_loading", "host copy of a loading chain evicted before the load ack")
def _evict_loading(p: Patcher) -> None:
    """Host eviction also reclaims the host copy of loading leaves (they look host-resident)."""
    Eviction = _eviction()
    orig = Eviction.evict_host

    def evict_host(self, num_tokens):
        freed = orig(self, num_tokens)
        for n in list(self.tree.nodes()):
            if freed >= num_tokens:
                break
            if n.state in ("loading", "loading_stored") and not n.children and n.host_ref == 0:
                self.host_allocator.free(n.host_indices)  # the node still believes it holds them
                freed += n.num_tokens
        return freed

    p.setattr(Eviction, "evict_host", evict_host)


@_mutant("load_from_freed_host", "load-back of a node whose host copy was already freed")
def _stale_host_node(p: Patcher) -> None:
    """Host eviction frees the slots but leaves the node in the tree, so matches and loads find it."""
    Eviction = _eviction()
    orig = Eviction.evict_host

    def evict_host(self, num_tokens):
        driver = self.driver
        driver.__dict__["remove"] = lambda node: None  # lazy deletion that never happens
        try:
            return orig(self, num_tokens)
        finally:
            driver.__dict__.pop("remove", None)

    p.setattr(Eviction, "evict_host", evict_host)


@_mutant("orphan_subtree_on_host_evict", "host eviction orphaning subtrees of inner nodes")
def _orphan(p: Patcher) -> None:
    """Host eviction also takes host-only *inner* nodes and unlinks them, stranding their children."""
    Eviction = _eviction()
    orig = Eviction.evict_host

    def evict_host(self, num_tokens):
        freed = orig(self, num_tokens)
        tree = self.tree
        for n in list(tree.nodes()):
            if freed >= num_tokens:
                break
            if n.is_root or not n.children or n.state not in ("host", "host_stored") or n.host_ref:
                continue
            self.driver.fire(n, "evict_host")
            del n.parent.children[tree.child_key(n.namespace, n.token_ids, 0)]
            del tree.by_id[n.id]  # the bug: unlinked without RadixTree.remove_leaf's check
            freed += n.num_tokens
        return freed

    p.setattr(Eviction, "evict_host", evict_host)


@_mutant("write_back_failed_as_backed_up", "write_back treating a failed backup as backed up", write_policy="write_back")
def _failed_as_backed_up(p: Patcher) -> None:
    Driver = _driver()
    orig = Driver.fire

    def fire(self, node, trigger, *a, **kw):
        if trigger == "write_failed" and self.hooks.config.write_policy == "write_back":
            trigger = "write_done"
        return orig(self, node, trigger, *a, **kw)

    p.setattr(Driver, "fire", fire)


# =========================================================================== acknowledgements


@_mutant("ack_before_copy", "ack handled before the copy finished (layer read before its load event)")
def _ack_early(p: Patcher) -> None:
    """Loads are acknowledged as soon as they are submitted, before the executor copied anything."""
    Outbox = _outbox()
    orig = Outbox.flush

    def flush(self):
        from hicache_fsm.jobs import Completion, JobKind

        executor = self.executor
        before = set(executor.pending_job_ids()) if hasattr(executor, "pending_job_ids") else set()
        orig(self)
        for job in self.pending_jobs():
            if job.kind is JobKind.H2D and job.id not in before:
                self.apply([Completion(job.id, True)])

    p.setattr(Outbox, "flush", flush)


@_mutant("double_ack", "ack handled twice (a re-delivered completion is accepted)")
def _double_ack(p: Patcher) -> None:
    Outbox = _outbox()
    orig = Outbox.check

    def check(self, c):
        if self.ledger.recent.get(c.job_id) in ("acked", "failed"):
            return
        return orig(self, c)

    p.setattr(Outbox, "check", check)


# =========================================================================== locks, splits, eviction


@_mutant("lock_ref_underflow", "lock refs going negative (split forgets the lock, unlock does not check)")
def _lock_underflow(p: Patcher) -> None:
    from hicache_fsm.radix import RadixTree

    HiCache = _cache().HiCache
    split = RadixTree.split

    def split_(self, node, at):
        upper = split(self, node, at)
        upper.lock_ref = 0
        return upper

    def unlock(self, node):
        node = self.driver.require_node(node)
        for n in self.tree.path_to_root(node):
            n.lock_ref -= 1

    p.setattr(RadixTree, "split", split_)
    p.setattr(HiCache, "unlock", unlock)


@_mutant("hit_count_lost_on_split", "hit count lost on node split", eviction_policy="lfu")
def _hits_lost(p: Patcher) -> None:
    from hicache_fsm.radix import RadixTree

    split = RadixTree.split

    def split_(self, node, at):
        upper = split(self, node, at)
        upper.hit_count = 0
        return upper

    p.setattr(RadixTree, "split", split_)


@_mutant("split_drops_job", "a node split mid-transfer leaves its new half out of the job")
def _split_drops_job(p: Patcher) -> None:
    Outbox = _outbox()

    def enrol_split(self, upper):
        upper.pending_jobs = set()

    p.setattr(Outbox, "enrol_split", enrol_split)


@_mutant("evict_locked_node", "evicting a locked node")
def _evict_locked(p: Patcher) -> None:
    Eviction = _eviction()
    orig = Eviction.refresh

    def refresh(self, node):
        orig(self, node)
        if node.parent is not None and node.state in DEVICE_EVICTABLE and node.resident_children == 0:
            self.device.add(node)  # locks ignored

    from hicache_fsm.eviction import DEVICE_EVICTABLE

    p.setattr(Eviction, "refresh", refresh)
    import hicache_fsm.eviction as eviction_module

    p.setattr(eviction_module, "node_locked", lambda node: False)  # the device set no longer skips locked members
    p.setitem(_residency().guards, "unlocked", lambda node, cache: True)


@_mutant("evict_inner_device_node", "device not prefix-closed after evicting an inner node")
def _evict_inner(p: Patcher) -> None:
    Eviction = _eviction()
    orig = Eviction.refresh

    def refresh(self, node):
        orig(self, node)
        if node.parent is not None and node.state in DEVICE_EVICTABLE and node.lock_ref == 0 \
                and node.state != "device":
            self.device.add(node)  # children on the device ignored

    from hicache_fsm.eviction import DEVICE_EVICTABLE

    p.setattr(Eviction, "refresh", refresh)


@_mutant("eviction_counter_stuck", "eviction counter that never advanced")
def _counter_stuck(p: Patcher) -> None:
    Eviction = _eviction()
    orig = Eviction.device_pass

    def device_pass(self, num_tokens, *a, **kw):
        _, started = orig(self, 1 << 40, *a, **kw)  # the loop never sees its goal reached...
        return 0, started  # ...and reports nothing freed

    p.setattr(Eviction, "device_pass", device_pass)


# =========================================================================== storage tier (L3) and prefetch
# These need a cache with storage attached (``HiCacheAdapter(storage=True)``: a ``ManualStorageTier`` run
# step by step over ``memory://``): the fuzzer's storage variants, ``Bounds(storage=True)`` for the explorer.


def _tier():
    from hicache_fsm.storage import tier

    return tier


def _prefetch():
    from hicache_fsm.storage import prefetch

    return prefetch


@_mutant("prefetch_double_release", "double free of prefetch host slots released on two paths", storage=True)
def _prefetch_double_release(p: Patcher) -> None:
    """The abort handler hands the prefetch's slots back itself, then the ``release`` effect does it again."""
    StorageTier = _tier().StorageTier
    orig = StorageTier.abort_prefetch

    def abort_prefetch(self, request_id):
        op = self.runtime.active.get(request_id)
        if op is not None and op.host_indices.numel() and not op.io_active:
            self.ctx.host_allocator.free(op.host_indices)
        return orig(self, request_id)

    p.setattr(StorageTier, "abort_prefetch", abort_prefetch)


@_mutant("abort_leaks_prefetch", "aborted requests leaking prefetch slots", storage=True)
def _abort_leaks(p: Patcher) -> None:
    """Abort drops the bookkeeping and ends the op, but never fires ``release`` (slots and anchor pin leak)."""
    StorageTier = _tier().StorageTier

    def abort_prefetch(self, request_id):
        self._drain()
        op = self.runtime.active.pop(request_id, None)
        if op is None:
            return False
        self.runtime.fire(op, "abort")
        return True

    p.setattr(StorageTier, "abort_prefetch", abort_prefetch)


@_mutant("failed_store_as_stored", "failed L3 backup (H2S) treated as stored", storage=True)
def _failed_store(p: Patcher) -> None:
    """A failed or refused H2S job moves the node to ``*_stored`` as if storage held its pages."""
    Driver = _driver()
    orig = Driver.fire

    def fire(self, node, trigger, *a, **kw):
        if trigger == "store_failed":
            trigger = "store_done"
        return orig(self, node, trigger, *a, **kw)

    p.setattr(Driver, "fire", fire)


@_mutant("short_prefetch_inserted_in_full", "fetched pages inserted after a short batch (pages that never arrived)",
         storage=True)
def _short_inserted(p: Patcher) -> None:
    """On stop, every hit page is inserted, as if the transfer had completed."""
    PrefetchRuntime = _prefetch().PrefetchRuntime
    orig = PrefetchRuntime.insert_fetched

    def insert_fetched(self, op):
        op.completed_tokens = max(op.completed_tokens, op.hit_tokens)
        return orig(self, op)

    p.setattr(PrefetchRuntime, "insert_fetched", insert_fetched)


@_mutant("prefetch_short_counted_complete",
         "prefetch transfer counted complete when it landed one page short", storage=True)
def _short_counted_complete(p: Patcher) -> None:
    """A batch that came back one page short is counted (landed and completed) as whole: the missing page's
    slot, never written, is inserted at stop. Only the slot's contents tell this state from a good one."""
    StorageTier = _tier().StorageTier
    orig = StorageTier.batch_landed

    def batch_landed(self, op, tokens, short, error):
        if short and op.state == "transferring" and op.landed_tokens + self.page_size <= op.hit_tokens:
            op.landed_tokens += self.page_size
            return orig(self, op, tokens + self.page_size, False, "")
        return orig(self, op, tokens, short, error)

    p.setattr(StorageTier, "batch_landed", batch_landed)


@_mutant("anchor_unpinned_twice", "prefetch anchor unpinned twice (by the abort handler and by release)",
         storage=True)
def _anchor_twice(p: Patcher) -> None:
    """The abort handler unpins the anchor itself; the ``release`` effect then unpins it again."""
    StorageTier = _tier().StorageTier
    orig = StorageTier.abort_prefetch

    def abort_prefetch(self, request_id):
        op = self.runtime.active.get(request_id)
        if op is not None and op.anchor_pinned:
            if op.anchor_pin == "host":
                self.ctx.unpin_host(op.anchor)
            else:
                self.ctx.unlock(op.anchor)
        return orig(self, request_id)

    p.setattr(StorageTier, "abort_prefetch", abort_prefetch)


# =========================================================================== policies, load-back, CP, storage link
# Caught by the protocol checks (``testing.protocol.ProtocolAdapter``, ``testing.cp.CPAdapter``) that
# ``hicache-fsm check`` runs by default. ``cp=True`` mutants live in the CP families only.


@_mutant("selective_threshold_off_by_one", "off-by-one policy threshold (selective backup one hit early)",
         write_policy="write_through_selective")
def _selective_early(p: Patcher) -> None:
    Eviction = _eviction()

    def back_up_hot(self, path, threshold):
        for node in [n for n in path if n.state == "device" and n.hit_count >= threshold - 1]:
            self.try_backup(node)

    p.setattr(Eviction, "back_up_hot", back_up_hot)


@_mutant("write_back_drops_only_copy", "write_back evicting the only copy without trying a backup",
         write_policy="write_back")
def _drops_only_copy(p: Patcher) -> None:
    Eviction = _eviction()
    orig = Eviction.device_pass

    def device_pass(self, num_tokens, tried):
        config = self.config
        policy = config.write_policy
        object.__setattr__(config, "write_policy", "write_through")  # eviction forgets the policy
        try:
            return orig(self, num_tokens, tried)
        finally:
            object.__setattr__(config, "write_policy", policy)

    p.setattr(Eviction, "device_pass", device_pass)


@_mutant("partial_load_back", "partial load-back (only the top of an evicted chain comes back)")
def _partial_load_back(p: Patcher) -> None:
    from hicache_fsm.load_back import LoadBacks

    orig = LoadBacks.evicted_chain

    def evicted_chain(self, node):
        chain, anchor = orig(self, node)
        return chain[:1], anchor

    p.setattr(LoadBacks, "evicted_chain", evicted_chain)


@_mutant("load_back_indices_out_of_order", "load-back handing the engine the chain's slots out of order")
def _indices_order(p: Patcher) -> None:
    import torch

    HiCache = _cache().HiCache
    orig = HiCache.load_back

    def load_back(self, node):
        lb = orig(self, node)
        if lb is None or len(lb.nodes) < 2:
            return lb
        return attrs.evolve(lb, device_indices=torch.cat([n.device_indices for n in reversed(lb.nodes)]))

    p.setattr(HiCache, "load_back", load_back)


@_mutant("lock_leak_on_failed_load", "lock leaked on an error path (a failed load keeps the chain locked)")
def _lock_leak(p: Patcher) -> None:
    from hicache_fsm.jobs import JobKind
    from hicache_fsm.outbox import Outbox

    orig = Outbox.apply

    def apply(self, completions, late=None):
        completions = list(completions)
        failed = [self._pending.get(c.job_id) for c in completions if not c.ok]
        out = orig(self, completions, late)
        tree = self.tree
        for job in failed:
            if job is None or job.kind is not JobKind.H2D or not job.node_ids:
                continue
            node = tree.get(job.node_ids[0])
            for n in ([] if node is None else tree.path_to_root(node)):
                n.lock_ref += 1  # the lock taken for the load is not released on the failure path
        return out

    p.setattr(Outbox, "apply", apply)


@_mutant("lock_leak_on_refused_load_back", "lock leaked when a load-back is refused for lack of device room")
def _refused_load_back_keeps_lock(p: Patcher) -> None:
    """The chain is locked for the load before device room is found; the refusal path never unlocks it."""
    HiCache = _cache().HiCache
    orig = HiCache.load_back

    def load_back(self, node):
        refused = self.counters["load_back_device_full"]
        lb = orig(self, node)
        if lb is None and self.counters["load_back_device_full"] > refused and self.tree.owns(node):
            for n in self.tree.path_to_root(node):
                n.lock_ref += 1
        return lb

    p.setattr(HiCache, "load_back", load_back)


def _layer_write():
    from hicache_fsm import layer_write

    return layer_write


@_mutant("prefetch_hits_counted_as_found", "prefetch hits reported as the pages storage found, not those inserted",
         storage=True)
def _prefetch_hits_found(p: Patcher) -> None:
    from hicache_fsm.storage.prefetch import PrefetchRuntime

    orig = PrefetchRuntime.insert_fetched

    def insert_fetched(self, op):
        before = self.counters["prefetch_hit_tokens"]
        orig(self, op)
        self.counters["prefetch_hit_tokens"] = before + op.hit_tokens  # found, whether inserted or not

    p.setattr(PrefetchRuntime, "insert_fetched", insert_fetched)


@_mutant("cp_ack_before_last_layer", "CP write acked before its last layer copy landed", cp=True)
def _cp_ack_early(p: Patcher) -> None:
    Runtime = _layer_write().LayerWriteRuntime
    orig = Runtime.layer_job_finished

    def layer_job_finished(self, job, ok):
        orig(self, job, ok)
        for w in self.pending_writes():
            if w.state == "all_submitted" and len(w.inflight) == 1 and not w.copy_failed:
                self._final_ack(w)

    p.setattr(Runtime, "layer_job_finished", layer_job_finished)


@_mutant("cp_draft_layers_not_written", "CP draft layers marked submitted but never copied", cp=True)
def _cp_no_draft(p: Patcher) -> None:
    lw = _layer_write()
    Runtime = lw.LayerWriteRuntime
    orig = Runtime._submit

    def _submit(self, write, layer, source):
        if source == "draft":
            self.machine.fire(write, "submit_layer", lw.LayerEvent(self, source, layer))
            if write.state == "all_submitted" and not write.inflight:
                self._final_ack(write)
            return False
        return orig(self, write, layer, source)

    p.setattr(Runtime, "_submit", _submit)


@_mutant("detach_with_transfers_in_flight", "storage detached with transfers in flight", storage=True)
def _detach_in_flight(p: Patcher) -> None:
    from hicache_fsm.registry import registry_for
    from hicache_fsm.storage.tier import StorageTier

    # detach neither ends the transfers first nor waits for them
    p.setattr(StorageTier, "wind_down", lambda self, reason: None)
    p.setitem(registry_for("storage_link").guards, "nothing_in_flight", lambda link, cache: True)


@_mutant("failed_load_reported_done", "a failed load of a locked node reported as done (neither retried nor "
                                      "rolled back)")
def _failed_load_done(p: Patcher) -> None:
    """The failure path of a load retries the nodes it must keep (locked, or with resident children); here it
    declares them loaded instead, so a device copy that never landed is served as valid."""
    from hicache_fsm.load_back import LoadBacks

    orig = LoadBacks.load_failed

    def load_failed(self, nodes, handle):
        kept = [n for n in nodes if n.lock_ref > 0]
        for node in kept:
            self.driver.fire(node, "load_done")
        rest = [n for n in nodes if n.lock_ref == 0]
        if rest:
            orig(self, rest, handle)

    p.setattr(LoadBacks, "load_failed", load_failed)


@_mutant("backup_keeps_lock", "a transfer that keeps a lock after it ends (a backup's ack never hands back the "
                              "lock taken for the copy)")
def _backup_keeps_lock(p: Patcher) -> None:
    """As the reference does, a backup locks its node for the copy; the acknowledgement path forgets to hand
    the lock back, so the node stays locked (and unevictable) after the job ended."""
    from hicache_fsm.jobs import JobKind
    from hicache_fsm.outbox import Outbox

    orig = Outbox.apply

    def apply(self, completions, late=None):
        completions = list(completions)
        done = [self._pending.get(c.job_id) for c in completions if c.ok]
        out = orig(self, completions, late)
        for job in done:
            if job is None or job.kind is not JobKind.D2H:
                continue
            for node in (self.tree.get(i) for i in job.node_ids):
                if node is not None:
                    node.lock_ref += 1  # the copy's lock, never released
        return out

    p.setattr(Outbox, "apply", apply)


@_mutant("anchor_lock_leak_on_host_full", "lock leaked on a path that gives up because the host is full (a "
                                          "prefetch refused for host room keeps its anchor locked)", storage=True)
def _anchor_leak_host_full(p: Patcher) -> None:
    """Prefetch admission locks (or host-pins) the matched anchor before it asks the host for slots; when the
    host stays full it gives up, and here it forgets to release the anchor."""
    StorageTier = _tier().StorageTier
    orig = StorageTier.prefetch

    def prefetch(self, request_id, tokens, match, *a, **kw):
        refused = self.counters["prefetch_rejected_host_full"]
        out = orig(self, request_id, tokens, match, *a, **kw)
        anchor = match.last_host_node
        if self.counters["prefetch_rejected_host_full"] > refused and not anchor.is_root:
            if anchor.state in ON_HOST_STATES:
                self.ctx.pin_host(anchor)
            else:
                self.ctx.lock(anchor)
        return out

    from hicache_fsm.bindings.residency import ON_HOST as ON_HOST_STATES

    p.setattr(StorageTier, "prefetch", prefetch)


def _register_more() -> None:
    """The second to fifth sets (``testing.mutants_more``, ``mutants_third``, ``mutants_fourth``,
    ``mutants_fifth``), in the same registry."""
    from hicache_fsm.testing.mutants_fifth import FIFTH
    from hicache_fsm.testing.mutants_fourth import FOURTH
    from hicache_fsm.testing.mutants_more import MORE
    from hicache_fsm.testing.mutants_third import THIRD

    for name, bug, apply, variant in MORE + THIRD + FOURTH + FIFTH:
        MUTANTS[name] = Mutant(name, bug, apply, variant)


_register_more()
