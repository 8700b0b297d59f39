"""Forking a ``HiCache`` for the explorer: an independent copy in ~100-200 us, not a deep copy.

The explorer forks the state before every step; a generic deep copy costs ~2 ms.
Here the heavy parts are copied structurally (pools, allocators, tree, executor)
and what never changes is shared (see ``fork_cache``).
"""

from __future__ import annotations

import copy
import functools
import itertools
import weakref
from collections import Counter
from collections.abc import Callable

import attrs
import torch

from hicache_fsm.testing.interface import NotSupported

__all__ = ["fork_cache", "own_kv"]


def _fork_allocator(alloc, memo: dict):
    if id(alloc) not in memo:
        memo[id(alloc)] = alloc.fork()
    return memo[id(alloc)]


def _remake_views(pool, base, kv) -> None:
    """Point ``pool.kv`` at ``kv`` and re-make every other tensor attribute that viewed ``base``."""
    d = pool.__dict__
    for name, value in list(d.items()):
        if name == "kv" or type(value) is not torch.Tensor:
            continue
        if value._base is base:
            d[name] = kv.as_strided(value.size(), value.stride(), value.storage_offset())
        elif name != "kv":
            d[name] = value.clone()
    d["kv"] = kv


def _fork_pool(pool, memo: dict, share_kv: bool = False):
    """Copy a KV pool (buffer cloned, views re-made), or share its buffer until ``own_kv``."""
    if pool is None:
        return None
    if id(pool) in memo:
        return memo[id(pool)]
    new = object.__new__(type(pool))
    d = new.__dict__
    d.update(pool.__dict__)
    if not share_kv:
        _remake_views(new, pool.kv, pool.kv.clone())
    alloc = d.get("allocator")
    if alloc is not None:
        d["allocator"] = _fork_allocator(alloc, memo)
    memo[id(pool)] = new
    return new


def own_kv(*pools) -> None:
    """Give each pool a private copy of its KV buffer (after a fork that shared it)."""
    for pool in pools:
        if pool is not None:
            _remake_views(pool, pool.kv, pool.kv.clone())


_COPIERS: dict[type, Callable] = {}


def _node_copier(cls: type) -> Callable:
    """A generated function copying every slot of a ``cls`` instance (about 5x a getattr loop)."""
    fn = _COPIERS.get(cls)
    if fn is None:
        slots = [s for c in cls.__mro__ for s in getattr(c, "__slots__", ()) if s != "__weakref__"]
        body = "\n".join(f"    m.{s} = n.{s}" for s in slots) or "    pass"
        ns: dict = {"new": object.__new__, "cls": cls}
        exec(f"def copy_node(n):\n    m = new(cls)\n{body}\n    return m\n", ns)  # noqa: S102 - our own slot names
        fn = _COPIERS[cls] = ns["copy_node"]
    return fn


def _copy_tree_node(node):
    m = _node_copier(type(node))(node)
    m.pending_jobs = set(node.pending_jobs)
    if node.cp_meta is not None:
        m.cp_meta = copy.deepcopy(node.cp_meta)
    return m


def _fork_tree(tree, memo: dict):
    return tree.fork(_copy_tree_node, memo)


def _fork_manual_executor(ex, memo: dict):
    """Copy a ``ManualExecutor``: its pending copies are re-pointed at the copied pools."""
    ps = object.__new__(type(ex.pools))
    ps.__dict__.update({k: _fork_pool(v, memo) for k, v in ex.pools.__dict__.items()})
    new = ex.fork(ps, lambda c: attrs.evolve(c, device_pool=memo[id(c.device_pool)],
                                             host_pool=memo[id(c.host_pool)]))
    memo[id(ex)] = new
    return new


_ATOMIC = (int, float, str, bool, type(None), bytes)
# HiCache attributes that never change after construction (shared by forks)
_SHARED_ATTRS = ("config", "residency", "residency_registry", "_offsets")


