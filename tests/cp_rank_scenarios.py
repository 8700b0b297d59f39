"""What each rank process runs in the context-parallel group tests (module level: spawned processes import it).

Every CP rank serves the same requests through its own ``HiCache`` with a
layer-write runtime (``build_cp_rank(..., group=...)``), a ``ManualExecutor``
so the test decides when each of this rank's copies ends, and writes only the
KV of the pages it owns. Ranks finish their copies in their own order and fail
their own; after every step they compare ``rank_view`` digests over the group.
"""

from __future__ import annotations

import random

import torch
from hypothesis import example, given, settings

from hicache_fsm.bindings.residency import LOADING, ON_DEVICE, ON_HOST
from hicache_fsm.config import CacheConfig
from hicache_fsm.cp_world import CPRank, build_cp_rank
from hicache_fsm.executors import ManualExecutor
from hicache_fsm.pools import PoolConfig
from hicache_fsm.tp import RankGroup, rank_view, view_digest
from tp_scenarios import PAGE, QUIET, SHAPE, finish_copies, prompts, rank_differences, shard_kv


def token_kv(tokens) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V (layers, n, heads, head_dim) of every token, a function of its prefix (every rank computes all)."""
    return shard_kv(tokens, 0)


def manual(pools) -> ManualExecutor:
    return ManualExecutor(pools.device, pools.host)


def make_rank(group: RankGroup, world: int, rank: int, block_pages: int = 1, policy: str = "write_through",
              logical_pages: int = 24, host_pages: int = 13) -> CPRank:
    """One CP rank of ``world``: ``logical_pages`` logical device pages, ``host_pages`` of host for its own."""
    config = PoolConfig(shape=SHAPE, device_tokens=logical_pages * PAGE, page_size=PAGE,
                        host_tokens=host_pages * PAGE)
    return build_cp_rank(config, world, rank, block_pages, CacheConfig(write_policy=policy, load_back_threshold=0),
                         manual, group=group)


def serve(r: CPRank, tokens: tuple) -> None:
    """One request the engine way: match, load back, lock, allocate, write the owned KV, insert, unlock."""
    cache = r.cache
    m = cache.match_prefix(tokens)
    lb = cache.load_back(m.last_host_node) if m.host_hit_length else None
    node = lb.last_node if lb is not None else m.last_device_node
    if lb is None and m.host_hit_length:
        return  # not loaded (device short): the engine would recompute; keep it simple
    cache.lock(node)
    try:
        parts = [m.device_indices] + ([lb.device_indices] if lb is not None else [])
        have = sum(int(p.numel()) for p in parts)
        n_new = len(tokens) - have
        idx = cache.alloc_device(n_new) if n_new else torch.empty(0, dtype=torch.int64)
        if idx is None:
            return
        if n_new:
            k, v = token_kv(tokens)
            r.layout.scatter_kv(r.pools.device, idx, k[:, have:], v[:, have:])
        cache.insert(tokens, torch.cat(parts + [idx]))
    finally:
        cache.unlock(node)


def agree_view(r: CPRank, group: RankGroup, step: str) -> int:
    d = view_digest(rank_view(r.cache))
    if not group.same(d):
        raise AssertionError(f"rank {group.rank}: tree differs from another rank's after {step}: {rank_view(r.cache)}")
    return d


def drain(r: CPRank) -> None:
    for _ in range(50):
        r.cache.executor.complete_all()
        r.cache.poll()
        if not r.cache.pending_job_ids():
            return
    raise AssertionError(f"jobs still pending: {r.cache.pending_job_ids()}")


def check_kv(r: CPRank) -> int:
    """The owned KV of every node, on device and on host, is what was written for its prefix; pages checked."""
    cache, checked = r.cache, 0
    for node in cache.tree.nodes():
        if node.is_root:
            continue
        seq = cache.tree.prefix_tokens(node)
        k, v = (t[:, len(seq) - node.num_tokens:] for t in token_kv(seq))
        if node.state in ON_DEVICE:
            mask = r.layout.owned_by_this_rank(node.device_indices)
            got_k, got_v = r.layout.gather_kv(r.pools.device, node.device_indices)
            if not (torch.equal(got_k, k[:, mask]) and torch.equal(got_v, v[:, mask])):
                raise AssertionError(f"rank {r.layout.rank}: device KV of node {node.id} is not what was written")
            checked += int(mask.sum()) // PAGE
        if node.state in ON_HOST and node.state not in LOADING:
            mask = node.cp_meta.owned_mask(r.layout.rank)
            got_k, got_v = r.pools.host.read(node.host_indices)
            if not (torch.equal(got_k, k[:, mask]) and torch.equal(got_v, v[:, mask])):
                raise AssertionError(f"rank {r.layout.rank}: host KV of node {node.id} is not what was written")
            checked += int(mask.sum()) // PAGE
    return checked


def run_requests(rank: int, world: int, group: RankGroup, seed: int, steps: int, share: float, fail: float,
                 fail_rank: int, block_pages: int, policy: str) -> tuple[list[int], int, int]:
    """``steps`` requests, this rank finishing (and failing) its copies its own way; views compared every step.

    Returns the view digests, the owned pages whose KV was checked, and the writes that failed here.
    """
    r = make_rank(group, world, rank, block_pages, policy)
    rng = random.Random(f"{seed}:{rank}")  # per-rank differences
    digests = []
    for i, tokens in enumerate(prompts(seed, steps)):
        serve(r, tokens)
        finish_copies(r.cache.executor, rng, share, fail if rank == fail_rank else 0.0)
        r.cache.poll()
        r.cache.check_invariants()
        digests.append(agree_view(r, group, f"request {i}"))
        if i % 4 == 3:
            r.cache.evict(3 * PAGE)  # host copies stay behind: later requests load them back
    drain(r)
    r.cache.check_invariants()
    digests.append(agree_view(r, group, "drain"))
    if r.cache.acks.arrived:
        raise AssertionError(f"rank {rank}: completions held but never agreed: {sorted(r.cache.acks.arrived)}")
    return digests, check_kv(r), r.cache.counters["cp_write_failed"]


def agreement_property(rank: int, world: int, pg, block_pages: int, policy: str,
                       examples: int) -> tuple[list[int], int, int]:
    """Hypothesis (the same examples on every rank) picks each rank's share of copies ended a step, the failure
    rate and which rank fails. Returns what must be equal on every rank (each view digest and failed-write
    count), the writes that failed and the owned pages whose KV this rank checked, over all examples."""
    group = RankGroup(pg, timeout_s=120.0)  # a safety stop only
    seen: list[int] = []
    totals = [0, 0]

    @settings(QUIET, max_examples=examples)
    @given(**rank_differences(world))
    @example(seed=7, shares=[1.0] + [0.3] * (world - 1), fail=0.3, fail_rank=world - 1)  # late, out of order, failing
    def prop(seed, shares, fail, fail_rank):
        digests, checked, failed = run_requests(rank, world, group, seed, 16, shares[rank], fail, fail_rank,
                                                block_pages, policy)
        seen.extend(digests)
        seen.append(failed)
        totals[0] += failed
        totals[1] += checked

    prop()
    return seen, totals[0], totals[1]


def one_copy_fails_here(rank: int, world: int, pg, block_pages: int, failing_rank: int) -> dict:
    """One node backed up on every rank; ``failing_rank`` fails its first copy, the others complete theirs."""
    group = RankGroup(pg)
    r = make_rank(group, world, rank, block_pages)
    cache, ex = r.cache, r.cache.executor
    host_free = cache.host_allocator.free_pages
    tokens = tuple(range(1, 1 + 4 * PAGE))
    idx = cache.alloc_device(len(tokens))
    k, v = token_kv(tokens)
    r.layout.scatter_kv(r.pools.device, idx, k, v)
    node = cache.insert(tokens, idx).node  # write_through: every layer's copy of the owned pages is submitted
    cache.flush()
    jobs = ex.pending_job_ids()
    owned = r.layout.owned_by_this_rank(idx).sum().item() // PAGE
    for i, job in enumerate(jobs):
        if rank == failing_rank and i == 0:
            ex.fail(job, "injected on this rank")
        else:
            ex.complete(job)
    cache.poll()
    cache.check_invariants()
    failed = {"state": node.state, "jobs": len(jobs), "owned_pages": owned,
              "failed_writes": cache.counters["cp_write_failed"],
              "host_free_again": cache.host_allocator.free_pages == host_free,
              "view": agree_view(r, group, "the failed write")}
    write = r.writes.reserve(node)  # the node is device-only on every rank: back it up again
    r.writes.submit_all(write)
    drain(r)
    cache.check_invariants()
    return failed | {"retried": node.state, "checked_pages": check_kv(r),
                     "view_after_retry": agree_view(r, group, "the retried write")}


def build_as_another_rank(rank: int, world: int, pg, claimed_rank: int | None, claimed_world: int) -> str:
    """Build this rank's cache claiming ``claimed_rank`` (None: its own) of ``claimed_world``: the error, or ok."""
    from hicache_fsm.errors import ConfigError

    config = PoolConfig(shape=SHAPE, device_tokens=8 * PAGE, page_size=PAGE, host_tokens=8 * PAGE)
    try:
        r = build_cp_rank(config, claimed_world, rank if claimed_rank is None else claimed_rank, 1, CacheConfig(), manual, group=RankGroup(pg))
    except ConfigError as exc:
        return str(exc)
    r.cache.close()
    return "ok"
