"""Context-parallel per-layer writes, CP loads and draft KV (hicache_fsm.cp, hicache_fsm.layer_write)."""

from __future__ import annotations

import functools
import random

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_fsm.bindings.residency import LOADING, ON_DEVICE, ON_HOST
from hicache_fsm.cp_world import build_cp_rank, build_cp_world
from hicache_fsm.config import CacheConfig
from hicache_fsm.cp import CPLayout, CPPageAllocator, build_cp_pools
from hicache_fsm.errors import AllocationError, BadIndices, ConfigError, GuardRejected, LayerWriteError
from hicache_fsm.executors import ManualExecutor
from hicache_fsm.jobs import JobKind
from hicache_fsm.layer_write import LayerWriteRuntime
from hicache_fsm.model import TinyModel
from hicache_fsm.pools import PoolConfig

PS = 2
TARGET = TinyModel(layers=3, heads=2, head_dim=4, vocab=32, seed=11)
DRAFT = TinyModel(layers=2, heads=1, head_dim=4, vocab=32, seed=12)  # the draft model has fewer layers


PAD = 16


@functools.lru_cache(maxsize=None)
def kv_of(tokens: tuple[int, ...]):
    """Target and draft K/V (layers, n, heads, head_dim) of every token of ``tokens``.

    Always a prefill of PAD tokens (zero padded): causal attention makes each
    token's KV depend on its prefix only, and one shape keeps float reductions
    identical, so a prefix's KV is bit-identical whatever continues it.
    """
    padded = tuple(tokens) + (0,) * (PAD - len(tokens))
    _, k, v = TARGET.prefill(padded)
    _, dk, dv = DRAFT.prefill(padded)
    n = len(tokens)
    return k[:, :n], v[:, :n], dk[:, :n], dv[:, :n]


def manual(pools):
    return ManualExecutor(pools.device, pools.host, pools.draft_device, pools.draft_host)


def pool_config(logical=64, host=96, draft=True):
    return PoolConfig(shape=TARGET.kv_shape, device_tokens=logical, page_size=PS, host_tokens=host,
                      draft_shape=DRAFT.kv_shape if draft else None)


def world_of(n, block_pages=1, policy="write_back", executor=None, **kw):
    return build_cp_world(pool_config(**kw), n, block_pages, CacheConfig(write_policy=policy), executor)


def write_kv(rank, logical, tokens, layer=None, source="target"):
    """Engine side: compute KV and store this rank's owned pages (one layer, or all)."""
    k, v, dk, dv = kv_of(tuple(tokens))
    if source == "target":
        pool, k, v = rank.pools.device, k, v
    else:
        pool, k, v = rank.pools.draft_device, dk, dv
    if layer is None:
        rank.layout.scatter_kv(pool, logical, k, v)
    else:
        rank.layout.scatter_kv(pool, logical, k[layer], v[layer], layer=layer)


def node_kv(cache, node):
    """Expected (k, v, dk, dv) of the node's own tokens."""
    seq = cache.tree.prefix_tokens(node)
    return tuple(t[:, len(seq) - node.num_tokens:] for t in kv_of(seq))


def check_device_kv(rank, node):
    k, v, dk, dv = node_kv(rank.cache, node)
    mask = rank.layout.owned_by_this_rank(node.device_indices)
    for pool, want_k, want_v in ((rank.pools.device, k, v), (rank.pools.draft_device, dk, dv)):
        if pool is None:
            continue
        got_k, got_v = rank.layout.gather_kv(pool, node.device_indices)
        assert torch.equal(got_k, want_k[:, mask]) and torch.equal(got_v, want_v[:, mask]), f"device KV of node {node.id}"


