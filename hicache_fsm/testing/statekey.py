"""The explorer's state key for a ``HiCache``: everything that can change what happens next.

Why a module of its own. Two states the explorer merges must behave alike
under every future step, or ``check`` can report "complete, 0 violations" for
a buggy cache (a branch merged into a good one before its damage shows). So
the key is not a hand-picked summary per family: it is read from the same
objects the invariants and the KV read-back read, field by field, and every
field has a name (``fields``) so that the property test of the key
(``tests/test_state_key.py``) can say which one a key missed.

What is kept, per field:

- ``tree``: every node by its token prefix (node ids dropped: ids are
  interchangeable), its residency state, lock and host-pin counts, hit count
  up to what the policy reads, its priority (inserts only ever raise it), rank in the eviction order (not clock values),
  its device and host slot ids, and the jobs it waits for;
- ``device_slots`` / ``host_slots``: what every slot of each pool holds, as the
  prefix whose fingerprint it reads (``None``: never written or inconsistent),
  so a transfer that counted a page it never wrote is a different state;
- ``device_free`` / ``host_free``: each allocator's free pages in allocation
  order (slot ids are *not* interchangeable: the allocator hands out released
  pages sorted by id, so which page comes next depends on the ids);
- ``jobs``: the outbox's pending and queued jobs and the executor's, in order,
  each with its kind, nodes, slots, layer, storage keys;
- ``engine``: device pages handed to the engine, its locks, pins, prefetch
  requests and load-backs it still reads (the adapter's own bookkeeping);
- ``storage``: the tier (link, health, stored keys, fault plan, queues) and
  every prefetch op with all its attributes (pages reserved, landed, counted,
  inserted, freed, its transfer job); the clock only as "timed out or not".

Left out, on purpose: job and request *ids* (fresh counters; their order is
kept), event counters and logs nothing reads back (``counters``, ``submitted``,
diagnostic messages), and locks / condition variables.

Token renaming (``symmetric``): two caches that differ by a permutation of
token ids get one key, the smallest over the renamings; off when storage is
attached (storage keys hash token ids).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any

import torch

__all__ = ["KEY_FIELDS", "adapter_key_fields", "describe_difference", "free_order", "key_and_orbit", "key_of",
           "remember_prefix"]

KEY_FIELDS = ("tree", "device_slots", "host_slots", "device_free", "host_free", "jobs", "engine", "storage")

# fingerprint -> the prefix whose KV it is (filled as prompts are encoded), to name slot contents by prefix
_PREFIX_OF: dict[int, tuple[int, ...]] = {}
# PrefetchOp attributes that do not change what happens next (see the module docstring)
_OP_SKIP = frozenset({"_lock", "error", "start_time", "request_id", "gen", "page_size"})


def remember_prefix(fingerprint: int, prefix: tuple[int, ...]) -> None:
    _PREFIX_OF.setdefault(fingerprint, prefix)


def free_order(alloc: Any) -> tuple[int, ...]:
    """An allocator's free pages in the order it will hand them out (read only: nothing is merged)."""
    return alloc.hand_out_order()


def _slot_contents(fingerprints: list[int]) -> tuple:
    return tuple(_PREFIX_OF.get(fp) for fp in fingerprints)


def _ids(t: torch.Tensor | None) -> tuple[int, ...] | None:
    return None if t is None else tuple(t.tolist())


