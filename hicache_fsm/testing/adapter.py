"""Adapters: the one interface the protocol fuzzers drive a cache through.

A ``CacheAdapter`` speaks in token sequences, not in the cache's own objects,
so the same stateful machine (``stateful.py``) and the same bounded explorer
(``explorer.py``) run against any prefix cache: ``HiCacheAdapter`` wraps our
``HiCache`` with a ``ManualExecutor`` (every job waits until the driver
completes or fails it, so every acknowledgement order is reachable), and
``docs/fuzzing.md`` adapts a small two-tier LRU cache written for the example.

Operations, all optional except ``insert``, ``match``, ``read_kv`` and
``invariant_violations``:

=====================  ==========================================================
insert(tokens)         compute KV for ``tokens`` and hand it to the cache -> bool
match(tokens)          longest cached prefix -> ``MatchInfo`` (counts as a hit)
lock / unlock          pin a matched prefix on the device (engine-held lock ids)
pin_host / unpin_host  pin the host copy of the node that ends at ``tokens``
evict / evict_host     free at least N tokens of a tier -> tokens freed
load_back(tokens)      start loading the host-only part of a match -> tokens
backup(tokens)         back up the device-only node ending at ``tokens`` -> bool
pending_jobs()         jobs in flight; ``complete_job`` / ``fail_job`` end one
redeliver(job_id)      acknowledge a finished job again (must be ``Rejected``)
prefetch(tokens)       storage prefetch of what memory lacks of a prompt -> request
prefetching()          requests whose prefetch is still running (``JobInfo``)
prefetch_ready / abort poll a prefetch like a scheduler step / abort its request
storage_fault(fault)   make the storage tier raise / time out as scheduled
storage_steps()        queued storage work; ``complete_storage`` / ``fail_storage``
                       run one (hit query, S2H transfer, H2S backup, probe)
store_remote(tokens)   another instance sharing the storage tier stores a prompt's KV
read_kv(tokens)        per token, the KV fingerprint read from each valid copy
=====================  ==========================================================

An operation the adapter does not override raises ``NotSupported``; the
stateful machine and the explorer consult ``supports(name)`` and never pick
it. A cache that refuses an operation with its documented error is reported
as ``Rejected``; the fuzzers then check that nothing changed (``snapshot``).

KV content is checked end to end: ``insert`` writes, for token ``i`` of a
prompt, a value derived from the prefix ``tokens[:i+1]`` (``kv_fingerprint``)
into every layer, exactly as a transformer's KV depends only on the tokens up
to it. ``read_kv`` reads back every copy the cache claims is valid (device,
host, ...); any copy that differs from the fingerprint is a lost or stale copy.
"""

from __future__ import annotations

import copy
import functools
import itertools
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import attrs
import torch

__all__ = [
    "CORRUPT",
    "OPTIONAL_OPS",
    "CacheAdapter",
    "HiCacheAdapter",
    "JobInfo",
    "MatchInfo",
    "NotSupported",
    "Occupancy",
    "Rejected",
    "StorageFault",
    "decode_kv_lists",
    "encode_kv",
    "kv_fingerprint",
]

FP_LIMIT = 1 << 17  # fingerprint * 64 + layer stays exact in float32
MAX_LAYERS = 64
CORRUPT = -1  # what ``decode`` returns for a token whose layers / K / V disagree


class NotSupported(Exception):
    """The adapter does not implement this operation; rules that need it are skipped."""


class Rejected(Exception):
    """The cache refused the operation with its documented error; it must have changed nothing."""


@attrs.frozen
class MatchInfo:
    """Tokens of a prompt served from the device, then from the host (after the device part)."""

    device_tokens: int
    host_tokens: int = 0

    @property
    def total(self) -> int:
        return self.device_tokens + self.host_tokens


@attrs.frozen
class JobInfo:
    """One job in flight: its id, kind (``d2h``, ``h2d``, ``h2s``, ``s2h``, ...) and a description."""

    id: int
    kind: str
    detail: tuple = ()


@attrs.frozen
class Occupancy:
    """Tokens in use per tier (used to check that evictions report what they freed)."""

    device_tokens: int
    host_tokens: int = 0


@attrs.frozen
class StorageFault:
    """One scheduled storage failure: calls of ``call`` after the ``after``-th fail ``count`` times.

    ``kind`` is ``raise`` (the backend raises), ``timeout`` (the call times
    out), ``short`` (a batch returns fewer pages) or ``corrupt`` (a page
    fails its checksum). ``call`` is ``get``, ``set``, ``exists`` or ``any``.
    """

    kind: str
    call: str = "any"
    after: int = 0
    count: int = 1


def kv_fingerprint(prefix: Sequence[int]) -> int:
    """The value ``insert`` writes for the last token of ``prefix`` (deterministic across runs)."""
    return hash(tuple(prefix)) % (FP_LIMIT - 1) + 1


def fingerprints(tokens: Sequence[int]) -> list[int]:
    tokens = tuple(tokens)
    return [kv_fingerprint(tokens[: i + 1]) for i in range(len(tokens))]


