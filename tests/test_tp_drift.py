"""Ranks whose caches go apart without a job to tell are caught, not left to hang a model collective.

The step agreement compares the ranks' pending jobs; a device eviction of
backed-up KV, or a request one rank never saw under ``write_back``, emits
none. So the ranks compare their configurations when the caches are built,
and their node counts and free pages at every ``poll``.
"""

from __future__ import annotations

import torch

from hicache_fsm.cache import HiCache
from hicache_fsm.config import CacheConfig
from hicache_fsm.errors import ConfigError, HiCacheError, RanksDiverged
from hicache_fsm.executors import ManualExecutor
from hicache_fsm.pools import DeviceKVPool, HostKVPool, KVShape
from hicache_fsm.testing.ranks import run_ranks
from hicache_fsm.tp import RankGroup

PS = 4
SHAPE = KVShape(layers=1, heads=1, head_dim=2)


def build(group, device_pages: int, policy: str = "write_through") -> HiCache:
    device, host = DeviceKVPool(SHAPE, device_pages * PS, PS), HostKVPool(SHAPE, 16 * PS, PS)
    return HiCache(device, host, CacheConfig(write_policy=policy), ManualExecutor(device, host), group=group)


def serve(cache: HiCache, tokens: list[int]) -> None:
    m = cache.match_prefix(tokens)
    cache.insert(tokens, torch.cat([m.device_indices, cache.alloc_device(len(tokens) - m.device_hit_length)]))


def outcome(fn) -> tuple:
    try:
        return ("ok", fn())
    except HiCacheError as exc:
        return (type(exc).__name__, str(exc))


def drift(rank: int, world: int, pg) -> dict:
    """What each way of going apart gives this rank (module level: the rank processes import it)."""
    group = RankGroup(pg, timeout_s=60.0)
    seen: dict = {"other sizes": outcome(lambda: build(group, 6 if rank == 0 else 4))}
    cache = build(group, 6)  # the refused build left nothing behind: the same group builds again
    seen["same sizes"] = ("ok",)
    for i in range(4):  # alike on both ranks: every step agrees
        serve(cache, [10 * i + t for t in range(2 * PS)])
        for job in list(cache.executor.pending_jobs()):
            cache.executor.complete(job.id)
        cache.poll()
    cache.close()
    quiet = build(group, 6, policy="write_back")  # no job at insert: only the tree can tell
    serve(quiet, list(range(2 * PS)))
    if rank == 1:
        serve(quiet, list(range(100, 100 + PS)))  # a request only this rank was fed
    seen["one rank fed more"] = outcome(quiet.poll)
    return seen


def test_ranks_built_alike_agree_and_ranks_that_went_apart_are_told_at_once():
    outcomes = [o.unwrap() for o in run_ranks(drift, 2, timeout_s=300, group_timeout_s=60)]
    for seen in outcomes:
        kind, message = seen["other sizes"]
        assert kind == ConfigError.__name__ and "device tokens" in message and "host tokens" not in message
        assert seen["same sizes"] == ("ok",)
        assert seen["one rank fed more"][0] == RanksDiverged.__name__
        assert "pool state" in seen["one rank fed more"][1]


def test_a_lone_rank_builds_without_any_collective():
    cache = build(RankGroup(None), 6)
    assert cache.group.collectives == 0 and cache.agreement.sections == []
    cache.close()
