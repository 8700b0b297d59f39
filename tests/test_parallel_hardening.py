"""Bad input at the parallel surfaces: TP groups, CP layouts and layer writes, executors, copies.

Every case here once crashed with an untyped error, hung, aborted a rank
process, or silently did the wrong thing. Each now gets a typed
``HiCacheError`` and changes nothing.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_fsm.cache import HiCache
from hicache_fsm.config import CacheConfig
from hicache_fsm.copy import backup_to_host, load_all_layers, plan_runs
from hicache_fsm.cp import CPLayout, build_cp_pools
from hicache_fsm.cp_world import build_cp_world
from hicache_fsm.errors import (BadIndices, ConfigError, GroupError, GuardRejected, HiCacheError, LayerWriteError,
                                RanksDiverged, UnknownJob)
from hicache_fsm.executors import ManualExecutor, TorchExecutor
from hicache_fsm.jobs import JobKind, TransferJob, merge_jobs
from hicache_fsm.layer_write import LayerWriteRuntime
from hicache_fsm.pools import DeviceKVPool, HostKVPool, KVShape, PoolConfig
from hicache_fsm.testing.ranks import run_ranks
from hicache_fsm.tp import MAX_TIMEOUT_S, RankGroup

PS = 2
SHAPE = KVShape(layers=2, heads=1, head_dim=4)
QUICK = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def pages(*ids: int) -> torch.Tensor:
    p = torch.as_tensor(ids, dtype=torch.int64)
    return (p[:, None] * PS + torch.arange(PS)).reshape(-1)


def pools(layout: str = "layer_first", seed: int = 0) -> tuple[DeviceKVPool, HostKVPool]:
    dev, host = DeviceKVPool(SHAPE, 8 * PS, PS), HostKVPool(SHAPE, 8 * PS, PS, layout)
    gen = torch.Generator().manual_seed(seed)
    dev.kv.copy_(torch.randn(dev.kv.shape, generator=gen))
    host.kv.copy_(torch.randn(host.kv.shape, generator=gen))
    return dev, host


# ====================================================================== tensor parallel: RankGroup


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 1e20, MAX_TIMEOUT_S * 2])
def test_rank_group_refuses_an_unbounded_timeout(bad):
    """The timeout is a failure guard: infinity (a hang) and values the clocks overflow on are refused."""
    with pytest.raises(ConfigError, match=f"<= {MAX_TIMEOUT_S:g}, got"):  # the bound the message names is the group's
        RankGroup(None, timeout_s=bad)
    assert RankGroup(None, timeout_s=MAX_TIMEOUT_S).timeout_s == MAX_TIMEOUT_S


@pytest.mark.parametrize("bad", [[1.5], ["3"], [2**70], [[1, 2]], None, 5])
def test_a_reduction_of_non_ints_is_refused_on_one_rank_too(bad):
    """A float was truncated and a str parsed by numpy on a group; a lone rank echoed them back."""
    solo = RankGroup(None)
    with pytest.raises(ConfigError):
        solo.min(bad)
    with pytest.raises(ConfigError):
        solo.all_gather([1, 2])
    assert solo.min([3, -1, True]) == [3, -1, 1]


def group_misuse(rank: int, world: int, pg) -> dict:
    """What each misuse of a 2-rank group gives this rank (module level: the rank processes import it)."""
    import torch.distributed as dist

    seen: dict = {}

    def outcome(key, fn):
        try:
            seen[key] = ("ok", fn())
        except HiCacheError as exc:
            seen[key] = (type(exc).__name__,)
        except Exception as exc:  # noqa: BLE001 - an untyped error is what the test looks for
            seen[key] = ("untyped " + type(exc).__name__,)

    outcome("str group", lambda: RankGroup("not a group", timeout_s=30.0))
    lone = dist.new_group(ranks=[0])  # a collective call on every rank; only rank 0 is a member
    outcome("not a member", lambda: RankGroup(lone, timeout_s=30.0).size)
    group = RankGroup(pg, timeout_s=30.0)  # a guard only: mismatches are seen by the agreed header
    outcome("dtypes differ", lambda: group.all_gather(torch.zeros(4, dtype=torch.float32 if rank else torch.int32)))
    outcome("shapes differ", lambda: group.all_gather(torch.zeros(3 + 2 * rank)))
    outcome("same", lambda: [t.tolist() for t in group.all_gather(torch.full((2,), float(rank)))])
    if rank == 1:
        return seen  # rank 1 leaves: rank 0's next collective must fail, not hang
    try:  # the reason is kept: a peer that left is seen at once, not after the group's timeout
        seen["peer gone"] = ("ok", group.min([1]))
    except HiCacheError as exc:
        seen["peer gone"] = (type(exc).__name__, str(exc))
    return seen


def test_group_misuse_gives_typed_errors_on_every_rank_and_no_rank_dies():
    outcomes = run_ranks(group_misuse, 2, timeout_s=300, group_timeout_s=60)
    seen = [o.unwrap() for o in outcomes]
    for rank, s in enumerate(seen):
        assert s["str group"] == ("ConfigError",)
        assert s["not a member"] == (("ok", 1) if rank == 0 else ("ConfigError",))
        assert s["dtypes differ"] == ("RanksDiverged",)  # gloo gathered the bytes of the other dtype
        assert s["shapes differ"] == ("RanksDiverged",)  # gloo aborted the process
        assert s["same"] == ("ok", [[0.0, 0.0], [1.0, 1.0]])  # the group goes on after a refused gather
    kind, reason = seen[0]["peer gone"]
    assert kind in ("RankTimeout", "GroupError"), reason
    assert any(words in reason for words in ("by peer", "Broken pipe", "Connection closed")), reason  # not a timeout
    assert issubclass(RanksDiverged, GroupError)


# ====================================================================== context parallel: layout


@QUICK
@given(world=st.integers(1, 4), block=st.integers(1, 3), index=st.integers(-40, 80))
def test_every_rank_refuses_the_same_out_of_range_slot(world, block, index):
    """An index outside the logical pool was 'owned' by some rank and skipped silently by the others."""
    layouts = [CPLayout(world, r, PS, 16 * PS, block) for r in range(world)]
    idx = torch.tensor([index])
    answers = []
    for lay in layouts:
        try:
            answers.append(bool(lay.owned_by_this_rank(idx)[0]))
        except BadIndices:
            answers.append(None)
    if 0 <= index < 16 * PS:
        assert answers.count(True) == 1 and None not in answers  # exactly one owner
    else:
        assert answers == [None] * world


def test_scatter_kv_refuses_bad_kv_and_slots_on_every_rank_writing_nothing():
    cfg = PoolConfig(shape=SHAPE, device_tokens=16 * PS, page_size=PS, host_tokens=24 * PS)
    ranks = [build_cp_pools(cfg, 2, r) for r in range(2)]
    layouts = [p.device.layout for p in ranks]
    k = torch.ones(SHAPE.layers, 2 * PS, 1, 4)
    cases = [
        (pages(0, 1), torch.ones(SHAPE.layers, 3, 1, 4), k, None),  # too few tokens of k
        (pages(0, 1), k, k[:, :1], None),  # v too short
        (pages(0, 1), torch.ones(PS, 1, 4), k[0], 0),  # one layer: k has too few tokens
        (torch.tensor([32, 33, 34, 35]), k, k, None),  # past the logical pool (page 16 and 17: both ranks)
        (torch.tensor([-2, -1, 0, 1]), k, k, None),
    ]
    for logical, kk, vv, layer in cases:
        for lay, p in zip(layouts, ranks):
            before = p.device.kv.clone()
            with pytest.raises(BadIndices):
                lay.scatter_kv(p.device, logical, kk, vv, layer)
            assert torch.equal(p.device.kv, before)


# ====================================================================== context parallel: layer writes


def cp_config(draft: bool = False) -> PoolConfig:
    return PoolConfig(shape=SHAPE, device_tokens=16 * PS, page_size=PS, host_tokens=24 * PS,
                      draft_shape=KVShape(layers=1, heads=1, head_dim=4) if draft else None)


def test_backup_of_a_node_that_is_not_device_only_is_refused():
    (r,) = build_cp_world(cp_config(), 1, cache_config=CacheConfig(write_policy="write_back"))
    cache = r.cache
    node = cache.insert(tuple(range(4 * PS)), cache.alloc_device(4 * PS)).node
    assert r.writes.backup(node)
    cache.poll()
    for expect in ("device_host", "host"):
        assert node.state == expect
        snap = cache.snapshot()
        with pytest.raises(GuardRejected):
            r.writes.backup(node)  # host-only: a TypeError on its device slots
        assert cache.snapshot() == snap
        cache.evict(4 * PS)
    cache.check_invariants()


def test_load_cp_wants_an_iterable_of_nodes():
    (r,) = build_cp_world(cp_config(), 1)
    node = r.cache.insert(tuple(range(2 * PS)), r.cache.alloc_device(2 * PS)).node
    for bad in (node, None, 3):
        snap = r.cache.snapshot()
        with pytest.raises(LayerWriteError):
            r.writes.load_cp(bad)
        assert r.cache.snapshot() == snap


def test_runtime_refuses_a_cache_that_already_backed_nodes_up():
    """Their host copies have no owner pattern: invariants broke at once and their load-back raised."""
    p = build_cp_pools(cp_config(), 2, 0)
    cache = HiCache(p.device, p.host, CacheConfig(write_policy="write_through"))
    device_only = cache.insert(tuple(range(PS)), cache.alloc_device(PS)).node
    cache.poll()
    assert device_only.state == "device_host"
    with pytest.raises(ConfigError):
        LayerWriteRuntime(cache)
    assert cache.cp is None
    cache.reset()
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError):
            LayerWriteRuntime(cache, history=bad)
    rt = LayerWriteRuntime(cache)
    assert cache.cp is rt
    node = cache.insert(tuple(range(PS)), cache.alloc_device(PS)).node  # now backed up the CP way
    cache.poll()
    assert node.state == "device_host" and node.cp_meta is not None
    cache.check_invariants()


STEPS = st.lists(st.sampled_from(["insert", "layer", "bad_layer", "complete", "fail", "backup", "evict", "load",
                                  "reset", "stale"]), min_size=1, max_size=30)


@QUICK
@given(world=st.sampled_from([1, 2, 3]), steps=STEPS, seed=st.integers(0, 2**16))
def test_layer_writes_in_any_order_with_failures_and_resets_keep_every_rank_sound(world, steps, seed):
    """Lockstep ranks: layers out of order, repeated and out of range; copies failed; resets with copies
    in flight whose stale completions arrive later; backups and loads of nodes in any state. Every call
    either works or raises a typed error changing nothing, and every rank's invariants hold (no leak)."""
    rng = random.Random(seed)
    world_ = build_cp_world(cp_config(draft=True), world, cache_config=CacheConfig(write_policy="write_back"),
                            executor_factory=lambda p: ManualExecutor(p.device, p.host, p.draft_device, p.draft_host))
    stale: list[list[int]] = [[] for _ in world_]
    tokens = 0
    for step in steps:
        pick = rng.random()
        layer = rng.randrange(-1, 4)
        for i, r in enumerate(world_):
            cache, ex, rt = r.cache, r.cache.executor, r.writes
            nodes = [n for n in cache.tree.nodes() if not n.is_root]
            node = nodes[int(pick * len(nodes))] if nodes else None
            snap = cache.snapshot()
            try:
                if step == "insert":
                    slots = cache.alloc_device(2 * PS)
                    if slots is not None:
                        n = cache.insert(tuple(range(tokens, tokens + 2 * PS)), slots).node
                        if n.state == "device":
                            rt.reserve(n)
                elif step in ("layer", "bad_layer"):
                    rt.on_layer_end(layer if step == "layer" else layer + 4, "target" if layer % 2 else "draft")
                elif step in ("complete", "fail"):
                    cache.flush()
                    ids = ex.pending_job_ids()
                    if ids:
                        j = ids[int(pick * len(ids))]
                        ex.complete(j) if step == "complete" else ex.fail(j)
                    cache.poll()
                elif step == "backup" and node is not None:
                    rt.backup(node)
                elif step == "evict":
                    cache.evict(2 * PS)
                elif step == "load" and node is not None:
                    cache.load_back(node)
                elif step == "reset":
                    cache.flush()
                    stale[i] = ex.pending_job_ids()
                    cache.reset()
                elif step == "stale" and stale[i]:
                    ex.complete(stale[i].pop()) if stale[i][-1] in ex.pending_job_ids() else stale[i].pop()
                    cache.poll()
            except HiCacheError:
                assert cache.snapshot() == snap
            cache.check_invariants()
        tokens += 2 * PS


