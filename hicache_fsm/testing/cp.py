"""CP layer writes under the tools: ``CPAdapter`` drives 1 or 2 simulated CP ranks with target and draft pools.

Every rank is a ``HiCache`` over its own ``CPDeviceKVPool`` with a
``LayerWriteRuntime`` (``hicache_fsm.layer_write``) and a ``ManualExecutor``;
every engine step runs on all ranks alike (they share the scheduler), while
each rank's executor completes or fails its own jobs in any order. Besides
the usual steps the explorer gets ``reserve(tokens)`` (a CP host reservation
without copies) and ``layer_end(layer, source)`` (a target or draft layer
finished its forward pass: every pending write submits it).

Checked after every step, besides every rank's invariants (the
``layer_write`` spec's ``ack_exactly_once`` and ``owned_slots_only`` among
them): **a write is acknowledged exactly once, after every target and every
draft layer was copied** (a node leaves ``writing_host`` for ``device_host``
only when each required layer's copy landed on that rank), **host read-back**:
every host copy (target and draft) holds, for each token the rank owns, the
fingerprint written for it in every layer, and **the group holds what any rank's
tree names**: a node no device holds any more has each owner's share on that
owner's host (``cp_group_host_copy``; ranks that evict host KV differently part
their trees, and a rank's own read-back cannot see the share another dropped).
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from hicache_fsm.config import check_positive_int
from hicache_fsm.testing.adapter import (
    CacheAdapter,
    JobInfo,
    MatchInfo,
    Rejected,
    adapter_config,
    decode_kv_lists,
    encode_kv,
    fingerprints,
)
from hicache_fsm.testing.checks import Step

__all__ = ["CPAdapter"]


class CPAdapter(CacheAdapter):
    """``world_size`` CP ranks over ``device_pages`` logical pages, ``host_pages`` host pages per rank,
    ``layers`` target layers and ``draft_layers`` draft layers (0: no draft model)."""

    name = "hicache_cp"

    def __init__(self, *, world_size: int = 2, device_pages: int = 2, host_pages: int = 3, layers: int = 2,
                 draft_layers: int = 1, write_policy: str = "write_back", **config: Any) -> None:
        from hicache_fsm.executors import ManualExecutor
        from hicache_fsm.cp_world import build_cp_rank
        from hicache_fsm.pools import KVShape, PoolConfig

        check_positive_int("world_size", world_size)  # 0 ranks: a run that checks nothing
        self.world_size, self.layers, self.draft_layers = world_size, layers, draft_layers
        pools = PoolConfig(shape=KVShape(layers, 1, 1), device_tokens=device_pages, page_size=1,
                           host_tokens=host_pages, draft_shape=KVShape(draft_layers, 1, 1) if draft_layers else None)
        cfg = adapter_config("CPAdapter", {"write_policy": write_policy, **config})
        self.ranks = [build_cp_rank(pools, world_size, r, cache_config=cfg,
                                    executor_factory=lambda p: ManualExecutor(p.device, p.host, p.draft_device,
                                                                              p.draft_host))
                      for r in range(world_size)]
        self.config = cfg
        self._landed: dict[tuple[int, int], set] = {}  # (rank, node id) -> (source, layer) copies that landed
        self._problems: list[str] = []
        self._finished: list[tuple[int, int]] = []

    def describe(self) -> str:
        return (f"hicache_cp(ranks={self.world_size}, layers={self.layers}, draft_layers={self.draft_layers}, "
                f"{self.config.write_policy})")

    def machines(self) -> list:
        return [m for r in self.ranks for m in (r.cache.residency, r.writes.machine)]

    def clone(self) -> CPAdapter:
        memo: dict = {}
        for r in self.ranks:  # compiled machines, specs and config never change: share them
            for shared in (r.cache.residency, r.writes.machine, r.cache.config, r.layout):
                memo[id(shared)] = shared
            # allocators keep numpy views of scratch buffers that a deep copy would pull apart
            for pool in (r.pools.device, r.pools.host, r.pools.draft_host):
                if pool is not None and id(pool.allocator) not in memo:
                    memo[id(pool.allocator)] = pool.allocator.fork()
        return copy.deepcopy(self, memo)

    # ------------------------------------------------------------------ engine steps, on every rank

    def _kv(self, tokens: tuple[int, ...], layers: int, start: int = 0):
        k, v = encode_kv(tokens, layers)
        return k[:, start:], v[:, start:]

    def insert(self, tokens: Sequence[int]) -> bool:
        """As an engine: match, compute KV for the uncached tail into fresh slots, insert the whole prompt."""
        tokens = tuple(tokens)
        matches = [r.cache.match_prefix(tokens) for r in self.ranks]  # ranks may differ (a rank owning no
        if all(m.device_hit_length == len(tokens) for m in matches):  # page of a write acks it at once)
            return True
        for r, m in zip(self.ranks, matches):  # the matched prefix must stay while the tail is allocated
            if not m.last_device_node.is_root:
                r.cache.lock(m.last_device_node)
        fresh = [r.cache.alloc_device(len(tokens) - m.device_hit_length) for r, m in zip(self.ranks, matches)]
        for r, m in zip(self.ranks, matches):
            if not m.last_device_node.is_root:
                r.cache.unlock(m.last_device_node)
        if any(s is None for s in fresh):
            for r, s in zip(self.ranks, fresh):
                if s is not None:
                    r.cache.free_device(s)
                r.cache.flush()
            return False
        for r, m, s in zip(self.ranks, matches, fresh):
            hit = m.device_hit_length
            r.layout.scatter_kv(r.pools.device, s, *self._kv(tokens, self.layers, hit))
            if self.draft_layers:
                r.layout.scatter_kv(r.pools.draft_device, s, *self._kv(tokens, self.draft_layers, hit))
            r.cache.insert(tokens, torch.cat([m.device_indices, s]))
            r.cache.flush()
        return True

    def match(self, tokens: Sequence[int]) -> MatchInfo:
        out = [r.cache.match_prefix(tuple(tokens)) for r in self.ranks]
        for r in self.ranks:
            r.cache.flush()
        return MatchInfo(out[0].device_hit_length, out[0].host_hit_length)

    def _node(self, rank, tokens: tuple[int, ...]):
        path, matched, partial = rank.cache.tree.walk(tokens)
        return path[-1] if path and not partial and matched == len(tokens) else None

    def backup(self, tokens: Sequence[int]) -> bool | None:
        """Back the prompt's node up on every rank where it is device-only.

        Also the engine's retry after a copy failed on some ranks only: the node is then ``device_host`` on
        the ranks whose copies landed and ``device`` on the others, and only the latter write again (there
        is no way back from ``device_host`` but eviction, which would drop the node on the failed ranks
        and keep a host copy missing their pages on the others)."""
        nodes = [self._node(r, tuple(tokens)) for r in self.ranks]
        if any(n is None or n.state not in ("device", "device_host") for n in nodes):
            return None
        todo = [(r, n) for r, n in zip(self.ranks, nodes) if n.state == "device"]
        if not todo:
            return None
        ok = [r.cache.write_backup(n) for r, n in todo]
        for r in self.ranks:
            r.cache.flush()
        return all(ok)

    def reserve(self, tokens: Sequence[int]) -> bool | None:
        """A CP host reservation on every rank; the copies follow layer by layer (``layer_end``)."""
        nodes = [self._node(r, tuple(tokens)) for r in self.ranks]
        if any(n is None or n.state != "device" for n in nodes):
            return None
        return all([r.writes.reserve(n).state != "failed" for r, n in zip(self.ranks, nodes)])

    def layer_end(self, layer: int, source: str) -> int:
        return sum(r.writes.on_layer_end(layer, source) for r in self.ranks)

    def evict(self, num_tokens: int) -> int:
        freed = [r.cache.evict(num_tokens) for r in self.ranks]
        for r in self.ranks:
            r.cache.flush()
        return freed[0]

    def evict_host(self, num_tokens: int) -> int:
        freed = [r.cache.evict_host(num_tokens) for r in self.ranks]
        for r in self.ranks:
            r.cache.flush()
        return freed[0]

    def load_back(self, tokens: Sequence[int]) -> int:
        got = []
        for r in self.ranks:
            m = r.cache.match_prefix(tuple(tokens))
            lb = r.cache.load_back(m.last_host_node) if m.host_hit_length else None
            r.cache.flush()
            got.append(0 if lb is None else int(lb.device_indices.numel()))
        return got[0]

    def applicable(self, op: str, args: tuple) -> bool:
        """Engine steps wait until every rank agrees on what is on the device, what is loading back and what
        has a host copy (a rank that owns no page of a write acks it at once; the scheduler moves on once all
        ranks did); acks are always possible. A load that failed on one rank while another still loads waits
        too: the loading rank's device holds pages the other's does not, so an eviction for the next step would
        take different nodes on each and part their trees. When a write's copies landed on some ranks and
        failed on others, the ranks disagree on the host copy until the engine backs the node up again on the
        failed ranks: only that ``backup`` may run meanwhile."""
        if op in ("complete_job", "fail_job"):
            return True
        views = self._views(with_host=True)
        if len(views) == 1:
            return True
        return op == "backup" and len(self._views(with_host=False)) == 1

    def _views(self, *, with_host: bool) -> set:
        from hicache_fsm.bindings.residency import LOADING, ON_DEVICE, ON_HOST

        return {frozenset((r.cache.tree.prefix_tokens(n), n.state in ON_DEVICE, n.state == "writing_host",
                           n.state in LOADING, with_host and n.state in ON_HOST)
                          for n in r.cache.tree.nodes() if n.parent is not None) for r in self.ranks}

    def extra_steps(self) -> list[Step]:
        out = [Step("layer_end", (i, "target")) for i in range(self.layers)]
        return out + [Step("layer_end", (i, "draft")) for i in range(self.draft_layers)]

    def prompt_steps(self, prompt: tuple[int, ...]) -> list[Step]:
        return [Step("reserve", (prompt,))]

    # ------------------------------------------------------------------ executors, one per rank

    def pending_jobs(self) -> list[JobInfo]:
        out = []
        for i, r in enumerate(self.ranks):
            r.cache.flush()
            out += [JobInfo((i, j.id), j.kind.value, (i, j.layer, j.draft)) for j in r.cache.executor.pending_jobs()]
        return out

    def _ack(self, job_id: tuple[int, int], ok: bool) -> None:
        i, jid = job_id
        r = self.ranks[i]
        job = next((j for j in r.cache.executor.pending_jobs() if j.id == jid), None)
        if job is None:
            raise Rejected(f"job {job_id} is not pending")
        writes = {n.id: r.writes.write_for(n) for n in r.cache.tree.nodes() if n.state == "writing_host"}
        if ok and job.layer is not None:
            write = next((writes[x] for x in job.node_ids if writes.get(x) is not None), None)
            if write is not None:
                self._landed.setdefault((i, write.id), set()).add(("draft" if job.draft else "target", job.layer))
        (r.cache.executor.complete if ok else r.cache.executor.fail)(jid)
        r.cache.poll()
        self._finished = [job_id]
        want = {("target", l) for l in range(self.layers)} | {("draft", l) for l in range(self.draft_layers)}
        for n in r.cache.tree.nodes():
            w = writes.get(n.id)
            if w is None or n.state != "device_host" or not w.owned_tokens:
                continue
            landed = self._landed.get((i, w.id), set())
            if not want <= landed:
                self._problems.append(f"cp_ack_after_every_layer: rank {i} acked the write of node {n.id} before "
                                      f"these layers landed: {sorted(want - landed)}")
        live = {(i, r.writes.write_for(n).id) for n in r.cache.tree.nodes()
                if n.state == "writing_host" and r.writes.write_for(n) is not None}
        self._landed = {k: v for k, v in self._landed.items() if k[0] != i or k in live}

    def complete_job(self, job_id: Hashable) -> None:
        self._ack(job_id, True)

    def fail_job(self, job_id: Hashable) -> None:
        self._ack(job_id, False)

    # ------------------------------------------------------------------ checks

    def read_kv(self, tokens: Sequence[int]) -> list[tuple[int, ...]]:
        """Per token of the cached prefix, the device copy read on the rank that owns its page (a copy
        being loaded is not valid yet; a host-only token is read from its owner's host copy). Like
        ``HiCacheAdapter.read_kv`` it reads on past a node whose only valid copy is on the host (a node
        being loaded back, with device children inserted under it)."""
        from hicache_fsm.bindings.residency import LOADING, ON_DEVICE, ON_HOST

        out: list[tuple[int, ...]] = []
        path, _, _ = self.ranks[0].cache.tree.walk(tuple(tokens))
        layout = self.ranks[0].layout
        for n in path:
            if n.state in ON_DEVICE and n.state not in LOADING:
                owners = layout.page_owners(n.device_indices).tolist()
                for slot, o in zip(n.device_indices.tolist(), owners):
                    rank = self.ranks[o]
                    phys = rank.layout.logical_locs_to_physical(torch.tensor([slot]))
                    k, v = rank.pools.device.read(phys)
                    out.append((decode_kv_lists(k.tolist(), v.tolist(), 0),))
            elif n.state in ON_HOST:
                out += [(fp,) for fp in self._host_tokens(n)]
            else:
                break
        return out

    def _host_tokens(self, node) -> list[int]:
        """The fingerprints of ``node``'s tokens read from their owners' host copies (CORRUPT where missing)."""
        from hicache_fsm.bindings.residency import LOADING, ON_DEVICE, ON_HOST
        from hicache_fsm.testing.adapter import CORRUPT

        owners = node.cp_meta.page_owners.tolist() if node.cp_meta is not None else []
        seen = [0] * self.world_size
        out = []
        for i in range(node.num_tokens):
            o = owners[i] if i < len(owners) else 0
            rank = self.ranks[o]
            twin = rank.cache.tree.get(node.id) if rank is not self.ranks[0] else node
            if twin is not None and twin.state not in ON_HOST and twin.state in ON_DEVICE and twin.state not in LOADING:
                # the owner has not finished writing its share to host yet: its device copy is the valid one
                phys = rank.layout.logical_locs_to_physical(twin.device_indices[i:i + 1])
                k, v = rank.pools.device.read(phys)
                out.append(decode_kv_lists(k.tolist(), v.tolist(), 0))
                continue
            twin = twin if twin is not None and twin.host_indices is not None else None
            if twin is None or seen[o] >= twin.host_indices.numel():
                out.append(CORRUPT)
                continue
            k, v = rank.pools.host.read(twin.host_indices[seen[o]:seen[o] + 1])
            out.append(decode_kv_lists(k.tolist(), v.tolist(), 0))
            seen[o] += 1
        return out

    def kv_violations(self) -> list[str]:
        from hicache_fsm.bindings.residency import ON_HOST

        problems, self._problems = self._problems, []
        for i, r in enumerate(self.ranks):
            for n in r.cache.tree.nodes():
                if n.parent is None or n.state not in ON_HOST or n.cp_meta is None:
                    continue
                owned = n.cp_meta.owned_mask(i).tolist()
                want = [fp for fp, mine in zip(fingerprints(r.cache.tree.prefix_tokens(n))[-n.num_tokens:],
                                               owned) if mine]
                copies = [("target", r.pools.host, n.host_indices)]
                if self.draft_layers:
                    copies.append(("draft", r.pools.draft_host, n.cp_meta.draft_host_indices))
                for source, pool, idx in copies:
                    if idx is None or not idx.numel():
                        continue
                    k, v = pool.read(idx)
                    k, v = k.tolist(), v.tolist()
                    got = [decode_kv_lists(k, v, s) for s in range(len(idx))]
                    if got != want:
                        problems.append(f"cp_host_readback: rank {i} node {n.id} ({n.state}) {source} host copy "
                                        f"reads {got}, {want} was written")
        return problems + self._group_problems()

    def _group_problems(self) -> list[str]:
        """``cp_group_host_copy``: every host-only (or loading) node of a rank's tree has, on each rank owning a
        page of it, a node of the same prefix holding that rank's share on its host. Read-back per rank misses
        a share one rank evicted and another still names: why a group must evict host KV alike."""
        from hicache_fsm.bindings.residency import EVICTED, ON_HOST

        problems: list[str] = []
        for i, r in enumerate(self.ranks):
            tree = r.cache.tree
            for n in tree.nodes():
                if n.parent is None or n.state not in EVICTED or n.cp_meta is None:
                    continue
                prefix = tree.prefix_tokens(n)
                for o in sorted(set(n.cp_meta.page_owners.tolist())):
                    twin = self._node(self.ranks[o], prefix)
                    if twin is not None and twin.state not in ON_HOST:
                        continue  # an owner still writing its share, or whose write failed (``applicable``)
                    want = n.cp_meta.owned_tokens(o)
                    held = 0 if twin is None or twin.host_indices is None else int(twin.host_indices.numel())
                    if held != want:
                        problems.append(f"cp_group_host_copy: rank {i} holds node {prefix} ({n.state}) on host; "
                                        f"its owner rank {o} holds {held} of its {want} tokens there")
        return problems

    def invariant_violations(self) -> list[str]:
        return [f"rank {i}: {p}" for i, r in enumerate(self.ranks) for p in r.cache.invariant_violations()]

    def size(self) -> int:
        return len(self.ranks[0].cache.tree)

    def state_key(self) -> Hashable:
        key = []
        for i, r in enumerate(self.ranks):
            c = r.cache
            tree = c.tree
            ranked = sorted((n for n in tree.nodes() if n.parent is not None), key=lambda n: (n.last_access, n.id))
            rows = tuple(sorted((tree.prefix_tokens(n), n.state, n.lock_ref, n.host_ref, rank_)
                                for rank_, n in enumerate(ranked)))
            writes = tuple(sorted((tree.prefix_tokens(w.node), w.state, tuple(sorted(w.submitted)), len(w.inflight),
                                   w.copy_failed, tuple(sorted(self._landed.get((i, w.id), ()))))
                                  for w in r.writes.pending_writes()))
            jobs = tuple(sorted((j.kind.value, j.layer, j.draft, tuple(sorted(tree.prefix_tokens(tree.get(x))
                                                                              for x in j.node_ids if tree.get(x))))
                                for j in c.executor.pending_jobs()))
            key.append((rows, writes, jobs, c.device_allocator.free_pages, c.host_allocator.free_pages))
        return tuple(key)