def adapter_key_fields(adapter: Any, pool_fingerprints: tuple[list[int], list[int]]) -> dict[str, Any]:
    """The named fields of ``HiCacheAdapter.state_key`` before token renaming (prefixes as tuples);
    ``pool_fingerprints``: the fingerprint every device and host slot reads (the KV read-back's data)."""
    device_fps, host_fps = pool_fingerprints
    cache = adapter.cache
    tree = cache.tree
    nodes = [n for n in tree.nodes() if n.parent is not None]
    prefix: dict[int, tuple] = {tree.root.id: ()}
    stack = [tree.root]
    while stack:
        p = stack.pop()
        for c in p.children.values():
            # a prompt as the fuzzers wrote it: a node's tokens alone would merge two namespaces' twins
            prefix[c.id] = adapter.prompt_of(c.namespace, c.key) if p is tree.root else prefix[p.id] + c.key
            stack.append(c)

    def pre(node_id: int) -> tuple:
        return ("orphan", node_id) if node_id not in prefix else ("p", prefix[node_id])

    outbox_jobs = cache.outbox.pending_jobs()
    queued = {j.id for j in cache.outbox.queued_jobs()}
    kinds = {j.id: j.kind.value for j in outbox_jobs}
    if cache.config.write_policy == "write_through_selective":
        cap = max(1, cache.config.write_through_threshold)
    elif cache.config.eviction_policy == "lfu" or adapter.track_hits:
        cap = 1
    else:
        cap = 0
    ranked = sorted(nodes, key=cache.eviction.sort_key)
    rows = tuple(sorted(
        (pre(n.id), n.state, n.lock_ref, n.host_ref, min(n.hit_count, cap), n.priority, r, _ids(n.device_indices),
         _ids(n.host_indices), tuple(sorted((kinds.get(j, "?"), j in queued) for j in n.pending_jobs)))
        for r, n in enumerate(ranked)))

    def job(j) -> tuple:
        return (j.kind.value, j.id in queued, tuple(pre(i) for i in j.node_ids), _ids(j.host_indices),
                _ids(j.device_indices), j.layer, j.keys, j.draft, _ids(j.draft_host_indices))

    jobs = (tuple(job(j) for j in outbox_jobs), tuple(job(j) for j in adapter.executor.pending_jobs()),
            getattr(adapter.executor, "completions_waiting", 0))
    locked, pinned, requests = adapter.engine_holdings()
    engine = (tuple(sorted(cache.engine_pages)),
              tuple(sorted(pre(n.id) for n in locked)),
              tuple(sorted((pre(n.id), start) for n, _, start in pinned)),
              tuple(requests.values()),
              tuple((tuple(s.tolist()), p, n) for s, p, n in (adapter.watched_loads()
                                                               if hasattr(adapter, "watched_loads") else ())))
    fields = {
        "tree": rows,
        "device_slots": _slot_contents(device_fps),
        "host_slots": _slot_contents(host_fps),
        "device_free": free_order(adapter.device_pool.allocator),
        "host_free": free_order(adapter.host_pool.allocator),
        "jobs": jobs,
        "engine": engine,
        "storage": None,
    }
    if cache.storage is not None:
        fields["storage"] = _storage_fields(cache.storage, adapter, pre, job)
    return fields