# ====================================================================== executors


def test_manual_executor_unknown_job_ids_are_typed_and_change_nothing():
    dev, host = pools()
    ex = ManualExecutor(dev, host)
    (batch,) = merge_jobs([TransferJob(JobKind.D2H, (1,), pages(0), pages(1))])
    ex.submit(batch)
    (job_id,) = ex.pending_job_ids()
    before = host.kv.clone()
    for bad in ([job_id], {job_id: 1}, True, job_id + 1, None):
        with pytest.raises(UnknownJob):
            ex.complete(bad)  # an unhashable id was a TypeError; True completed job 1
        with pytest.raises(UnknownJob):
            ex.fail(bad)
    assert ex.pending_job_ids() == [job_id] and ex.poll() == [] and torch.equal(host.kv, before)
    ex.complete(job_id)
    assert [c.job_id for c in ex.poll()] == [job_id]


@pytest.mark.parametrize("executor", [TorchExecutor, ManualExecutor])
def test_a_batch_naming_one_job_twice_is_refused(executor):
    """The CPU executor copied it twice and reported it twice: the second report was an unknown job."""
    dev, host = pools()
    ex = executor(dev, host)
    job = TransferJob(JobKind.D2H, (1,), pages(0), pages(1))
    (batch,) = merge_jobs([job, job])
    before = host.kv.clone()
    with pytest.raises(BadIndices):
        ex.submit(batch)
    assert ex.poll() == [] and torch.equal(host.kv, before)
    ex.close()
    ex.close()  # a second close is a no-op
    with pytest.raises(ConfigError):
        ex.submit(merge_jobs([job])[0])