def check_host_kv(rank, node):
    k, v, dk, dv = node_kv(rank.cache, node)
    mask = node.cp_meta.owned_mask(rank.layout.rank)
    got_k, got_v = rank.pools.host.read(node.host_indices)
    assert torch.equal(got_k, k[:, mask]) and torch.equal(got_v, v[:, mask]), f"host KV of node {node.id}"
    if rank.pools.draft_host is not None:
        got_k, got_v = rank.pools.draft_host.read(node.cp_meta.draft_host_indices)
        assert torch.equal(got_k, dk[:, mask]) and torch.equal(got_v, dv[:, mask]), f"draft host KV of node {node.id}"


def check_all_kv(rank):
    for n in rank.cache.tree.nodes():
        if n.is_root:
            continue
        if n.state in ON_DEVICE:
            check_device_kv(rank, n)
        if n.state in ON_HOST and n.state not in LOADING:
            check_host_kv(rank, n)


def full_snapshot(rank):
    return rank.cache.snapshot()


def settle(cache):
    """Start queued copies, wait for them (CUDA streams run asynchronously) and apply completions."""
    cache.flush()
    cache.executor.synchronize()
    cache.poll()


# =========================================================================== layout


@pytest.mark.parametrize("world,block", [(1, 1), (2, 1), (4, 1), (3, 2), (4, 3)])
def test_owner_function_and_physical_mapping(world, block):
    pages = 26
    layouts = [CPLayout(world, r, PS, pages * PS, block) for r in range(world)]
    ids = torch.arange(pages)
    owners = layouts[0].owner_for_logical_pages(ids)
    assert torch.equal(owners, (ids // block) % world)  # block-cyclic, a pure function of the page id
    assert sum(lay.physical_pages for lay in layouts) == pages
    for lay in layouts:
        assert torch.equal(lay.owner_for_logical_pages(ids), owners)  # every rank agrees
        logical = (ids[owners == lay.rank][:, None] * PS + torch.arange(PS)).reshape(-1)
        assert bool(lay.owned_by_this_rank(logical).all())
        phys = lay.logical_locs_to_physical(logical)
        assert sorted(phys.tolist()) == list(range(lay.physical_tokens))  # dense and one-to-one
        others = (ids[owners != lay.rank][:, None] * PS + torch.arange(PS)).reshape(-1)
        assert not bool(lay.owned_by_this_rank(others).any())
        if others.numel():
            with pytest.raises(BadIndices):
                lay.logical_locs_to_physical(others[:PS])


def test_layout_rejects_bad_config():
    with pytest.raises(ConfigError):
        CPLayout(2, 2, PS, 16)
    with pytest.raises(ConfigError):
        CPLayout(0, 0, PS, 16)
    with pytest.raises(ConfigError):
        CPLayout(2, 0, PS, 15)
    with pytest.raises(ConfigError):  # rank 3 would own no page
        build_cp_pools(pool_config(logical=3 * PS), 4, 3)


def test_alloc_pages_with_owners_replays_pattern():
    lay = CPLayout(4, 1, PS, 32 * PS)
    alloc = CPPageAllocator(lay)
    held = alloc.alloc(5 * PS)
    pattern = [3, 0, 0, 2, 1, 3, 3]
    idx = alloc.alloc_pages_with_owners(pattern)
    assert lay.page_owners(idx).tolist() == pattern
    assert not set(idx[::PS].div(PS, rounding_mode="floor").tolist()) & set(held[::PS].div(PS, rounding_mode="floor").tolist())
    assert alloc.alloc_pages_with_owners([]).numel() == 0
    before = (alloc.free_pages, alloc.owned_pages())
    assert alloc.alloc_pages_with_owners([2] * 9) is None  # only 8 pages of rank 2 exist
    assert (alloc.free_pages, alloc.owned_pages()) == before
    with pytest.raises(BadIndices):
        alloc.alloc_pages_with_owners([4])
    alloc.free(idx)
    alloc.free(held)
    assert alloc.free_pages == 32


# =========================================================================== end to end, lockstep ranks


@pytest.mark.parametrize("world,block", [(1, 1), (2, 1), (4, 1), (2, 2)])
def test_per_layer_write_evict_load_bit_exact(world, block):
    ranks = world_of(world, block)
    tokens = tuple(range(1, 13))  # 6 pages
    rng = random.Random(world * 10 + block)
    done = {r.layout.rank: [] for r in ranks}
    for r in ranks:
        r.cache.add_observer(lambda e, rk=r.layout.rank: e.get("trigger") == "write_done" and done[rk].append(e["node"]))
        r.pools.device.kv.fill_(7.0)  # garbage where KV was not computed yet
        r.pools.draft_device.kv.fill_(7.0)
    idx = [r.cache.alloc_device(len(tokens)) for r in ranks]
    assert all(torch.equal(i, idx[0]) for i in idx)  # the ranks hand out the same logical slots
    nodes = [r.cache.insert(tokens, i).node for r, i in zip(ranks, idx)]
    writes = [r.writes.reserve(n) for r, n in zip(ranks, nodes)]
    pattern = ranks[0].layout.page_owners(idx[0])
    for r, n, w in zip(ranks, nodes, writes):
        assert w.state == "reserved" and n.state == "writing_host"
        assert torch.equal(n.cp_meta.page_owners, pattern)
        assert n.host_indices.numel() == int((pattern == r.layout.rank).sum()) * PS
    # the model's layers end in some order, target and draft interleaved, with repeats
    ends = [("target", i) for i in range(3)] + [("draft", i) for i in range(2)]
    rng.shuffle(ends)
    ends += rng.sample(ends, 3)
    seen = set()
    for source, layer in ends:
        for r, i in zip(ranks, idx):
            write_kv(r, i, tokens, layer, source)
            before = len(r.cache.pending_jobs())
            emitted = r.writes.on_layer_end(layer, source)
            assert emitted == (0 if (source, layer) in seen else 1)
            if emitted:
                job = r.cache.pending_jobs()[-1]
                assert (job.kind, job.layer, job.draft) == (JobKind.D2H, layer, source == "draft")
            assert len(r.cache.pending_jobs()) == before + emitted
            # the copy ran for this layer only: host layers not yet submitted are still zero
            r.cache.executor.synchronize()
            n = nodes[r.layout.rank]
            host = r.pools.host if source == "target" else r.pools.draft_host
            hk, _ = host.read(n.host_indices if source == "target" else n.cp_meta.draft_host_indices)
            for other in range(hk.shape[0]):
                if (source, other) not in seen | {(source, layer)}:
                    assert not bool(hk[other].any())
            r.cache.check_invariants()
        seen.add((source, layer))
    for r, n, w in zip(ranks, nodes, writes):
        settle(r.cache)
        r.cache.check_invariants()
        assert w.state == "acked" and w.acks == 1 and n.state == "device_host"
        assert done[r.layout.rank] == [n.id]  # exactly one write_done
        check_host_kv(r, n)
        assert r.writes.on_layer_end(0) == 0  # nothing pending any more

    for r, n in zip(ranks, nodes):
        assert r.cache.evict(100) >= len(tokens) and n.state == "host"
        r.pools.device.kv.normal_()
        r.pools.draft_device.kv.normal_()
        r.cache.alloc_device(PS)  # the engine holds a page: a plain allocation would shift the owner pattern
    loads = []
    for r in ranks:
        m = r.cache.match_prefix(tokens)
        assert m.host_hit_length == len(tokens)
        loads.append(r.cache.load_back(m.last_host_node))
    assert all(torch.equal(lb.device_indices, loads[0].device_indices) for lb in loads)
    assert torch.equal(ranks[0].layout.page_owners(loads[0].device_indices), pattern)
    for r, n in zip(ranks, nodes):
        settle(r.cache)
        r.cache.check_invariants()
        assert n.state == "device_host"
        check_device_kv(r, n)


def test_zero_owned_rank_acks_at_once_and_loads_an_empty_job():
    ranks = world_of(4, block_pages=4)  # blocks of 4 pages: a 2-page node lives on rank 0 only
    tokens = (5, 6, 7, 8)
    for r in ranks:
        i = r.cache.alloc_device(len(tokens))
        write_kv(r, i, tokens)
        write_kv(r, i, tokens, source="draft")
        node = r.cache.insert(tokens, i).node
        w = r.writes.reserve(node)
        if r.layout.rank == 0:
            assert w.state == "reserved"
            r.writes.submit_all(w)
            settle(r.cache)
        else:
            assert w.state == "acked" and w.acks == 1 and node.state == "device_host"
            assert node.host_indices.numel() == 0 and node.cp_meta.draft_host_indices.numel() == 0
            assert not r.cache.pending_jobs() and r.writes.on_layer_end(1) == 0
        assert w.state == "acked" and node.state == "device_host"
        r.cache.check_invariants()
        assert r.cache.evict(100) == len(tokens)
        lb = r.writes.load_cp([node])
        (job,) = r.cache.pending_jobs()
        assert job.kind is JobKind.H2D and job.node_ids == (node.id,)
        assert job.num_tokens == (len(tokens) if r.layout.rank == 0 else 0)  # empty job keeps acks in line
        settle(r.cache)
        assert node.state == "device_host" and lb.handle.done()
        r.cache.check_invariants()
        check_device_kv(r, node)


def test_zero_owned_rank_of_a_group_submits_empty_copies_of_every_layer():
    # built with a rank group, the runtime agrees completions job by job (tests/test_cp_ranks.py runs real ranks);
    # here each rank is told so directly, to check the empty copies with draft pools and invariants in one process
    ranks = world_of(4, block_pages=4)  # a 2-page node lives on rank 0 only
    tokens = (5, 6, 7, 8)
    for r in ranks:
        r.writes.agreed = True
        i = r.cache.alloc_device(len(tokens))
        write_kv(r, i, tokens)
        write_kv(r, i, tokens, source="draft")
        node = r.cache.insert(tokens, i).node
        w = r.writes.reserve(node)
        assert w.state == "reserved"  # not zero_owned: no rank acks alone
        r.writes.submit_all(w)
        jobs = r.cache.pending_jobs()
        assert sorted((j.layer, j.draft) for j in jobs) == [(0, False), (0, True), (1, False), (1, True), (2, False)]
        assert {j.num_tokens for j in jobs} == {len(tokens) if r.layout.rank == 0 else 0}
        assert node.state == "writing_host"
        settle(r.cache)
        assert w.state == "acked" and w.acks == 1 and node.state == "device_host"
        r.cache.check_invariants()
        r.cache.evict(100)
        r.writes.load_cp([node])
        settle(r.cache)
        assert node.state == "device_host"
        r.cache.check_invariants()
        check_device_kv(r, node)


def test_write_through_catches_up_every_layer():
    (r,) = world_of(1, policy="write_through")
    tokens = tuple(range(10, 18))
    i = r.cache.alloc_device(len(tokens))
    write_kv(r, i, tokens)
    write_kv(r, i, tokens, source="draft")
    node = r.cache.insert(tokens, i).node
    jobs = r.cache.pending_jobs()
    assert sorted((j.layer, j.draft) for j in jobs) == [(0, False), (0, True), (1, False), (1, True), (2, False)]
    assert node.state == "writing_host"
    settle(r.cache)
    assert node.state == "device_host"
    r.cache.check_invariants()
    check_host_kv(r, node)


def test_split_during_write_shares_the_final_ack():
    ranks = world_of(2)
    tokens = tuple(range(1, 13))
    for r in ranks:
        i = r.cache.alloc_device(len(tokens))
        write_kv(r, i, tokens)
        write_kv(r, i, tokens, source="draft")
        node = r.cache.insert(tokens, i).node
        w = r.writes.reserve(node)
        r.writes.on_layer_end(0)
        r.cache.match_prefix(tokens[:6])  # splits the node mid-write
        upper = node.parent
        assert upper.state == "writing_host" and w.nodes == [upper, node]
        r.cache.check_invariants()
        r.writes.submit_all(w)
        settle(r.cache)
        assert upper.state == node.state == "device_host" and w.acks == 1
        r.cache.check_invariants()
        check_host_kv(r, upper)
        check_host_kv(r, node)
        r.cache.evict(100)
        assert upper.state == node.state == "host"
        r.cache.alloc_device(PS)
        r.pools.device.kv.zero_()
        r.pools.draft_device.kv.zero_()
        assert r.cache.load_back(node) is not None
        settle(r.cache)
        r.cache.check_invariants()
        check_device_kv(r, upper)
        check_device_kv(r, node)


def test_failed_copy_returns_node_to_device_and_frees_everything():
    (r,) = world_of(2, executor=manual)[:1]
    ex = r.cache.executor
    tokens = tuple(range(1, 9))
    i = r.cache.alloc_device(len(tokens))
    node = r.cache.insert(tokens, i).node
    host_free, draft_free = r.cache.host_allocator.free_pages, r.writes.draft_host_allocator.free_pages
    w = r.writes.reserve(node)
    r.writes.submit_all(w)
    r.cache.flush()
    ids = ex.pending_job_ids()
    ex.fail(ids[1])
    for j in ids[2:]:
        ex.complete(j)
    settle(r.cache)
    assert node.state == "writing_host" and w.state == "all_submitted"  # one copy still in flight
    ex.complete(ids[0])
    settle(r.cache)
    assert node.state == "device" and node.cp_meta is None and w.acks == 0
    assert (r.cache.host_allocator.free_pages, r.writes.draft_host_allocator.free_pages) == (host_free, draft_free)
    r.cache.check_invariants()
    assert r.writes.reserve(node).state == "reserved"  # a fresh reservation is fine
    r.cache.check_invariants()


def test_reserve_without_room_reports_needed_slots_and_holds_nothing():
    (r,) = world_of(2)[:1]  # rank 0 of 2: owns half the pages
    tokens = tuple(range(1, 13))
    node = r.cache.insert(tokens, r.cache.alloc_device(len(tokens))).node
    hold_host(r.cache, 4)
    snap = full_snapshot(r)
    w = r.writes.reserve(node)
    assert w.state == "failed" and w.needed_slots == 6
    assert node.state == "device" and node.cp_meta is None
    after = full_snapshot(r)
    after["counters"] = snap["counters"]
    assert after == snap
    r.cache.check_invariants()
    # target host has room but draft host does not: the target slots are not kept either
    (r,) = world_of(1)[:1]
    node = r.cache.insert(tokens, r.cache.alloc_device(len(tokens))).node
    hold = r.writes.draft_host_allocator.alloc(r.writes.draft_host_allocator.available_tokens - 4)
    host_free = r.cache.host_allocator.free_pages
    w = r.writes.reserve(node)
    assert w.state == "failed" and w.needed_slots == 12 and r.cache.host_allocator.free_pages == host_free
    r.writes.draft_host_allocator.free(hold)
    r.cache.check_invariants()


def hold_host(cache, leave: int) -> None:
    """Take all but ``leave`` tokens of the host pool (declared, so the leak check knows)."""
    held = cache.host_allocator.alloc(cache.host_allocator.available_tokens - leave)
    cache.register_host_owner(lambda: [("test hold", held)])


def test_backup_evicts_host_kv_to_make_room():
    (r,) = world_of(1)
    hold_host(r.cache, 16)
    first, second = tuple(range(1, 13)), tuple(range(20, 32))
    a = r.cache.insert(first, r.cache.alloc_device(12)).node
    assert r.cache.write_backup(a)
    settle(r.cache)
    r.cache.evict(100)
    assert a.state == "host"
    b = r.cache.insert(second, r.cache.alloc_device(12)).node
    assert r.cache.write_backup(b)  # a's host copy made way
    settle(r.cache)
    assert b.state == "device_host" and not r.cache.tree.owns(a)
    r.cache.check_invariants()


def test_typed_errors_leave_the_cache_unchanged():
    ranks = world_of(2)
    r = ranks[0]
    tokens = tuple(range(1, 13))
    i = r.cache.alloc_device(len(tokens))
    write_kv(r, i, tokens)
    write_kv(r, i, tokens, source="draft")
    node = r.cache.insert(tokens, i).node
    w = r.writes.reserve(node)
    r.writes.on_layer_end(1)

    def rejected(exc, fn, *args, check=True):
        snap = full_snapshot(r)
        with pytest.raises(exc):
            fn(*args)
        assert full_snapshot(r) == snap
        if check:
            r.cache.check_invariants()

    for layer, source in ((3, "target"), (-1, "target"), (2, "draft"), (True, "target"), ("0", "target"), (0, "bogus")):
        rejected(LayerWriteError, r.writes.on_layer_end, layer, source)
        rejected(LayerWriteError, r.writes.submit_layer, w, layer, source)
    rejected(LayerWriteError, r.writes.reserve, node)  # a second reservation
    rejected(LayerWriteError, r.writes.submit_layer, attrs.evolve(w, id=-1), 0)  # a different one
    rejected(LayerWriteError, r.writes.submit_layer, "node", 0)
    r.writes.submit_all(w)
    settle(r.cache)
    rejected(LayerWriteError, r.writes.reserve, node)  # already backed up
    other = r.cache.insert(tuple(range(40, 44)), r.cache.alloc_device(4)).node
    rejected(GuardRejected, r.writes.load_cp, [other])  # on the device, nothing to load
    r.cache.evict(100)
    assert node.state == "host"
    rejected(LayerWriteError, r.writes.load_cp, [node, node])
    upper = r.cache.driver.split(node, 4)
    rejected(LayerWriteError, r.writes.load_cp, [node])  # its parent would stay on the host
    meta, upper.cp_meta = upper.cp_meta, None
    rejected(LayerWriteError, r.writes.load_cp, [upper, node], check=False)  # no CP metadata
    upper.cp_meta = meta

    alloc = r.cache.device_allocator
    real = alloc.alloc_pages_with_owners
    alloc.alloc_pages_with_owners = lambda owners: real(owners[:-1])  # one page short
    rejected(LayerWriteError, r.writes.load_cp, [upper, node])
    alloc.alloc_pages_with_owners = lambda owners: real(torch.flip(torch.as_tensor(owners), [0]))
    rejected(LayerWriteError, r.writes.load_cp, [upper, node])  # right length, wrong owners
    del alloc.alloc_pages_with_owners
    r.cache.check_invariants()

    fresh = r.cache.insert(tuple(range(50, 58)), r.cache.alloc_device(8)).node
    host_alloc = r.writes.draft_host_allocator
    host_alloc.alloc = lambda n: None  # reports room, then refuses
    rejected(AllocationError, r.writes.reserve, fresh)
    del host_alloc.alloc
    assert r.writes.load_cp([upper, node]) is not None
    settle(r.cache)
    r.cache.check_invariants()
    check_device_kv(r, upper)
    check_device_kv(r, node)


def test_a_cp_load_below_a_loading_ancestor_waits_for_its_load():
    """``load_cp`` takes the waits of every ancestor still loading, as ``cache.load_back`` does."""
    (r,) = world_of(1)
    tokens = tuple(range(1, 9))
    i = r.cache.alloc_device(len(tokens))
    write_kv(r, i, tokens)
    write_kv(r, i, tokens, source="draft")
    node = r.cache.insert(tokens, i).node
    r.writes.submit_all(r.writes.reserve(node))
    settle(r.cache)
    r.cache.evict(100)
    upper = r.cache.driver.split(node, 4)
    above = r.writes.load_cp([upper])
    assert upper.state in LOADING
    below = r.writes.load_cp([node])
    assert above.handle in below.handle.deps
    settle(r.cache)
    assert upper.state == node.state == "device_host" and below.handle.done()
    check_device_kv(r, upper)
    check_device_kv(r, node)
    r.cache.check_invariants()


def test_runtime_needs_a_cp_cache_and_attaches_once():
    from hicache_fsm.cache import cache_from_pools
    from hicache_fsm.pools import build_pools

    with pytest.raises(ConfigError):
        LayerWriteRuntime(cache_from_pools(build_pools(pool_config())))
    r = build_cp_rank(pool_config(), 2, 0)
    with pytest.raises(ConfigError):
        LayerWriteRuntime(r.cache)


def test_no_draft_model_rejects_draft_layers():
    (r,) = world_of(1, draft=False)
    tokens = tuple(range(1, 5))
    i = r.cache.alloc_device(4)
    write_kv(r, i, tokens)
    node = r.cache.insert(tokens, i).node
    w = r.writes.reserve(node)
    with pytest.raises(LayerWriteError):
        r.writes.on_layer_end(0, "draft")
    assert r.writes.submit_all(w) == 3
    settle(r.cache)
    assert node.state == "device_host" and node.cp_meta.draft_host_indices is None
    r.cache.evict(100)
    assert r.writes.load_cp([node]) is not None
    settle(r.cache)
    check_device_kv(r, node)
    r.cache.check_invariants()


def test_reset_forgets_writes_and_draft_slots():
    (r,) = world_of(2)[:1]
    node = r.cache.insert(tuple(range(1, 9)), r.cache.alloc_device(8)).node
    r.writes.reserve(node)
    r.writes.on_layer_end(0)
    r.cache.reset()
    assert not r.writes.pending_writes() and r.writes.draft_host_allocator.used_pages == 0
    r.cache.check_invariants()


# =========================================================================== random protocol runs


PAGE_TOKENS = [(1, 2), (3, 4), (1, 5)]  # few distinct prefixes: KV is computed once per sequence
OPS = (["insert"] * 4 + ["reserve"] * 2 + ["layer_end"] * 4 + ["submit_all"] * 2 + ["complete"] * 2
       + ["complete_all"] * 3 + ["evict"] * 3 + ["load"] * 3 + ["evict_host"] * 2
       + ["hold", "release", "fail", "poll", "bad_load", "second_reserve", "flaky_alloc"])


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    world=st.sampled_from([1, 2, 4]),
    rank_frac=st.floats(0, 1, exclude_max=True),
    block=st.sampled_from([1, 2]),
    host=st.sampled_from([8, 16, 48]),  # room beyond the rank's device share
    seed=st.integers(0, 2**32 - 1),
)
def test_random_owner_patterns_layer_orders_and_failures(world, rank_frac, block, host, seed):
    """A random engine against one rank: random owner patterns (engine-held pages shift allocations),
    layer-end orders with repeats and bad layers, ack/fail orders, host-full reservations, broken
    allocators, evictions and CP loads. Invariants and every node's KV (bit for bit) after each step.

    The schedule comes from ``seed`` (Hypothesis draws op by op favour short, trivial runs).
    """
    rng = random.Random(seed)
    rank = int(rank_frac * world)
    host += CPLayout(world, rank, PS, 48, block).physical_tokens
    r = build_cp_rank(pool_config(logical=48, host=host), world, rank, block,
                      CacheConfig(write_policy="write_back"), manual)
    cache, rt, ex = r.cache, r.writes, r.cache.executor
    held: list[torch.Tensor] = []

    def rejected(exc, fn, *args):
        snap = cache.snapshot()
        with pytest.raises(exc):
            fn(*args)
        assert cache.snapshot() == snap

    def live(pred):
        return [n for n in cache.tree.nodes() if not n.is_root and pred(n)]

    for _ in range(rng.randint(10, 40)):
        op = rng.choice(OPS)
        if op == "insert":
            tokens = tuple(t for _ in range(rng.randint(1, 3)) for t in rng.choice(PAGE_TOKENS))
            i = cache.alloc_device(len(tokens))
            if i is not None:
                write_kv(r, i, tokens)
                write_kv(r, i, tokens, source="draft")
                node = cache.insert(tokens, i).node
                if node.state == "device" and rng.random() < 0.5:
                    rt.reserve(node)  # early reservation: layers follow as layer ends
        elif op == "hold":  # the engine holds random pages: later allocations get other owner patterns
            i = cache.alloc_device(PS * rng.randint(1, 3))
            if i is not None:
                held.append(i)
        elif op == "release" and held:
            cache.free_device(held.pop(rng.randrange(len(held))))
        elif op == "reserve":
            cands = live(lambda n: n.state == "device" and n.cp_meta is None)
            if cands:
                w = rt.reserve(rng.choice(cands))
                assert w.state in ("reserved", "acked", "failed")
                if w.state == "failed":
                    assert w.needed_slots == w.owned_tokens > rt.host_room()
                if w.owned_tokens == 0:
                    assert w.state == "acked" and w.acks == 1
        elif op == "layer_end":
            layer, source = rng.randint(-1, 3), rng.choice(["target", "target", "draft", "bogus"])
            if 0 <= layer < {"target": 3, "draft": 2}.get(source, 0):
                rt.on_layer_end(layer, source, flush=rng.random() < 0.5)
            else:
                rejected(LayerWriteError, rt.on_layer_end, layer, source)
        elif op == "submit_all" and rt.pending_writes():
            rt.submit_all(rng.choice(rt.pending_writes()))
        elif op in ("complete", "fail"):
            cache.flush()
            pending = ex.pending_job_ids()
            if pending:
                j = rng.choice(pending)
                ex.complete(j) if op == "complete" else ex.fail(j)
                cache.poll()
        elif op == "complete_all":  # every started copy lands, in a random order
            cache.flush()
            order = ex.pending_job_ids()
            rng.shuffle(order)
            for j in order:
                ex.complete(j)
            cache.poll()
        elif op == "poll":
            cache.poll()
        elif op == "evict":
            cache.evict(PS * rng.randint(1, 24))
        elif op == "evict_host":
            cache.evict_host(PS * rng.randint(1, 8))
        elif op == "load":
            cands = live(lambda n: n.state in ("host", "host_stored"))
            if cands:
                cache.load_back(rng.choice(cands))
        elif op == "bad_load":
            cands = live(lambda n: n.state == "host" and n.parent.state in ON_DEVICE | {"root"})
            if cands:
                alloc = cache.device_allocator
                real = alloc.alloc_pages_with_owners
                alloc.alloc_pages_with_owners = lambda owners: real(owners[1:])  # one page short
                try:
                    rejected(LayerWriteError, rt.load_cp, [rng.choice(cands)])
                finally:
                    del alloc.alloc_pages_with_owners
        elif op == "second_reserve":
            cands = live(lambda n: n.cp_meta is not None)
            if cands:
                rejected(LayerWriteError, rt.reserve, rng.choice(cands))
        elif op == "flaky_alloc":
            cands = live(lambda n: n.state == "device" and n.cp_meta is None)
            if cands:
                node = rng.choice(cands)
                owned = int(r.layout.owned_by_this_rank(node.device_indices).sum())
                if owned and rt.host_room() >= owned:
                    broken = rng.choice([cache.host_allocator, rt.draft_host_allocator])
                    broken.alloc = lambda n: None  # reports room, then refuses
                    try:
                        rejected(AllocationError, rt.reserve, node)
                    finally:
                        del broken.alloc
        cache.check_invariants()
        check_all_kv(r)

    # drain: every write ends with exactly one ack (or a failed copy), every load lands
    for w in rt.pending_writes():
        rt.submit_all(w)
    cache.flush()
    ex.complete_all()
    cache.poll()
    cache.check_invariants()
    check_all_kv(r)
    assert not rt.pending_writes()
    assert not live(lambda n: n.state == "writing_host" or n.state in LOADING)
    assert all(w.acks == (1 if w.state == "acked" else 0) for w in rt._finished)