def _storage_fields(tier: Any, adapter: Any, pre: Callable, job: Callable) -> tuple:
    from hicache_fsm.testing.storage import FaultPlan

    backend = tier.link.backend
    inner = getattr(backend, "inner", backend)
    stored = tuple(sorted(inner.stored_keys())) if inner is not None else ()
    blob = getattr(inner, "stored_blob", None)  # a memory:// backend's pages, bytes as stored (checksums included)
    contents = tuple(blob(k) for k in stored) if blob is not None else ()
    plan = getattr(backend, "chooser", None) or adapter.faults
    faults = (tuple((f, skip, left) for f, skip, left in plan.armed), tuple(sorted(plan.corrupted))) \
        if isinstance(plan, FaultPlan) else ()
    rt = tier.runtime

    def value(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return tuple(v.tolist())
        if hasattr(v, "children") and hasattr(v, "parent"):  # a tree node
            return pre(v.id)
        if hasattr(v, "kind") and hasattr(v, "node_ids"):  # a transfer job
            return job(v)
        if isinstance(v, Counter | dict):
            return tuple(sorted((k, value(x)) for k, x in v.items()))
        if isinstance(v, set | frozenset):
            return tuple(sorted(v))
        if isinstance(v, list | tuple):
            return tuple(value(x) for x in v)
        return v

    def op_key(op: Any) -> tuple:
        timed_out = rt.clock() - op.start_time > rt.timeout_for(op)
        return tuple((k, value(v)) for k, v in sorted(vars(op).items()) if k not in _OP_SKIP) + (timed_out,)

    requests = list(adapter.engine_holdings()[2])
    active = tuple(op_key(rt.active[r]) if r in rt.active else None for r in requests)
    others = tuple(op_key(op) for r, op in rt.active.items() if r not in requests)
    draining = tuple(op_key(op) for op in rt.draining.values())
    work = tier.queued_work()
    queues = (tuple(op_key(op) for op in work["query"]),
              tuple((job(j), op_key(op)) for j, op in work["s2h"]),
              tuple(job(j) for j in work["h2s"]))
    events, completions = tier.unapplied()
    retries = tier.retries  # backup retries: the order they are tried in and the failures so far
    retry = (tuple(pre(i) for i in retries.ready), tuple(sorted(pre(i) for i in retries.waiting)),
             tuple(sorted((pre(i), n) for i, (_, n) in retries.failures.items())))
    return (tier.link.state, tier.healthy, tier.sweep_due, stored, contents, faults, active, others, draining,
            queues, rt.occupied_tokens, rt.violation_count, events, completions, retry)


def _rename_prefix(mapping: dict | None, v: Any) -> Any:
    """Apply a token renaming to every ``("p", prefix)`` and slot content inside ``v``."""
    if mapping is None:
        return v
    if isinstance(v, tuple):
        if len(v) == 2 and v[0] == "p" and isinstance(v[1], tuple):
            return ("p", tuple(mapping.get(t, t) for t in v[1]))
        return tuple(_rename_prefix(mapping, x) for x in v)
    return v


def _rename_slots(mapping: dict | None, slots: tuple) -> tuple:
    if mapping is None:
        return slots
    return tuple(None if s is None else tuple(mapping.get(t, t) for t in s) for s in slots)


def key_of(fields: dict[str, Any], alphabet: list[int], symmetric: bool) -> Hashable:
    """The key: the fields in ``KEY_FIELDS`` order, smallest over token renamings when ``symmetric``."""
    return key_and_orbit(fields, alphabet, symmetric)[0]


def key_and_orbit(fields: dict[str, Any], alphabet: list[int], symmetric: bool) -> tuple[Hashable, int]:
    """``key_of`` and the size of its orbit: how many distinct keys the token renamings give (the states
    one key stands for; 1 without renaming), so the explorer can report what the reduction removed."""
    renamings: list[dict | None] = [None]
    if symmetric and fields["storage"] is None and 1 < len(alphabet) <= 4:
        renamings = [dict(zip(alphabet, p)) for p in itertools.permutations(alphabet)]
    keys = [tuple(_rename_slots(m, fields[f]) if f.endswith("_slots") else _renamed_field(m, f, fields[f])
                  for f in KEY_FIELDS) for m in renamings]
    if len(keys) == 1:
        return keys[0], 1
    return min(keys, key=repr), len(set(keys))


def _renamed_field(mapping: dict | None, name: str, value: Any) -> Any:
    out = _rename_prefix(mapping, value)
    if name == "tree" and mapping is not None:  # rows are sorted by prefix: sort again after renaming
        out = tuple(sorted(out))
    if name == "engine" and mapping is not None:
        pages, locks, pins, requests, loads = out
        loads = tuple((s, tuple(mapping.get(t, t) for t in p), n) for s, p, n in loads)
        out = (pages, tuple(sorted(locks)), tuple(sorted(pins)), requests, loads)
    return out


def describe_difference(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Names of the fields where two ``adapter_key_fields`` results differ."""
    return [f for f in KEY_FIELDS if a[f] != b[f]]