# ====================================================================== copies with runs given by hand


RUN = st.tuples(st.integers(-3 * PS, 9 * PS), st.integers(-3 * PS, 9 * PS), st.integers(-PS, 4 * PS))


@QUICK
@given(runs=st.lists(RUN, max_size=4), layout=st.sampled_from(["layer_first", "page_first"]),
       direction=st.sampled_from(["d2h", "h2d"]))
def test_hand_given_runs_copy_exactly_or_are_refused_changing_nothing(runs, layout, direction):
    """A negative start was taken from the end of the pool and a partial page copied: wrong bytes, no error."""
    dev, host = pools(layout)
    want_dev, want_host = dev.read(torch.arange(dev.size_tokens)), host.read(torch.arange(host.size_tokens))
    valid = all(d >= 0 and h >= 0 and n > 0 and d % PS == h % PS == n % PS == 0
                and d + n <= dev.size_tokens and h + n <= host.size_tokens for d, h, n in runs)
    copy = backup_to_host if direction == "d2h" else load_all_layers
    if not valid:
        with pytest.raises(BadIndices):
            copy(dev, host, runs=runs)
        assert all(torch.equal(a, b) for a, b in zip(dev.read(torch.arange(dev.size_tokens)), want_dev))
        assert all(torch.equal(a, b) for a, b in zip(host.read(torch.arange(host.size_tokens)), want_host))
        return
    copy(dev, host, runs=runs)
    src, dst = (want_dev, host) if direction == "d2h" else (want_host, dev)
    for d, h, n in runs[-1:]:  # the last run's bytes are what it copied, whatever the earlier runs overlapped
        s, t = (d, h) if direction == "d2h" else (h, d)
        got = dst.read(torch.arange(t, t + n))
        assert all(torch.equal(g, w[:, s:s + n]) for g, w in zip(got, src))


@pytest.mark.parametrize("bad", ["abc", [(0.5, 0, PS)], [(0, 0)], [(True, 0, PS)], [(0, 0, PS, 1)], 7])
def test_malformed_runs_are_refused(bad):
    dev, host = pools()
    with pytest.raises(BadIndices):
        backup_to_host(dev, host, runs=bad)
    assert backup_to_host(dev, host, runs=plan_runs(pages(1), pages(2), PS)) is None
    assert torch.equal(host.read(pages(2))[0], dev.read(pages(1))[0])
