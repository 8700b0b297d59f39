"""Ranks whose caches go apart without a job to tell are caught, not left to hang a model collective.

The step agreement compares the ranks' pending jobs; a device eviction of
backed-up KV, or a request one rank never saw under ``write_back``, emits
none. So the ranks compare their configurations when the caches are built,
and their node counts and free pages at every ``poll``.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_fsm.cache import HiCache
from hicache_fsm.config import CacheConfig
from hicache_fsm.errors import ConfigError, HiCacheError, RanksDiverged
from hicache_fsm.executors import ManualExecutor
from hicache_fsm.pools import DeviceKVPool, HostKVPool, KVShape
from hicache_fsm.radix import content_mark
from hicache_fsm.testing.ranks import run_ranks
from hicache_fsm.tp import RankGroup

PS = 4
SHAPE = KVShape(layers=1, heads=1, head_dim=2)


def build(group, device_pages: int, policy: str = "write_through", shape: KVShape = SHAPE) -> HiCache:
    device, host = DeviceKVPool(shape, device_pages * PS, PS), HostKVPool(shape, 16 * PS, PS)
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
    # the heads are each rank's shard; the layers and the dtype are the model's
    seen["other heads"] = outcome(lambda: build(group, 6, shape=KVShape(1, 1 + rank, 2)).close())
    seen["other layers"] = outcome(lambda: build(group, 6, shape=KVShape(1 + rank, 1, 2)))
    seen["other dtype"] = outcome(lambda: build(group, 6, shape=KVShape(1, 1, 2, torch.float16 if rank else
                                                                        torch.float32)))
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
        assert seen["other heads"] == ("ok", None)
        for part, named in (("other layers", "KV layers"), ("other dtype", "KV dtype")):
            kind, message = seen[part]
            assert kind == ConfigError.__name__ and named in message and "device tokens" not in message
        assert seen["one rank fed more"][0] == RanksDiverged.__name__
        assert "pool state" in seen["one rank fed more"][1]


def test_a_lone_rank_builds_without_any_collective():
    cache = build(RankGroup(None), 6)
    assert cache.group.collectives == 0 and cache.agreement.sections == []
    cache.close()


def other_tokens_same_shape(rank: int, world: int, pg) -> tuple:
    """Each rank fed another request of the same length: node counts and free pages agree, the tokens do not."""
    group = RankGroup(pg, timeout_s=60.0)
    seen = []
    for policy in ("write_through", "write_back"):
        cache = build(group, 6, policy)
        serve(cache, [rank * 1000 + t for t in range(2 * PS)])
        for job in list(cache.executor.pending_jobs()):
            cache.executor.complete(job.id)
        seen.append(outcome(cache.poll))
        cache.close()
    return tuple(seen)


def test_ranks_fed_other_requests_of_the_same_shape_are_told_at_the_first_poll():
    """Passed a poll: only the next step's match, hitting on one rank alone, showed it (after the model's
    collectives had run on other work)."""
    for seen in [o.unwrap() for o in run_ranks(other_tokens_same_shape, 2, timeout_s=300, group_timeout_s=60)]:
        assert [kind for kind, *_ in seen] == [RanksDiverged.__name__] * 2, seen
        assert all("pool state" in message for _, message in seen)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["serve", "evict", "evict_host"]), st.integers(0, 3), st.integers(1, 3)),
                max_size=12))
def test_the_content_mark_is_the_xor_of_every_nodes_mark(steps):
    cache = build(RankGroup(None), 8)
    cache.tree.marking = True
    for op, first, pages in steps:
        if op == "serve":
            tokens = [first * 7 + t for t in range(pages * PS)]  # prefixes shared and split
            if cache.device_allocator.available_tokens + 8 * PS >= len(tokens):
                serve(cache, tokens)
        elif op == "evict":
            cache.evict(pages * PS)
        else:
            cache.evict_host(pages * PS)
        for job in list(cache.executor.pending_jobs()):
            cache.executor.complete(job.id)
        cache.poll()
        want = 0
        for node in cache.tree.nodes():
            if node.parent is not None:
                want ^= content_mark(node, cache.tree.page_bytes)
        assert cache.tree.content_mark == want
    cache.close()