def fork_cache(cache, memo: dict | None = None, share_kv: bool = False):
    """An independent copy of a ``HiCache`` driven by a ``ManualExecutor``, in ~100-200 us.

    The heavy parts are copied structurally: KV buffers (views re-made on the
    copy), allocators, the tree and the executor's pending jobs. What never
    changes is shared: config, compiled machine, frozen jobs and batches, and
    the slot-index tensors nodes hold (never written in place). The
    controller's parts fork themselves (``driver.fork``, ``outbox.fork``;
    eviction's candidate sets are rebuilt from the copied tree), and every
    other attribute is deep-copied with the same memo, so references to
    nodes, pools, the executor or the cache itself land on the copies, and a
    field added to ``HiCache`` later is still copied.
    """
    from hicache_fsm.executors import ManualExecutor
    from hicache_fsm.interfaces import Attached, TierContext

    memo = {} if memo is None else memo
    if not isinstance(cache.executor, ManualExecutor):
        raise NotSupported("fork needs a ManualExecutor (nothing may run behind the explorer's back)")
    from hicache_fsm.testing.storage import ManualStorageTier, fork_tier

    storage = getattr(cache, "storage", None)
    if storage is not None and not isinstance(storage, ManualStorageTier):
        raise NotSupported("fork of a cache whose storage tier runs threads (use ManualStorageTier)")
    if getattr(cache, "cp", None) is not None or (storage is None and cache.registered_runtimes):
        raise NotSupported("fork of a cache with CP or other registered runtimes is not implemented yet")
    new = object.__new__(type(cache))
    memo[id(cache)] = new
    d = new.__dict__
    d.update({k: v for k, v in cache.__dict__.items() if type(v) in _ATOMIC or k in _SHARED_ATTRS})
    for name in _SHARED_ATTRS:
        if name in cache.__dict__:
            memo[id(cache.__dict__[name])] = cache.__dict__[name]
    ex = cache.executor
    outbox = cache.outbox
    for job in itertools.chain(outbox.pending_jobs(), outbox.queued_jobs(), ex.pending_jobs()):
        memo[id(job)] = job
    for batch in ex.submitted:
        memo[id(batch)] = batch
    for name in ("device_pool", "host_pool", "draft_device_pool", "draft_host_pool"):
        d[name] = _fork_pool(getattr(cache, name), memo, share_kv)
    d["executor"] = _fork_manual_executor(ex, memo)
    d["tree"] = _fork_tree(cache.tree, memo)
    d["engine_pages"] = cache.engine_pages.copy()
    d["counters"] = Counter(cache.counters)
    d["group"], d["agreement"] = _copy_value(cache.group, memo), _copy_value(cache.agreement, memo)
    driver = cache.driver.fork(new.tree, Attached())
    new.compose(driver, outbox.fork(new.tree, driver, new.executor, driver.attached, new.counters, new.agreement,
                                    memo, lambda h: _fork_handle(h, memo, new)))
    if storage is not None:
        new.storage = fork_tier(storage, memo, TierContext.of(new))
        # the tier's registered owners and checks are bound to the old tier (copying them would copy it
        # whole): the copy starts empty and the forked tier registers its own below
        checks = copy.copy(cache.runtime_checks)
        checks.clear()
        d["runtime_checks"] = checks
    for name, value in cache.__dict__.items():
        if name not in d:
            d[name] = _copy_value(value, memo)
    new.eviction.rebuild()
    if storage is not None:  # the tier registered its slot owners and invariants: re-bind them to the copy
        new.unregister_runtimes()
        new.register_host_owner(new.storage.runtime.host_owners)
        new.register_invariants(new.storage.violations)
    return new


def _fork_handle(handle, memo: dict, cache):
    """Copy a ``LoadHandle``: re-point it at the forked cache and executor, keep its dependencies."""
    from hicache_fsm.executors import ManualWait

    if id(handle) in memo:
        return memo[id(handle)]
    wait = handle.bound_wait
    if isinstance(wait, ManualWait):
        wait = ManualWait(cache.executor, wait.job_ids, wait.layers, wait.load)
    deps = tuple(_fork_handle(h, memo, cache) for h in handle.deps)
    new = memo[id(handle)] = handle.replica(cache, deps, wait)
    return new


def _copy_value(value, memo: dict):
    """Deep copy, with fast paths for atoms, containers of atoms and attrs records of them."""
    if isinstance(value, _ATOMIC):
        return value
    if id(value) in memo:
        return memo[id(value)]
    t = type(value)
    if t in (set, frozenset, list, tuple) and all(isinstance(v, _ATOMIC) for v in value):
        return t(value)
    if t in (dict, Counter) and all(isinstance(v, _ATOMIC) for v in value.values()):
        return t(value)
    if t in (list, tuple):
        out = [_copy_value(v, memo) for v in value]
        return out if t is list else tuple(out)
    if t is weakref.ref:  # deepcopy keeps weak references as they are
        return value
    if attrs.has(t) and not getattr(t, "__attrs_frozen__", False) is True:
        fields = attrs.fields(t)
        if all(f.init for f in fields):
            return t(**{f.name: _copy_value(getattr(value, f.name), memo) for f in fields})
    slots = _plain_slots(t)
    if slots is not None:
        new = object.__new__(t)
        memo[id(value)] = new
        if hasattr(value, "__dict__"):
            new.__dict__.update({k: _copy_value(v, memo) for k, v in value.__dict__.items()})
        for name in slots:
            if hasattr(value, name):
                setattr(new, name, _copy_value(getattr(value, name), memo))
        return new
    return copy.deepcopy(value, memo)


@functools.cache
def _plain_slots(t: type) -> tuple[str, ...] | None:
    """The slots of a class whose instances ``copy.deepcopy`` copies attribute by attribute (no copy hooks,
    no custom ``__new__``), so ``_copy_value`` can do the same without deepcopy's generic machinery; None
    for any other class."""
    if (hasattr(t, "__deepcopy__") or t.__reduce_ex__ is not object.__reduce_ex__ or t.__reduce__ is not object.__reduce__
            or getattr(t, "__getstate__", None) is not object.__getstate__ or hasattr(t, "__setstate__")
            or t.__new__ is not object.__new__ or t.__module__ == "builtins"):
        return None
    slots = []
    for c in t.__mro__:
        declared = getattr(c, "__slots__", ())
        slots += [declared] if isinstance(declared, str) else [s for s in declared if s not in ("__dict__", "__weakref__")]
    return tuple(slots)
