"""``HiCacheAdapter``: our ``HiCache`` behind the fuzzers' ``CacheAdapter`` interface.

The interface and its records live in ``testing.interface``, KV fingerprints in
``testing.kv``, forking in ``testing.fork``; they are re-exported here, so
``from hicache_fsm.testing.adapter import CacheAdapter, kv_fingerprint`` keeps working.
The cache runs with a ``ManualExecutor`` (every job waits until the driver
completes or fails it, so every acknowledgement order is reachable).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch

from hicache_fsm.config import CacheConfig, check_positive_int
from hicache_fsm.errors import ConfigError
from hicache_fsm.testing.fork import fork_cache, own_kv
from hicache_fsm.testing.interface import (
    OPTIONAL_OPS,
    CacheAdapter,
    JobInfo,
    MatchInfo,
    NotSupported,
    Occupancy,
    Rejected,
    StorageFault,
)
from hicache_fsm.testing.kv import CORRUPT, decode_kv_lists, encode_kv, encoded, fingerprints, kv_fingerprint, \
    prefix_fingerprints
from hicache_fsm.testing.namespaces import join_namespace, split_namespace
from hicache_fsm.testing.tree_checks import hicache_structure_violations

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
    "adapter_config",
    "check_variants",
    "decode_kv_lists",
    "encode_kv",
    "fingerprints",
    "fork_cache",
    "hicache_structure_violations",
    "kv_fingerprint",
    "own_kv",
]


@functools.cache
def _residency_spec():
    from hicache_fsm.spec import load_builtin

    return load_builtin("residency")



def check_variants(variants: object) -> tuple[dict, ...]:
    """A machine's variants: one or more dicts of its factory's keywords (a run picks one per example)."""
    if isinstance(variants, (str, bytes, Mapping)) or not isinstance(variants, Sequence) or not variants \
            or not all(isinstance(v, Mapping) for v in variants):
        raise ConfigError(f"variants must be a non-empty list of dicts of the factory's keywords, got {variants!r}")
    return tuple(variants)


FOREIGN_OFFSET = 1 << 20  # ``remote_tenant``'s KV is that of its tokens shifted by this much


def adapter_config(adapter: str, options: dict[str, Any]) -> CacheConfig:
    """``CacheConfig(**options)``, an unknown option named with the ones there are (not a TypeError)."""
    unknown = sorted(set(options) - set(attrs.fields_dict(CacheConfig)))
    if unknown:
        raise ConfigError(f"{adapter}: unknown option(s) {', '.join(unknown)}; besides its own, it takes "
                          f"CacheConfig's: {', '.join(attrs.fields_dict(CacheConfig))}")
    return CacheConfig(**options)


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
    ``FaultyBackend`` whose schedule is ``self.faults``), with ``stop_policy``,
    ``batch_pages``, ``prefetch_threshold`` (default one page) and
    ``prefetch_capacity_tokens`` (default the host pool) as given; ``remote_tenant``
    makes ``store_remote`` another tenant's instance on the same storage, whose
    pages (other KV for the same tokens) this cache must never hit. ``namespaces=N``
    files each prompt under one of N tree namespaces named by its first token
    (``testing.namespaces``): the operations take prompts as ever, the cache
    sees (namespace, tokens).
    """

    name = "hicache"

    def __init__(self, *, device_pages: int = 4, host_pages: int = 4, page_size: int = 1, layers: int = 2,
                 host_layout: str = "layer_first", dispatcher=None, storage: bool = False,
                 stop_policy: str = "best_effort", batch_pages: int = 2, namespaces: int = 1,
                 prefetch_threshold: int | None = None, prefetch_capacity_tokens: int | None = None,
                 remote_tenant: str | None = None, **config: Any) -> None:
        from hicache_fsm.cache import HiCache
        from hicache_fsm.executors import ManualExecutor
        from hicache_fsm.machine import compile_machine
        from hicache_fsm.pools import DeviceKVPool, HostKVPool, KVShape

        self.config = adapter_config("HiCacheAdapter", config)
        if not isinstance(storage, bool):
            raise ConfigError(f"HiCacheAdapter: storage must be True or False, got {storage!r}")
        for name, value in (("device_pages", device_pages), ("host_pages", host_pages), ("page_size", page_size),
                            ("namespaces", namespaces)):
            check_positive_int(name, value)  # named here: the pools would report only their product
        shape = KVShape(layers, 1, 1)
        self.page_size = page_size
        self.layers = layers
        self.namespaces = namespaces  # tree namespaces read off each prompt's first token (``testing.namespaces``)
        self.device_pool = DeviceKVPool(shape, device_pages * page_size, page_size, "cpu")
        self.host_pool = HostKVPool(shape, host_pages * page_size, page_size, host_layout, pin_memory=False)
        self.executor = ManualExecutor(self.device_pool, self.host_pool)
        machine = dispatcher if dispatcher is not None else compile_machine(_residency_spec())
        self.cache = HiCache(self.device_pool, self.host_pool, self.config, self.executor, dispatcher=machine)
        self.cache.check_candidates = True  # the eviction sets (and backup retries) recomputed at every check
        self._locks: dict[int, Any] = {}
        self._pins: dict[int, tuple[Any, tuple[int, ...], int]] = {}
        self._next_handle = 1
        self._finished: list[int] = []
        # state_key identifies caches that differ by a renaming of token ids (not when a prompt's first token
        # names its namespace: a renaming would move one position's tokens between namespaces)
        self.symmetric = namespaces == 1
        self.track_hits = False  # state_key tells hit from never-hit nodes even when the policy ignores hits
        self._kv_shared = False  # True after clone(): the KV buffers are shared until one side writes
        self._kv_writes = 0  # bumped before every write into the pools (read_kv caches per value)
        self._lists = None
        self._requests: dict[int, tuple[int, ...]] = {}  # prefetches the engine is waiting for
        self._next_request = 1
        self.faults = None
        self.backend = None
        # the storage tier's prefetch limits (one page, the whole host pool unless given) and pages per call
        self.prefetch_threshold = page_size if prefetch_threshold is None else prefetch_threshold
        self.prefetch_capacity_tokens = (self.host_pool.size_tokens if prefetch_capacity_tokens is None
                                         else prefetch_capacity_tokens)
        self.batch_pages = batch_pages
        self.stop_policy = stop_policy
        self.remote_tenant = remote_tenant  # ``store_remote`` writes as this other tenant (None: as this one)
        if storage:
            self._attach_storage()

    def _attach_storage(self) -> None:
        """L3 on a ``memory://`` backend behind a ``FaultyBackend``, run step by step (``ManualStorageTier``)."""
        from hicache_fsm.storage import open_backend
        from hicache_fsm.storage.faults import FaultyBackend
        from hicache_fsm.testing.storage import FaultPlan, ManualStorageTier

        self.faults = FaultPlan()
        self.backend = FaultyBackend(open_backend("memory://"), self.faults)
        ManualStorageTier.attach_to(
            self.cache, self.backend, prefetch_threshold=self.prefetch_threshold, stop_policy=self.stop_policy,
            prefetch_capacity_tokens=self.prefetch_capacity_tokens, batch_pages=self.batch_pages,
            retry_interval=0.0)

    def describe(self) -> str:
        c = self.config
        storage = ", storage" if self.cache.storage is not None else ""
        default = CacheConfig()
        options = "".join(f", {f.name}={getattr(c, f.name)}" for f in attrs.fields(CacheConfig)
                          if f.name not in ("write_policy", "eviction_policy")
                          and getattr(c, f.name) != getattr(default, f.name))  # the thresholds set away from default
        return (f"hicache(device={self.device_pool.allocator.total_pages}, host={self.host_pool.allocator.total_pages}, "
                f"page={self.page_size}, layers={self.layers}, {c.write_policy}, {c.eviction_policy}{storage}"
                f"{f', namespaces={self.namespaces}' if self.namespaces > 1 else ''}{options}"
                f"{self._tier_options()})")

    def _tier_options(self) -> str:
        """The storage tier's prefetch limits and batch size, and the other tenant ``store_remote`` writes as,
        where they differ from this adapter's defaults."""
        if self.cache.storage is None:
            return ""
        given = (("prefetch_threshold", self.prefetch_threshold, self.page_size),
                 ("prefetch_capacity_tokens", self.prefetch_capacity_tokens, self.host_pool.size_tokens),
                 ("batch_pages", self.batch_pages, 2), ("remote_tenant", self.remote_tenant, None))
        return "".join(f", {name}={value}" for name, value, default in given if value != default)

    def supports(self, op: str) -> bool:
        if op in STORAGE_OPS and self.cache.storage is None:
            return False
        return super().supports(op)

    # ------------------------------------------------------------------ helpers

    def _aligned(self, tokens: Sequence[int]) -> tuple[int, ...]:
        tokens = tuple(tokens)
        return tokens[: len(tokens) - len(tokens) % self.page_size]

    def cache_form(self, tokens: Sequence[int]) -> tuple[Hashable, tuple[int, ...]]:
        """The cache's (namespace, whole-page tokens) for a prompt (``testing.namespaces``)."""
        return split_namespace(self._aligned(tokens), self.namespaces)

    def prompt_of(self, namespace: Hashable, tokens: tuple[int, ...]) -> tuple[int, ...]:
        """The prompt whose cache form is (``namespace``, ``tokens``): the inverse of ``cache_form``."""
        return join_namespace(namespace, tokens, self.namespaces)

    def prompt_to(self, node) -> tuple[int, ...]:
        """The prompt whose prefix ends at ``node`` (the tree's tokens from the root, as the fuzzers wrote them)."""
        return self.prompt_of(node.namespace, self.cache.tree.prefix_tokens(node))

    def walk(self, tokens: Sequence[int]) -> tuple[list, int, int]:
        """``RadixTree.walk`` of a prompt in its namespace; nothing changes."""
        namespace, tokens = self.cache_form(tokens)
        return self.cache.tree.walk(tokens, namespace)

    def next_child(self, tokens: Sequence[int], path: list, matched: int):
        """The child a walk of ``tokens`` that matched ``matched`` of them along ``path`` matches in part."""
        namespace, tokens = self.cache_form(tokens)
        tree = self.cache.tree
        return (path[-1] if path else tree.root).children.get(tree.child_key(namespace, tokens, matched))

    def match_prefix(self, tokens: Sequence[int]):
        """``HiCache.match_prefix`` of a prompt in its namespace (its jobs not flushed)."""
        namespace, tokens = self.cache_form(tokens)
        return self.cache.match_prefix(tokens, namespace)

    def _exact_node(self, tokens: Sequence[int]):
        """The node whose run ends exactly at ``tokens`` (no split), or None."""
        tokens = self._aligned(tokens)
        if not tokens:
            return None
        path, matched, partial = self.walk(tokens)
        if partial or matched != len(tokens) or not path:
            return None
        return path[-1]

    def _handle(self) -> int:
        h = self._next_handle
        self._next_handle += 1
        return h

    # ------------------------------------------------------------------ operations

    def insert(self, tokens: Sequence[int], priority: int = 0) -> bool:
        """Compute and insert ``tokens`` at ``priority`` (what the ``priority`` eviction policy ranks first)."""
        tokens = self._aligned(tokens)
        if not tokens:
            return False
        idx = self.alloc_for_insert(len(tokens))
        if idx is None:
            self.cache.flush()
            return False
        k, v = encoded(tokens, self.layers)
        self._own_kv()
        self._kv_writes += 1
        self.device_pool.write(idx, None, k, v)
        namespace, inner = self.cache_form(tokens)
        self.cache.insert(inner, idx, namespace, priority=priority)
        self.cache.flush()
        return True

    def alloc_for_insert(self, num_tokens: int):
        """The engine's device slots for an insert's KV (``alloc_device``, which may evict); None when full."""
        return self.cache.alloc_device(num_tokens)

    def priority_levels(self) -> int:
        """How many insert priorities change what this cache does: 2 under the ``priority`` eviction policy."""
        return 2 if self.config.eviction_policy == "priority" else 1

    def match(self, tokens: Sequence[int]) -> MatchInfo:
        m = self.matched(tokens)
        return MatchInfo(m.device_hit_length, m.host_hit_length)

    def matched(self, tokens: Sequence[int]):
        """``match_prefix`` of ``tokens`` (whole pages), its jobs flushed: the result the engine would get."""
        m = self.match_prefix(tokens)
        self.cache.flush()
        return m

    def lock(self, tokens: Sequence[int]) -> int | None:
        m = self.match_prefix(tokens)
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

    def locked_device_tokens(self) -> dict[int, int]:
        from hicache_fsm.eviction import RESIDENT

        tree = self.cache.tree
        return {h: sum(n.num_tokens for n in tree.path_to_root(node) if n.state in RESIDENT) if tree.owns(node)
                else 0 for h, node in self._locks.items()}

    def pin_host(self, tokens: Sequence[int]) -> int | None:
        from hicache_fsm.bindings.residency import ON_HOST

        node = self._exact_node(tokens)
        if node is None or node.state not in ON_HOST:
            return None
        self.cache.pin_host(node)
        h = self._handle()
        tree = self.cache.tree
        self._pins[h] = (node, self.prompt_to(node), len(tree.prefix_tokens(node.parent)))
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

    def engine_holdings(self) -> tuple[list, list, dict[int, tuple[int, ...]]]:
        """What the engine holds, read only: locked nodes, (pinned node, prefix, start) pins, open prefetch requests."""
        return list(self._locks.values()), list(self._pins.values()), dict(self._requests)

    def evict(self, num_tokens: int) -> int:
        freed = self.cache.evict(num_tokens)
        self.cache.flush()
        return freed

    def evict_host(self, num_tokens: int) -> int:
        freed = self.cache.evict_host(num_tokens)
        self.cache.flush()
        return freed

    def load_back(self, tokens: Sequence[int]) -> int:
        m = self.match_prefix(tokens)
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
        m = self.match_prefix(tokens)
        rid = self._next_request
        namespace, inner = self.cache_form(tokens)
        ok = self.cache.prefetch(rid, inner, m, namespace)
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
        Returns the tokens written. Nothing in this cache changes. With ``remote_tenant`` the other
        instance is another tenant's: its KV for the same tokens differs, under its own key namespace."""
        from hicache_fsm.pools import HostKVPool
        from hicache_fsm.storage.page_format import page_format_of

        tokens = self._aligned(tokens)
        if not tokens or self.backend is None:
            return 0
        ps = self.page_size
        scratch = HostKVPool(self.host_pool.shape, len(tokens), ps, self.host_pool.layout, pin_memory=False)
        foreign = self.remote_tenant is not None
        # another tenant's KV: that of other tokens (a prompt under another offset), so a hit on it reads wrong
        k, v = encoded(tuple(t + FOREIGN_OFFSET for t in tokens) if foreign else tokens, self.layers)
        scratch.write(torch.arange(len(tokens)), k, v)
        values = [scratch.read_page(p).numpy().tobytes() for p in range(len(tokens) // ps)]
        inner = self.backend.inner
        writer = inner.sibling(attrs.evolve(inner.namespace, tenant=self.remote_tenant)) if foreign else inner
        try:
            stored = writer.batch_set(self.storage_keys_of(tokens), values, page_format_of(scratch))
        finally:
            if foreign:
                writer.close()
        return sum(stored) * ps

    def stored_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of ``tokens`` storage holds (read without faults or side effects)."""
        tokens = self._aligned(tokens)
        if not tokens or self.backend is None:
            return 0
        return self.backend.inner.batch_exists(self.storage_keys_of(tokens)) * self.page_size

    def storage_keys_of(self, tokens: Sequence[int]) -> list[str]:
        """The storage keys of a prompt's pages, chained from its namespace's seed as the cache chains them."""
        from hicache_fsm.storage.keys import page_keys
        from hicache_fsm.storage.tier import namespace_seed

        namespace, inner = self.cache_form(tokens)
        return page_keys(inner, self.page_size, namespace_seed(namespace))

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
        path, matched, partial = self.walk(tokens)
        parts = [(n, n.num_tokens) for n in path]
        if partial:
            child = self.next_child(tokens, path, matched)
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
            want = prefix_fingerprints(self.prompt_of(node.namespace, before))[-node.num_tokens:]
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

    def _wanted_refs(self) -> tuple[Counter[int], Counter[int]] | str:
        """Per node id, the lock and host-pin counts the engine's holdings and running prefetches account
        for; a message instead when a held node left the tree."""
        tree = self.cache.tree
        want_lock: Counter[int] = Counter()
        for node in self._locks.values():
            if not tree.owns(node):
                return f"locks: locked node {node.id} left the tree"
            for n in tree.path_to_root(node):
                want_lock[n.id] += 1
        want_pin: Counter[int] = Counter()
        for node, _, _ in self._pins.values():  # a host pin covers the pinned node only, never its split-off half
            if not tree.owns(node):
                return f"pins: host-pinned node {node.id} left the tree"
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
        return want_lock, want_pin

    def _engine_ref_violations(self) -> list[str]:
        """Lock and host-pin counts equal what the engine (this adapter) holds."""
        wanted = self._wanted_refs()
        if isinstance(wanted, str):
            return [wanted]
        want_lock, want_pin = wanted
        problems = []
        for n in self.cache.tree.nodes():
            if n.is_root:
                continue
            if n.lock_ref != want_lock[n.id]:
                problems.append(f"engine_locks: node {n.id} has lock_ref {n.lock_ref}, the engine holds {want_lock[n.id]}")
            if n.host_ref != want_pin[n.id]:
                problems.append(f"engine_pins: node {n.id} has host_ref {n.host_ref}, the engine holds {want_pin[n.id]}")
        return problems

    def unowned_refs(self) -> dict[int, tuple[int, int]]:
        """Per node id, the (locks, host pins) it holds beyond what the engine and running prefetches own."""
        wanted = self._wanted_refs()
        want_lock, want_pin = (Counter(), Counter()) if isinstance(wanted, str) else wanted
        out = {}
        for n in self.cache.tree.nodes():
            extra = (n.lock_ref - want_lock[n.id], n.host_ref - want_pin[n.id])
            if not n.is_root and (extra[0] > 0 or extra[1] > 0):
                out[n.id] = extra
        return out

    # ------------------------------------------------------------------ explorer support

    def clone(self) -> HiCacheAdapter:
        memo: dict = {}
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.cache = fork_cache(self.cache, memo, share_kv=True)
        new.cache.check_candidates = True
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

        if op == "poll":  # an idle engine step: what write_behind's clock counts; elsewhere it changes nothing
            return self.config.write_policy == "write_behind"
        resident = ON_DEVICE | LOADING_STATES
        if op in ("match", "lock", "load_back"):
            tokens = self._aligned(args[0])
            path, matched, partial = self.walk(tokens)
            if partial:
                path = path + [self.next_child(tokens, path, matched)]
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

    def key_fields(self) -> dict:
        """The named fields of the state key (``testing.statekey``), before token renaming."""
        from hicache_fsm.testing.statekey import adapter_key_fields

        return adapter_key_fields(self, self._pool_lists())

    def state_key(self) -> Hashable:
        """Canonical state (``testing.statekey``): everything that can change what happens next, node ids
        dropped, token ids up to renaming (two caches that differ only by a permutation share a key)."""
        return self.state_key_orbit()[0]

    def state_key_orbit(self) -> tuple[Hashable, int]:
        """``state_key`` and how many distinct states (token renamings) it stands for."""
        from hicache_fsm.testing.statekey import key_and_orbit

        fields = self.key_fields()
        # every token id the key names (the tree's, and stale KV left in free slots): renaming only the
        # tree's would keep two renamings of one state apart when a slot still holds an evicted prefix
        alphabet = {t for n in self.cache.tree.nodes() for t in n.key}
        alphabet.update(t for f in ("device_slots", "host_slots") for slot in fields[f] if slot for t in slot)
        return key_and_orbit(fields, sorted(alphabet), self.symmetric)


LOADING_STATES = frozenset({"loading", "loading_storing", "loading_stored"})
# operations that need an attached storage tier
STORAGE_OPS = frozenset({"prefetch", "prefetching", "prefetch_ready", "abort", "storage_fault", "storage_steps",
                         "stored_prefix", "store_remote", "complete_storage", "fail_storage"})


def _host_pages(indices, page_size: int) -> list[int]:
    return [] if indices is None else (indices[::page_size] // page_size).tolist()