def encode_kv(tokens: Sequence[int], layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V, each ``(layers, len(tokens), 1, 1)`` float32, carrying each token's fingerprint."""
    if not 0 < layers <= MAX_LAYERS:
        raise ValueError(f"layers must be in [1, {MAX_LAYERS}]")
    fp = torch.tensor(fingerprints(tokens), dtype=torch.float32)
    k = fp[None, :] * MAX_LAYERS + torch.arange(layers, dtype=torch.float32)[:, None]
    k = k[:, :, None, None]
    return k, -k


@functools.lru_cache(maxsize=4096)
def _encoded(tokens: tuple[int, ...], layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    return encode_kv(tokens, layers)


@functools.lru_cache(maxsize=1 << 16)
def _prefix_fingerprints(tokens: tuple[int, ...]) -> list[int]:
    return fingerprints(tokens)


def decode_kv_lists(k: list, v: list, slot: int) -> int:
    """Fingerprint stored at ``slot`` of K / V given as nested lists ``[layer][slot][0][0]``."""
    first = k[0][slot][0][0]
    fp = int(first) // MAX_LAYERS
    if fp <= 0:
        return CORRUPT
    for layer in range(len(k)):
        want = float(fp * MAX_LAYERS + layer)
        if k[layer][slot][0][0] != want or v[layer][slot][0][0] != -want:
            return CORRUPT
    return fp


# The operations a subclass may leave out (the base raises NotSupported).
OPTIONAL_OPS = (
    "lock", "unlock", "held_locks", "pin_host", "unpin_host", "held_pins", "evict", "evict_host",
    "load_back", "backup", "complete_job", "fail_job", "redeliver", "prefetch", "prefetching", "prefetch_ready",
    "abort", "storage_fault", "storage_steps", "stored_prefix", "store_remote", "complete_storage", "fail_storage",
    "occupancy",
    "snapshot",
    "state_key", "size",
)


class CacheAdapter:
    """Drive a prefix KV cache through token sequences; see the module docstring.

    Subclasses implement ``insert``, ``match``, ``read_kv`` and
    ``invariant_violations`` and whichever optional operations their cache
    has. ``page_size`` is the token granularity (prompts are cut to whole pages).
    """

    name = "cache"
    page_size = 1

    # ------------------------------------------------------------------ capability

    def supports(self, op: str) -> bool:
        """True when this adapter overrides ``op`` (or ``pending_jobs`` returns jobs)."""
        mine = getattr(type(self), op, None)
        base = getattr(CacheAdapter, op, None)
        return mine is not None and mine is not base

    # ------------------------------------------------------------------ required

    def insert(self, tokens: Sequence[int]) -> bool:
        """Compute KV for ``tokens`` (whole pages) and insert it; False when there is no room."""
        raise NotImplementedError

    def match(self, tokens: Sequence[int]) -> MatchInfo:
        raise NotImplementedError

    def read_kv(self, tokens: Sequence[int]) -> list[tuple[int, ...]]:
        """For each token of the longest cached prefix of ``tokens`` that some tier can serve
        now, the fingerprints read from every copy the cache claims is valid (stop at the first
        token with none). Must not change the cache (no hit counts, no splits)."""
        raise NotImplementedError

    def invariant_violations(self) -> list[str]:
        raise NotImplementedError

    # ------------------------------------------------------------------ optional

    def read_kv_many(self, prompts: Iterable[Sequence[int]]) -> dict[tuple, list[tuple[int, ...]]]:
        return {tuple(p): self.read_kv(p) for p in prompts}

    def kv_violations(self) -> list[str]:
        """Optional: check *every* cached token's valid copies against ``kv_fingerprint`` at once
        (faster than reading prompt by prompt). Raise ``NotSupported`` to use ``read_kv``."""
        raise NotSupported("kv_violations")

    def lock(self, tokens: Sequence[int]) -> int | None:
        """Match ``tokens`` and lock the device part; a lock id, or None when nothing is on the device."""
        raise NotSupported("lock")

    def unlock(self, lock_id: int) -> None:
        raise NotSupported("unlock")

    def held_locks(self) -> list[int]:
        raise NotSupported("held_locks")

    def pin_host(self, tokens: Sequence[int]) -> int | None:
        raise NotSupported("pin_host")

    def unpin_host(self, pin_id: int) -> None:
        raise NotSupported("unpin_host")

    def held_pins(self) -> list[int]:
        raise NotSupported("held_pins")

    def evict(self, num_tokens: int) -> int:
        raise NotSupported("evict")

    def evict_host(self, num_tokens: int) -> int:
        raise NotSupported("evict_host")

    def load_back(self, tokens: Sequence[int]) -> int:
        raise NotSupported("load_back")

    def backup(self, tokens: Sequence[int]) -> bool | None:
        """True: backup started; False: refused for lack of room; None: no such device-only node."""
        raise NotSupported("backup")

    def pending_jobs(self) -> list[JobInfo]:
        """Jobs in flight (a synchronous cache has none)."""
        return []

    def complete_job(self, job_id: int) -> None:
        raise NotSupported("complete_job")

    def fail_job(self, job_id: int) -> None:
        raise NotSupported("fail_job")

    def finished_jobs(self) -> list[int]:
        """Ids of jobs already completed or failed (candidates for ``redeliver``)."""
        return []

    def redeliver(self, job_id: int) -> None:
        """Deliver a finished job's acknowledgement again; a correct cache raises ``Rejected``."""
        raise NotSupported("redeliver")

    def poll(self) -> None:
        """One engine step with nothing else to do (flush queued work)."""

    def prefetch(self, tokens: Sequence[int]) -> Hashable | None:
        """Start prefetching ``tokens`` from storage; a request id, or None when not admitted."""
        raise NotSupported("prefetch")

    def prefetching(self) -> list[JobInfo]:
        """Prefetches in flight (``id``: the request; ``detail``: its tokens)."""
        return []

    def prefetch_ready(self, request: Hashable) -> bool:
        """Poll a prefetch like a scheduler step: True once it ended (then it leaves ``prefetching``)."""
        raise NotSupported("prefetch_ready")

    def abort(self, request: Hashable) -> None:
        """The request was aborted mid-prefetch; it leaves ``prefetching``."""
        raise NotSupported("abort")

    def storage_fault(self, fault: StorageFault) -> None:
        raise NotSupported("storage_fault")

    def storage_steps(self) -> list:
        """Queued storage work the driver may run (objects with an ``id``); empty when none."""
        return []

    def stored_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of ``tokens`` the storage tier holds (no side effects)."""
        raise NotSupported("stored_prefix")

    def store_remote(self, tokens: Sequence[int]) -> int:
        """Another cache sharing the storage tier stores the KV of ``tokens`` there -> tokens written."""
        raise NotSupported("store_remote")

    def complete_storage(self, step_id: Hashable) -> None:
        """Run one queued storage step (hit query, transfer, backup) now."""
        raise NotSupported("complete_storage")

    def fail_storage(self, step_id: Hashable) -> None:
        """Run one queued storage step with its backend call failing."""
        raise NotSupported("fail_storage")

    def occupancy(self) -> Occupancy:
        raise NotSupported("occupancy")

    def snapshot(self) -> Any:
        """A comparable picture of the whole cache (checks that a rejected call changed nothing)."""
        raise NotSupported("snapshot")

    def state_key(self) -> Hashable:
        """A canonical, hashable abstraction of the state (the explorer's visited set)."""
        raise NotSupported("state_key")

    def size(self) -> int:
        """Number of entries (tree nodes); the explorer bounds it."""
        raise NotSupported("size")

    def machines(self) -> list:
        """Compiled state machines to listen to (coverage)."""
        return []

    def prompt_steps(self, prompt: tuple[int, ...]) -> list:
        """The explorer's extra steps on ``prompt`` for operations of this cache only (``checks.Step``)."""
        return []

    def extra_steps(self) -> list:
        """The explorer's extra steps that take no prompt (``checks.Step``), tried in every state."""
        return []

    def applicable(self, op: str, args: tuple) -> bool:
        """False only when running ``op(*args)`` now surely changes nothing, or has exactly the
        effect of another step the explorer also tries (it skips the clone). Default: True."""
        return True

    def clone(self) -> CacheAdapter:
        """An independent copy (the explorer forks states); deep copy by default."""
        return copy.deepcopy(self)

    def close(self) -> None:
        pass

    def describe(self) -> str:
        return self.name


# =========================================================================== HiCache


@functools.cache
def _residency_spec():
    from hicache_fsm.spec import load_builtin

    return load_builtin("residency")


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
    d["engine_pages"] = set(cache.engine_pages)
    d["counters"] = Counter(cache.counters)
    d["group"], d["agreement"] = _copy_value(cache.group, memo), _copy_value(cache.agreement, memo)
    driver = cache.driver.fork(new.tree, Attached())
    new.compose(driver, outbox.fork(new.tree, driver, new.executor, driver.attached, new.counters, new.agreement,
                                    memo, lambda h: _fork_handle(h, memo, new)))
    if storage is not None:
        new.storage = fork_tier(storage, memo, TierContext.of(new))
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
    if attrs.has(t) and not getattr(t, "__attrs_frozen__", False) is True:
        fields = attrs.fields(t)
        if all(f.init for f in fields):
            return t(**{f.name: _copy_value(getattr(value, f.name), memo) for f in fields})
    return copy.deepcopy(value, memo)


class HiCacheAdapter(CacheAdapter):
    """``CacheAdapter`` over our ``HiCache`` with tiny pools and a ``ManualExecutor``.

    Pools hold ``device_pages`` / ``host_pages`` pages of ``page_size`` tokens,
    ``layers`` layers, one head of dimension one (a token's KV is its
    fingerprint). Other keyword arguments go to ``CacheConfig`` (``write_policy``,
    ``eviction_policy``, ...). ``dispatcher`` shares one compiled residency
    machine between adapters (coverage listeners); by default each adapter
    compiles its own from the registry as it is now (so a mutant patched into
    the registry is picked up). ``storage=True`` attaches an L3 tier run step by
    step (``testing.storage.ManualStorageTier`` over ``memory://`` behind a
    ``FaultyBackend`` whose schedule is ``self.faults``), with prefetches of one
    page and up, ``stop_policy`` and ``batch_pages`` as given.
    """

    name = "hicache"

    def __init__(self, *, device_pages: int = 4, host_pages: int = 4, page_size: int = 1, layers: int = 2,
                 host_layout: str = "layer_first", dispatcher=None, storage: bool = False,
                 stop_policy: str = "best_effort", batch_pages: int = 2, **config: Any) -> None:
        from hicache_fsm.cache import HiCache
        from hicache_fsm.config import CacheConfig
        from hicache_fsm.executors import ManualExecutor
        from hicache_fsm.machine import compile_machine
        from hicache_fsm.pools import DeviceKVPool, HostKVPool, KVShape

        shape = KVShape(layers, 1, 1)
        self.page_size = page_size
        self.layers = layers
        self.device_pool = DeviceKVPool(shape, device_pages * page_size, page_size, "cpu")
        self.host_pool = HostKVPool(shape, host_pages * page_size, page_size, host_layout, pin_memory=False)
        self.executor = ManualExecutor(self.device_pool, self.host_pool)
        machine = dispatcher if dispatcher is not None else compile_machine(_residency_spec())
        self.config = CacheConfig(**config)
        self.cache = HiCache(self.device_pool, self.host_pool, self.config, self.executor, dispatcher=machine)
        self._locks: dict[int, Any] = {}
        self._pins: dict[int, tuple[Any, tuple[int, ...], int]] = {}
        self._next_handle = 1
        self._finished: list[int] = []
        self.symmetric = True  # state_key identifies caches that differ by a renaming of token ids
        self.track_hits = False  # state_key tells hit from never-hit nodes even when the policy ignores hits
        self._kv_shared = False  # True after clone(): the KV buffers are shared until one side writes
        self._kv_writes = 0  # bumped before every write into the pools (read_kv caches per value)
        self._lists = None
        self._requests: dict[int, tuple[int, ...]] = {}  # prefetches the engine is waiting for
        self._next_request = 1
        self.faults = None
        self.backend = None
        if storage:
            self._attach_storage(stop_policy, batch_pages)

    def _attach_storage(self, stop_policy: str, batch_pages: int) -> None:
        """L3 on a ``memory://`` backend behind a ``FaultyBackend``, run step by step (``ManualStorageTier``)."""
        from hicache_fsm.storage import open_backend
        from hicache_fsm.storage.faults import FaultyBackend
        from hicache_fsm.testing.storage import FaultPlan, ManualStorageTier

        self.faults = FaultPlan()
        self.backend = FaultyBackend(open_backend("memory://"), self.faults)
        ManualStorageTier.attach_to(
            self.cache, self.backend, prefetch_threshold=self.page_size, stop_policy=stop_policy,
            prefetch_capacity_tokens=self.host_pool.size_tokens, batch_pages=batch_pages, retry_interval=0.0)

    def describe(self) -> str:
        c = self.config
        storage = ", storage" if self.cache.storage is not None else ""
        return (f"hicache(device={self.device_pool.allocator.total_pages}, host={self.host_pool.allocator.total_pages}, "
                f"page={self.page_size}, layers={self.layers}, {c.write_policy}, {c.eviction_policy}{storage})")

    def supports(self, op: str) -> bool:
        if op in STORAGE_OPS and self.cache.storage is None:
            return False
        return super().supports(op)

    # ------------------------------------------------------------------ helpers

    def _aligned(self, tokens: Sequence[int]) -> tuple[int, ...]:
        tokens = tuple(tokens)
        return tokens[: len(tokens) - len(tokens) % self.page_size]

    def _exact_node(self, tokens: Sequence[int]):
        """The node whose run ends exactly at ``tokens`` (no split), or None."""
        tokens = self._aligned(tokens)
        if not tokens:
            return None
        path, matched, partial = self.cache.tree.walk(tokens)
        if partial or matched != len(tokens) or not path:
            return None
        return path[-1]

    def _handle(self) -> int:
        h = self._next_handle
        self._next_handle += 1
        return h

    # ------------------------------------------------------------------ operations

    def insert(self, tokens: Sequence[int]) -> bool:
        tokens = self._aligned(tokens)
        if not tokens:
            return False
        idx = self.cache.alloc_device(len(tokens))
        if idx is None:
            self.cache.flush()
            return False
        k, v = _encoded(tokens, self.layers)
        self._own_kv()
        self._kv_writes += 1
        self.device_pool.write(idx, None, k, v)
        self.cache.insert(tokens, idx)
        self.cache.flush()
        return True

    def match(self, tokens: Sequence[int]) -> MatchInfo:
        m = self.cache.match_prefix(self._aligned(tokens))
        self.cache.flush()
        return MatchInfo(m.device_hit_length, m.host_hit_length)

    def lock(self, tokens: Sequence[int]) -> int | None:
        m = self.cache.match_prefix(self._aligned(tokens))
        self.cache.flush()
        node = m.last_device_node
        if node.is_root:
            return None
        self.cache.lock(node)
        h = self._handle()
        self._locks[h] = node
        return h

    def unlock(self, lock_id: int) -> None:
        from hicache_fsm.errors import LockError, UnknownNode

        node = self._locks.get(lock_id)
        if node is None:
            raise Rejected(f"lock {lock_id} is not held")
        try:
            self.cache.unlock(node)
        except (LockError, UnknownNode) as exc:
            raise Rejected(str(exc)) from None
        del self._locks[lock_id]

    def held_locks(self) -> list[int]:
        return list(self._locks)

    def pin_host(self, tokens: Sequence[int]) -> int | None:
        from hicache_fsm.bindings.residency import ON_HOST

        node = self._exact_node(tokens)
        if node is None or node.state not in ON_HOST:
            return None
        self.cache.pin_host(node)
        h = self._handle()
        tree = self.cache.tree
        self._pins[h] = (node, tree.prefix_tokens(node), len(tree.prefix_tokens(node.parent)))
        return h

    def unpin_host(self, pin_id: int) -> None:
        from hicache_fsm.errors import LockError, UnknownNode

        pin = self._pins.get(pin_id)
        if pin is None:
            raise Rejected(f"pin {pin_id} is not held")
        try:
            self.cache.unpin_host(pin[0])
        except (LockError, UnknownNode) as exc:
            raise Rejected(str(exc)) from None
        del self._pins[pin_id]

    def held_pins(self) -> list[int]:
        return list(self._pins)

    def evict(self, num_tokens: int) -> int:
        freed = self.cache.evict(num_tokens)
        self.cache.flush()
        return freed

    def evict_host(self, num_tokens: int) -> int:
        freed = self.cache.evict_host(num_tokens)
        self.cache.flush()
        return freed

    def load_back(self, tokens: Sequence[int]) -> int:
        m = self.cache.match_prefix(self._aligned(tokens))
        if m.host_hit_length == 0:
            self.cache.flush()
            return 0
        lb = self.cache.load_back(m.last_host_node)
        self.cache.flush()
        return 0 if lb is None else int(lb.device_indices.numel())

    def backup(self, tokens: Sequence[int]) -> bool | None:
        node = self._exact_node(tokens)
        if node is None or node.state != "device":
            return None
        ok = self.cache.write_backup(node)
        self.cache.flush()
        return ok

    def pending_jobs(self) -> list[JobInfo]:
        self.cache.flush()
        return [JobInfo(j.id, j.kind.value, tuple(j.node_ids)) for j in self.executor.pending_jobs()]

    def _own_kv(self) -> None:
        if self._kv_shared:
            own_kv(self.device_pool, self.host_pool)
            self._kv_shared = False

    def complete_job(self, job_id: int) -> None:
        self._own_kv()
        self._kv_writes += 1
        self.executor.complete(job_id)
        self.cache.poll()
        self._finished.append(job_id)

    def fail_job(self, job_id: int) -> None:
        self.executor.fail(job_id)
        self.cache.poll()
        self._finished.append(job_id)

    def finished_jobs(self) -> list[int]:
        return list(self._finished[-4:])

    def redeliver(self, job_id: int) -> None:
        from hicache_fsm.errors import UnknownJob
        from hicache_fsm.jobs import Completion

        try:
            self.cache.complete(Completion(job_id, True))
        except UnknownJob as exc:
            raise Rejected(str(exc)) from None

    def poll(self) -> None:
        self.cache.poll()

    # ------------------------------------------------------------------ storage (L3)

    def prefetch(self, tokens: Sequence[int]) -> Hashable | None:
        """Match ``tokens`` and prefetch what memory lacks from storage, as an engine admitting a request."""
        tokens = self._aligned(tokens)
        m = self.cache.match_prefix(tokens)
        rid = self._next_request
        ok = self.cache.prefetch(rid, tokens, m)
        self.cache.flush()
        if not ok:
            return None
        self._next_request += 1
        self._requests[rid] = tokens
        return rid

    def prefetching(self) -> list[JobInfo]:
        """Requests whose prefetch the engine still waits for (id = request id, detail = tokens)."""
        return [JobInfo(rid, "prefetch", tokens) for rid, tokens in self._requests.items()]

    def prefetch_ready(self, request: Hashable) -> bool:
        """The scheduler's per-step check; True once the prefetch ended (its pages are in the tree)."""
        if request not in self._requests:
            raise Rejected(f"request {request!r} has no prefetch")
        ready = self.cache.prefetch_ready(request)
        self.cache.flush()
        if ready:
            del self._requests[request]
        return ready

    def abort(self, request: Hashable) -> bool:
        """The request was aborted: its prefetch must end and release everything."""
        if request not in self._requests:
            raise Rejected(f"request {request!r} has no prefetch")
        had = self.cache.abort_prefetch(request)
        self.cache.flush()
        del self._requests[request]
        return had

    def storage_fault(self, fault: StorageFault) -> None:
        self.faults.arm(fault)

    def store_remote(self, tokens: Sequence[int]) -> int:
        """Another engine instance sharing this L3 (same model and key namespace) backs ``tokens`` up:
        their KV pages land in storage under the same chained keys; pages stored already are kept.
        Returns the tokens written. Nothing in this cache changes."""
        from hicache_fsm.pools import HostKVPool
        from hicache_fsm.storage.keys import page_keys
        from hicache_fsm.storage.page_format import page_format_of

        tokens = self._aligned(tokens)
        if not tokens or self.backend is None:
            return 0
        ps = self.page_size
        scratch = HostKVPool(self.host_pool.shape, len(tokens), ps, self.host_pool.layout, pin_memory=False)
        k, v = _encoded(tokens, self.layers)
        scratch.write(torch.arange(len(tokens)), k, v)
        values = [scratch.read_page(p).numpy().tobytes() for p in range(len(tokens) // ps)]
        stored = self.backend.inner.batch_set(page_keys(tokens, ps, None), values, page_format_of(scratch))
        return sum(stored) * ps

    def stored_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of ``tokens`` storage holds (read without faults or side effects)."""
        from hicache_fsm.storage.keys import page_keys

        tokens = self._aligned(tokens)
        if not tokens or self.backend is None:
            return 0
        keys = page_keys(tokens, self.page_size, None)
        return self.backend.inner.batch_exists(keys) * self.page_size

    def storage_steps(self) -> list:
        """Queued storage work (``StorageStep``: hit queries, S2H transfers, H2S backups, a probe)."""
        return [] if self.cache.storage is None else self.cache.storage.steps()

    def _run_storage(self, step_id: str, fail: bool) -> None:
        if step_id not in {s.id for s in self.cache.storage.steps()}:
            raise Rejected(f"storage step {step_id!r} is not queued")
        if fail:
            self.faults.fail_next()
        self._own_kv()
        self._kv_writes += 1  # an S2H transfer writes host pages
        try:
            self.cache.storage.run(step_id)
        finally:
            self.faults.clear_next()  # a step that made no backend call leaves no failure armed
        self.cache.poll()

    def complete_storage(self, step_id: str) -> None:
        """Run one queued storage step (armed ``storage_fault`` records may still fail its calls)."""
        self._run_storage(step_id, False)

    def fail_storage(self, step_id: str) -> None:
        """Run one queued storage step with its first backend call raising ``StorageError``."""
        self._run_storage(step_id, True)

    def storage_violations(self) -> list[str]:
        """``stored_means_stored``: a node in a ``*_stored`` state has every page in storage, byte for byte
        its host copy (pages a scheduled corrupt fault damaged are exempt)."""
        from hicache_fsm.storage.page_format import page_format_of

        tier = self.cache.storage
        if tier is None or self.backend is None or tier.link.state != "attached":
            return []
        inner = self.backend.inner
        problems = []
        for node in self.cache.tree.nodes():
            if node.is_root or not node.state.endswith("_stored"):
                continue
            keys = list(tier.keys_for(node))
            pages = _host_pages(node.host_indices, self.page_size)
            blobs = inner.batch_get(keys, page_format_of(self.host_pool))
            for i, (key, blob) in enumerate(zip(keys, blobs)):
                if key in self.faults.corrupted:
                    continue
                if blob is None:
                    problems.append(f"stored_means_stored: node {node.id} ({node.state}) page {i} is not in storage")
                    break
                if i < len(pages) and bytes(blob) != self.host_pool.read_page(pages[i]).numpy().tobytes():
                    problems.append(f"stored_means_stored: node {node.id} ({node.state}) page {i}: storage holds "
                                    f"other bytes than its host copy")
                    break
        return problems

    def occupancy(self) -> Occupancy:
        ps = self.page_size
        return Occupancy(self.device_pool.allocator.used_pages * ps, self.host_pool.allocator.used_pages * ps)

    def snapshot(self) -> Any:
        return (self.cache.snapshot(), sorted(self._locks), sorted(self._pins))

    def size(self) -> int:
        return len(self.cache.tree)

    def machines(self) -> list:
        tier = self.cache.storage
        if tier is None:
            return [self.cache.residency]
        return [self.cache.residency, tier.runtime.machine, tier.link_machine]

    def close(self) -> None:
        self.cache.close()

    # ------------------------------------------------------------------ reading KV back

    def _pool_lists(self):
        if self._lists is not None and self._lists[0] is self.device_pool.kv and self._lists[1] is self.host_pool.kv \
                and self._lists[2] == self._kv_writes:
            return self._lists[3]
        lists = self._read_pools()
        self._lists = (self.device_pool.kv, self.host_pool.kv, self._kv_writes, lists)
        return lists

    def _read_pools(self) -> tuple[list[int], list[int]]:
        """The fingerprint held by every device slot and every host slot (``CORRUPT`` if inconsistent)."""
        out = []
        for pool in (self.device_pool, self.host_pool):
            k, v = pool.read(torch.arange(pool.size_tokens))
            k, v = k.tolist(), v.tolist()
            out.append([decode_kv_lists(k, v, slot) for slot in range(pool.size_tokens)])
        return out[0], out[1]

    def _read(self, tokens: tuple[int, ...], lists) -> list[tuple[int, ...]]:
        from hicache_fsm.bindings.residency import LOADING, ON_DEVICE, ON_HOST

        dev_fp, host_fp = lists
        tree = self.cache.tree
        tokens = tree.aligned(tokens)
        path, matched, partial = tree.walk(tokens)
        parts = [(n, n.num_tokens) for n in path]
        if partial:
            parent = path[-1] if path else tree.root
            child = parent.children.get(tree.child_key(None, tokens, matched))
            if child is not None:
                parts.append((child, partial))
        out: list[tuple[int, ...]] = []
        for node, n in parts:
            dev = node.device_indices.tolist() if node.state in ON_DEVICE and node.device_indices is not None else None
            host = node.host_indices.tolist() if (node.state in ON_HOST and node.host_indices is not None) else None
            if node.state in LOADING:
                dev = None  # the device copy is valid only once the load is acknowledged
            if dev is None and host is None:
                break
            for i in range(n):
                if dev is not None and host is not None:
                    out.append((dev_fp[dev[i]] if i < len(dev) else CORRUPT, host_fp[host[i]] if i < len(host) else CORRUPT))
                elif dev is not None:
                    out.append((dev_fp[dev[i]] if i < len(dev) else CORRUPT,))
                else:
                    out.append((host_fp[host[i]] if i < len(host) else CORRUPT,))
        return out

    def read_kv(self, tokens: Sequence[int]) -> list[tuple[int, ...]]:
        return self._read(tuple(tokens), self._pool_lists())

    def kv_violations(self) -> list[str]:
        from hicache_fsm.bindings.residency import LOADING, ON_DEVICE, ON_HOST

        dev_fp, host_fp = self._pool_lists()
        tree = self.cache.tree
        problems = []
        stack = [(tree.root, ())]
        while stack:
            node, before = stack.pop()
            for child in node.children.values():
                stack.append((child, before + child.key))
            if node.parent is None:
                continue
            want = _prefix_fingerprints(before)[-node.num_tokens:]
            state = node.state
            for tier, fps, idx, valid in (
                ("device", dev_fp, node.device_indices, state in ON_DEVICE and state not in LOADING),
                ("host", host_fp, node.host_indices, state in ON_HOST),
            ):
                if not valid or idx is None:
                    continue
                got = [fps[i] for i in idx.tolist()]
                if got != want:
                    i = next(i for i, (g, w) in enumerate(zip(got + [None] * len(want), want)) if g != w)
                    problems.append(f"kv_readback: node {node.id} ({state}) token {len(before) - node.num_tokens + i} "
                                    f"of prefix {list(before)}: its {tier} copy reads {got[i] if i < len(got) else None}, "
                                    f"{want[i]} was written")
        return problems

    def read_kv_many(self, prompts: Iterable[Sequence[int]]) -> dict[tuple, list[tuple[int, ...]]]:
        lists = self._pool_lists()
        return {tuple(p): self._read(tuple(p), lists) for p in prompts}

    # ------------------------------------------------------------------ invariants

    def invariant_violations(self) -> list[str]:
        problems = list(self.cache.invariant_violations())
        problems += hicache_structure_violations(self.cache)
        problems += self._engine_ref_violations()
        problems += self.storage_violations()
        return problems

    def _engine_ref_violations(self) -> list[str]:
        """Lock and host-pin counts equal what the engine (this adapter) holds."""
        tree = self.cache.tree
        want_lock: Counter[int] = Counter()
        for node in self._locks.values():
            if not tree.owns(node):
                return [f"locks: locked node {node.id} left the tree"]
            for n in tree.path_to_root(node):
                want_lock[n.id] += 1
        want_pin: Counter[int] = Counter()
        for node, _, _ in self._pins.values():  # a host pin covers the pinned node only, never its split-off half
            if not tree.owns(node):
                return [f"pins: host-pinned node {node.id} left the tree"]
            want_pin[node.id] += 1
        tier = self.cache.storage
        for op in (tier.runtime.active.values() if tier is not None else ()):  # prefetch anchors pin too
            if not op.anchor_pinned or op.anchor.is_root or not tree.owns(op.anchor):
                continue
            if op.anchor_pin == "host":
                want_pin[op.anchor.id] += 1
            elif op.anchor_pin == "lock":
                for n in tree.path_to_root(op.anchor):
                    want_lock[n.id] += 1
        problems = []
        for n in tree.nodes():
            if n.is_root:
                continue
            if n.lock_ref != want_lock[n.id]:
                problems.append(f"engine_locks: node {n.id} has lock_ref {n.lock_ref}, the engine holds {want_lock[n.id]}")
            if n.host_ref != want_pin[n.id]:
                problems.append(f"engine_pins: node {n.id} has host_ref {n.host_ref}, the engine holds {want_pin[n.id]}")
        return problems

    # ------------------------------------------------------------------ explorer support

    def clone(self) -> HiCacheAdapter:
        memo: dict = {}
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.cache = fork_cache(self.cache, memo, share_kv=True)
        self._kv_shared = new._kv_shared = True  # whoever writes KV first copies it (own_kv)
        new.device_pool = new.cache.device_pool
        new.host_pool = new.cache.host_pool
        new.executor = new.cache.executor
        new._locks = {h: memo[id(n)] for h, n in self._locks.items()}
        new._pins = {h: (memo[id(n)], pre, start) for h, (n, pre, start) in self._pins.items()}
        new._finished = list(self._finished[-4:])
        new._requests = dict(self._requests)
        if self.cache.storage is not None:
            new.backend = new.cache.storage.link.backend
            new.faults = new.backend.chooser
        return new

    def applicable(self, op: str, args: tuple) -> bool:
        from hicache_fsm.bindings.residency import ON_DEVICE, ON_HOST

        resident = ON_DEVICE | LOADING_STATES
        tree = self.cache.tree
        if op in ("match", "lock", "load_back"):
            tokens = self._aligned(args[0])
            path, matched, partial = tree.walk(tokens)
            if partial:
                parent = path[-1] if path else tree.root
                path = path + [parent.children[tree.child_key(None, tokens, matched)]]
            if not path:
                return False  # nothing matches: only the clock moves
            if op == "lock":  # without a device part, lock is just a match
                return path[0].state in resident
            if op == "load_back":  # without a host-only part, load_back is just a match
                return any(n.state not in resident for n in path)
            return True
        if op == "backup":
            node = self._exact_node(args[0])
            return node is not None and node.state == "device"
        if op == "pin_host":
            node = self._exact_node(args[0])
            return node is not None and node.state in ON_HOST
        if op == "prefetch":  # a prompt wholly in memory is refused below the threshold: only a match
            return len(self.read_kv(args[0])) < len(self._aligned(args[0]))
        if op == "store_remote":  # pages stored already are kept: nothing changes
            return self.stored_prefix(args[0]) < len(self._aligned(args[0]))
        return True  # evictions always run: what is evictable is the code under test

    def state_key(self) -> Hashable:
        """Canonical state (see ``explorer``): prefixes, not ids; eviction rank, not clocks; token ids
        up to renaming (two caches that differ only by a permutation of token ids share a key)."""
        cache = self.cache
        tree = cache.tree
        sort_key = cache.eviction.sort_key
        nodes = [n for n in tree.nodes() if n.parent is not None]
        prefix: dict[int, tuple] = {tree.root.id: ()}
        stack = [tree.root]
        while stack:
            p = stack.pop()
            base = prefix[p.id]
            for c in p.children.values():
                prefix[c.id] = base + c.key
                stack.append(c)
        orphan = (-1,)
        pre = {n.id: prefix.get(n.id, orphan + (n.id,)) for n in nodes}
        pending = cache.pending_jobs()
        kinds = {j.id: j.kind.value for j in pending}
        outbox = {j.id for j in cache.outbox.queued_jobs()}
        # hit counts matter to a policy that reads them: the selective threshold, LFU order
        if cache.config.write_policy == "write_through_selective":
            cap = max(1, cache.config.write_through_threshold)
        elif cache.config.eviction_policy == "lfu" or self.track_hits:
            cap = 1
        else:
            cap = 0
        ranked = sorted(nodes, key=sort_key)
        rows = [
            (pre[n.id], n.state, n.lock_ref, n.host_ref, min(n.hit_count, cap), r,
             tuple(sorted((kinds.get(j, "?"), j in outbox) for j in n.pending_jobs)) if n.pending_jobs else ())
            for r, n in enumerate(ranked)
        ]
        jobs = [(j.kind.value, j.id in outbox, tuple(pre.get(i, orphan + (i,)) for i in j.node_ids)) for j in pending]
        locks = [pre.get(n.id, orphan + (n.id,)) for n in self._locks.values()]
        pins = [(pre.get(n.id, orphan + (n.id,)), start) for n, _, start in self._pins.values()]
        # concrete facts the structure above does not imply, so a leak or a stray job makes a new state
        extra = (len(cache.engine_pages), self.device_pool.allocator.free_pages, self.host_pool.allocator.free_pages,
                 len(self.executor.pending_job_ids()), len(pending))
        alphabet = sorted({t for n in nodes for t in n.key})
        renamings: list[dict | None] = [None]
        if cache.storage is not None:  # storage keys hash token ids: no renaming, the tier's state as is
            from hicache_fsm.testing.storage import tier_state_key

            extra = extra + (tuple(self._requests.values()), tier_state_key(
                cache.storage, lambda n: () if n.is_root else pre.get(n.id, orphan + (n.id,)), list(self._requests)))
        elif self.symmetric and 1 < len(alphabet) <= 4:
            renamings = [dict(zip(alphabet, p)) for p in itertools.permutations(alphabet)]
        best = None
        for m in renamings:
            if m is None:
                f = _same
            else:
                f = functools.partial(_rename, m)
            key = (
                tuple(sorted((f(r[0]),) + r[1:] for r in rows)),
                tuple(sorted((k, o, tuple(sorted(map(f, ns)))) for k, o, ns in jobs)),
                tuple(sorted(map(f, locks))),
                tuple(sorted((f(p), start) for p, start in pins)),
                extra,
            )
            if best is None or key < best:
                best = key
        return best


def _same(prefix: tuple) -> tuple:
    return prefix


def _rename(mapping: dict, prefix: tuple) -> tuple:
    if prefix and prefix[0] < 0:  # an orphan's placeholder
        return prefix
    return tuple([mapping[t] for t in prefix])


LOADING_STATES = frozenset({"loading", "loading_storing", "loading_stored"})
# operations that need an attached storage tier
STORAGE_OPS = frozenset({"prefetch", "prefetching", "prefetch_ready", "abort", "storage_fault", "storage_steps",
                         "stored_prefix", "store_remote", "complete_storage", "fail_storage"})


def _host_pages(indices, page_size: int) -> list[int]:
    return [] if indices is None else (indices[::page_size] // page_size).tolist()


def hicache_structure_violations(cache) -> list[str]:
    """Checks of the cache's bookkeeping that the residency spec cannot express.

    - ``tree_well_formed``: every node is reachable from the root through its
      parent's children map, and every node the map names is live;
    - ``hit_counts_monotone``: a match counts every node on its path, so a
      parent has been hit at least as often as each child.
    """
    problems = []
    tree = cache.tree
    seen = {tree.root.id}
    stack = [tree.root]
    while stack:
        p = stack.pop()
        for c in p.children.values():
            if c.parent is not p:
                problems.append(f"tree_well_formed: node {c.id} is a child of {p.id} but its parent is "
                                f"{getattr(c.parent, 'id', None)}")
            if not tree.owns(c):
                problems.append(f"tree_well_formed: node {c.id} under {p.id} is not a live node")
            if c.id in seen:
                problems.append(f"tree_well_formed: node {c.id} is reachable twice")
                continue
            seen.add(c.id)
            stack.append(c)
    for n in tree.nodes():
        if n.id not in seen:
            problems.append(f"tree_well_formed: node {n.id} ({n.state}) is not reachable from the root (orphaned)")
    for n in tree.nodes():
        p = n.parent
        if p is not None and not p.is_root and p.hit_count < n.hit_count:
            problems.append(f"hit_counts_monotone: node {n.id} was hit {n.hit_count} times, its parent {p.id} only {p.hit_count}")
    return problems
