"""Page allocator, device/host pools, page bytes and pool configuration."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_fsm.errors import AllocationError, BadIndices, ConfigError, HiCacheError
from hicache_fsm.pools import (
    LAYOUTS,
    DeviceKVPool,
    HostKVPool,
    KVShape,
    PageAllocator,
    PoolConfig,
    build_pools,
    pages_of,
)

SHAPE = KVShape(layers=3, heads=2, head_dim=4)


def page_tokens(pages, ps):
    pages = torch.as_tensor(pages, dtype=torch.int64)
    return (pages[:, None] * ps + torch.arange(ps)).reshape(-1)


# ---------------------------------------------------------------- KVShape


def test_token_bytes():
    assert KVShape(4, 2, 16).token_bytes == 2 * 4 * 2 * 16 * 4
    assert KVShape(4, 2, 16, torch.bfloat16).token_bytes == 2 * 4 * 2 * 16 * 2


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_shape_rejects_bad_sizes(bad):
    with pytest.raises(ConfigError):
        KVShape(bad, 2, 4)


# ---------------------------------------------------------------- PageAllocator


def test_alloc_prefers_low_pages_and_returns_token_indices():
    a = PageAllocator(64, 4)
    got = a.alloc(12)
    assert got.dtype == torch.int64
    assert got.tolist() == list(range(12))
    assert a.used_pages == 3 and a.free_pages == 13 and a.available_tokens == 52
    assert a.owned_pages() == {0, 1, 2}
    assert a.is_allocated(2) and not a.is_allocated(3)


def test_alloc_rules():
    a = PageAllocator(16, 4)
    with pytest.raises(BadIndices):
        a.alloc(3)
    with pytest.raises(BadIndices):
        a.alloc(-4)
    assert a.alloc(0).numel() == 0
    assert a.alloc(20) is None  # caller falls back (evict, then retry)
    assert a.free_pages == 4
    assert a.alloc(16).numel() == 16
    assert a.alloc(4) is None
    with pytest.raises(BadIndices):
        a.is_allocated(4)


def test_order_after_churn_is_not_always_contiguous():
    a = PageAllocator(64, 4)
    held = [a.alloc(4) for _ in range(14)]  # pages 14 and 15 stay free
    for i in (9, 2):
        a.free(held[i])
    got = pages_of(a.alloc(16), 4).tolist()
    assert got == [14, 15, 2, 9]  # the rest of the free list, then the released pages, sorted


def test_merge_sorts_released_pages():
    a = PageAllocator(32, 4)
    x = a.alloc(16)
    a.alloc(16)
    a.free(x[8:])
    a.free(x[:8])
    assert pages_of(a.alloc(16), 4).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("bad", [
    torch.tensor([1, 2, 3, 4]),            # not page aligned
    torch.tensor([0, 1, 2]),                # partial page
    torch.tensor([0, 2, 1, 3]),             # not one whole page in order
    torch.tensor([64, 65, 66, 67]),         # out of range
    torch.tensor([-4, -3, -2, -1]),         # negative
    torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]),  # the same page twice
    torch.tensor([[0, 1, 2, 3]]),           # 2-D
    torch.tensor([0.0, 1.0, 2.0, 3.0]),     # float
])
def test_free_rejects_bad_indices_atomically(bad):
    a = PageAllocator(64, 4)
    a.alloc(64)
    before = a.owned_pages()
    with pytest.raises(AllocationError):
        a.free(bad)
    assert a.owned_pages() == before and a.free_pages == 0


def test_free_is_atomic_when_one_page_is_not_allocated():
    a = PageAllocator(32, 4)
    x = a.alloc(8)
    a.free(x[4:])
    with pytest.raises(AllocationError):
        a.free(x)  # page 0 is fine, page 1 is a double free
    assert a.owned_pages() == {0}


def test_reset():
    a = PageAllocator(32, 4)
    a.alloc(32)
    a.reset()
    assert a.free_pages == 8 and a.owned_pages() == set()
    assert a.alloc(8).tolist() == list(range(8))


@pytest.mark.parametrize("args", [(0, 4), (10, 4), (16, 0), (-16, 4)])
def test_allocator_config_errors(args):
    with pytest.raises(ConfigError):
        PageAllocator(*args)


ops = st.lists(st.tuples(st.sampled_from(["alloc", "free", "double", "partial"]), st.integers(0, 6),
                         st.integers(0, 10**6)), max_size=40)


@settings(max_examples=60, deadline=None)
@given(ops=ops, ps=st.sampled_from([1, 2, 8]))
def test_allocator_properties(ops, ps):
    a = PageAllocator(24 * ps, ps)
    live: list[torch.Tensor] = []
    freed: list[torch.Tensor] = []
    for op, n, pick in ops:
        before = (a.owned_pages(), a.free_pages)
        if op == "alloc":
            got = a.alloc(n * ps)
            if got is None:
                assert n > before[1]
                assert (a.owned_pages(), a.free_pages) == before
                continue
            pages = set(pages_of(got, ps).tolist())
            assert len(pages) == n
            assert not pages & before[0], "a page was handed out twice"
            live.append(got)
        elif op == "free" and live:
            x = live.pop(pick % len(live))
            a.free(x)
            freed.append(x)
        elif op == "double" and freed:
            x = freed[pick % len(freed)]
            if x.numel() == 0 or set(pages_of(x, ps).tolist()) & a.owned_pages():
                continue  # reallocated since: not a double free any more
            with pytest.raises(AllocationError):
                a.free(x)
            assert (a.owned_pages(), a.free_pages) == before
        elif op == "partial" and live and ps > 1:
            x = live[pick % len(live)]
            if x.numel():
                with pytest.raises(AllocationError):
                    a.free(x[1:])
                assert (a.owned_pages(), a.free_pages) == before
        owned = set()
        for x in live:
            owned |= set(pages_of(x, ps).tolist())
        assert a.owned_pages() == owned
        assert a.used_pages == len(owned)
        assert a.used_pages + a.free_pages == a.total_pages
        assert a.available_tokens == a.free_pages * ps


def test_view_allocator_hands_out_runs_as_views_and_the_rest_as_copies():
    a = PageAllocator(64, 4, views=True)
    run = a.alloc(16)
    assert run._base is not None and run.tolist() == list(range(16))  # a view of the slot-id table
    held = [a.alloc(4) for _ in range(10)]  # pages 4..13; 14 and 15 stay free
    for i in (7, 2):
        a.free(held[i])
    mixed = a.alloc(16)  # pages 14, 15, then the released 6 and 11
    assert mixed._base is None and pages_of(mixed, 4).tolist() == [14, 15, 6, 11]
    a.free(mixed)
    a.free(run)
    assert a.alloc(16)._base is not None  # released pages 0..3 merged in ascending order: a run again


@settings(max_examples=60, deadline=None)
@given(ops=ops, ps=st.sampled_from([1, 2, 8]))
def test_view_allocations_equal_copied_ones(ops, ps):
    copies, views = PageAllocator(24 * ps, ps), PageAllocator(24 * ps, ps, views=True)
    live: list[tuple[torch.Tensor, torch.Tensor]] = []
    for op, n, pick in ops:
        if op == "alloc":
            c, v = copies.alloc(n * ps), views.alloc(n * ps)
            assert (c is None) == (v is None)
            if c is None:
                continue
            assert torch.equal(c, v)
            pages = pages_of(v, ps).tolist()
            if v._base is not None and pages:
                assert pages == list(range(pages[0], pages[0] + len(pages))), "a view of pages that are not one run"
            live.append((c, v))
        elif live:
            c, v = live.pop(pick % len(live))
            copies.free(c)
            views.free(v)
        assert views.owned_pages() == copies.owned_pages()
    assert torch.equal(views._slot_ids, torch.arange(24 * ps)), "the shared slot table changed"


# ---------------------------------------------------------------- pools


def test_device_pool_write_read():
    pool = DeviceKVPool(SHAPE, 16, 4, device="cpu")
    assert pool.k.shape == (3, 16, 2, 4) and pool.v.shape == (3, 16, 2, 4)
    idx = torch.tensor([8, 9, 10, 11])
    k = torch.randn(3, 4, 2, 4)
    v = torch.randn(3, 4, 2, 4)
    pool.write(idx, None, k, v)
    rk, rv = pool.read(idx)
    assert torch.equal(rk, k) and torch.equal(rv, v)
    pool.write(idx, 1, k[0], v[0])
    rk, _ = pool.read(idx)
    assert torch.equal(rk[1], k[0]) and torch.equal(rk[0], k[0])
    with pytest.raises(BadIndices):
        pool.write(idx, 3, k[0], v[0])
    with pytest.raises(BadIndices):
        pool.write(idx, None, k[:, :2], v[:, :2])
    with pytest.raises(BadIndices):
        pool.read(torch.tensor([16]))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_host_pool_shapes_and_read_write(layout):
    pool = HostKVPool(SHAPE, 16, 4, layout)
    want = {"layer_first": (2, 3, 16, 2, 4), "page_first": (2, 16, 3, 2, 4),
            "page_first_direct": (2, 4, 3, 4, 2, 4)}[layout]
    assert tuple(pool.kv.shape) == want
    assert pool.pinned is torch.cuda.is_available()
    idx = torch.tensor([12, 13, 14, 15, 0, 1, 2, 3])
    k, v = torch.randn(3, 8, 2, 4), torch.randn(3, 8, 2, 4)
    pool.write(idx, k, v)
    rk, rv = pool.read(idx)
    assert torch.equal(rk, k) and torch.equal(rv, v)


def test_unknown_layout():
    with pytest.raises(ConfigError, match="unknown host layout"):
        HostKVPool(SHAPE, 16, 4, "head_first")


@pytest.mark.parametrize("device", ["tpu", "cuda:x", 3, ["cpu"]])
def test_a_device_the_executors_cannot_use_is_refused_by_name(device):
    with pytest.raises(ConfigError, match="device must be cpu, cuda or cuda:N"):
        DeviceKVPool(SHAPE, 16, 4, device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works where CUDA is present")
def test_pinning_without_cuda_is_refused_and_none_means_unpinned():
    with pytest.raises(ConfigError, match="pin_memory=True needs CUDA"):  # was torch's RuntimeError
        HostKVPool(SHAPE, 16, 4, pin_memory=True)
    assert not HostKVPool(SHAPE, 16, 4).pinned


@pytest.mark.parametrize("layout", LAYOUTS)
def test_page_bytes_round_trip(layout):
    pool = HostKVPool(SHAPE, 16, 4, layout)
    pool.kv.copy_(torch.randn(pool.kv.shape))
    assert pool.page_nbytes == 4 * SHAPE.token_bytes
    data = pool.read_page(2)
    assert data.dtype == torch.uint8 and data.numel() == pool.page_nbytes
    # K bytes then V bytes
    k, v = pool.read(torch.arange(8, 12))
    half = pool.page_nbytes // 2
    ks = data[:half].view(torch.float32)
    vs = data[half:].view(torch.float32)
    assert torch.equal(torch.sort(ks).values, torch.sort(k.reshape(-1)).values)
    assert torch.equal(torch.sort(vs).values, torch.sort(v.reshape(-1)).values)
    for form in (bytes(data.numpy()), bytearray(data.numpy()), memoryview(bytes(data.numpy())), data.clone()):
        pool.write_page(0, form)
        assert torch.equal(pool.read_page(0), data)
    assert torch.equal(pool.read(torch.arange(0, 4))[0], k)
    before = pool.kv.clone()
    for bad in (bytes(pool.page_nbytes - 1), bytes(pool.page_nbytes + 1), torch.zeros(pool.page_nbytes),
                "x" * pool.page_nbytes):
        with pytest.raises(BadIndices):
            pool.write_page(1, bad)
    with pytest.raises(BadIndices):
        pool.read_page(4)
    assert torch.equal(pool.kv, before)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_page_views_are_zero_copy(layout):
    pool = HostKVPool(SHAPE, 16, 4, layout)
    views = pool.page_views(3)
    assert len(views) == (2 * SHAPE.layers if layout == "layer_first" else 2)
    assert all(v.is_contiguous() and v.dtype == torch.uint8 for v in views)
    assert sum(v.numel() for v in views) == pool.page_nbytes
    src = torch.randint(0, 255, (pool.page_nbytes,), dtype=torch.uint8)
    off = 0
    for view in views:  # what a storage backend's readinto does
        view.copy_(src[off:off + view.numel()])
        off += view.numel()
    assert torch.equal(pool.read_page(3), src)
    assert pool.read(torch.arange(0, 12))[0].abs().sum() == 0  # other pages untouched


# ---------------------------------------------------------------- config


def test_build_pools_ratio_default():
    pools = build_pools(PoolConfig(SHAPE, device_tokens=32, page_size=4, device="cpu"))
    assert pools.device.size_tokens == 32 and pools.host.size_tokens == 64
    assert pools.host.layout == "layer_first" and pools.draft_device is None


def test_build_pools_host_sizes():
    cfg = PoolConfig(SHAPE, 32, 4, host_ratio=1.3, device="cpu")
    assert build_pools(cfg).host.size_tokens == 40  # 41.6 rounded down to whole pages
    cfg = PoolConfig(SHAPE, 8, 4, host_tokens=12, device="cpu", host_layout="page_first_direct")
    assert build_pools(cfg).host.kv.shape[1] == 3
    cfg = PoolConfig(SHAPE, 4, 4, host_bytes=10 * SHAPE.token_bytes + 5, device="cpu")
    assert build_pools(cfg).host.size_tokens == 8
    cfg = PoolConfig(SHAPE, 16, 4, host_gb=SHAPE.token_bytes * 20 / (1 << 30), device="cpu")
    assert build_pools(cfg).host.size_tokens == 20


def test_build_pools_draft():
    draft = KVShape(1, 2, 4)
    pools = build_pools(PoolConfig(SHAPE, 32, 4, host_tokens=48, device="cpu", draft_shape=draft,
                                   host_layout="page_first"))
    assert pools.draft_device.k.shape == (1, 32, 2, 4)
    assert pools.draft_host.kv.shape == (2, 48, 1, 2, 4) and pools.draft_host.layout == "page_first"
    assert pools.draft_device.allocator is pools.device.allocator
    assert pools.draft_host.allocator is not pools.host.allocator


@pytest.mark.parametrize("kwargs, match", [
    (dict(device_tokens=30), "multiple of page_size"),
    (dict(device_tokens=0), "positive"),
    (dict(device_tokens=-8), "positive"),
    (dict(page_size=0), "positive"),
    (dict(host_tokens=10), "multiple of page_size"),
    (dict(host_tokens=0), "positive"),
    (dict(host_ratio=-1.0), "positive"),
    (dict(host_ratio=0.05), "smaller than one page"),
    (dict(host_bytes=SHAPE.token_bytes * 3), "smaller than one page"),
    (dict(host_tokens=8, host_ratio=2.0), "at most one"),
    (dict(host_layout="nope"), "unknown host layout"),
    (dict(host_tokens=32), "must be larger than the device pool"),
    (dict(host_tokens=16), "must be larger than the device pool"),
    (dict(host_ratio=1.0), "must be larger than the device pool"),
    (dict(host_gb=1e7), "GiB of host memory"),
    (dict(device="tpu"), "device must be cpu, cuda or cuda:N"),  # was torch's RuntimeError
    (dict(device=5), "device must be cpu, cuda or cuda:N"),  # an index beyond the GPUs visible
    (dict(pin_memory="no"), "pin_memory must be True, False or None"),  # read as True before
])
def test_config_errors(kwargs, match):
    base = dict(shape=SHAPE, device_tokens=32, page_size=4, device="cpu")
    base.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        build_pools(PoolConfig(**base))


def test_config_errors_are_hicache_errors():
    assert issubclass(ConfigError, HiCacheError)
    with pytest.raises(ConfigError):
        PoolConfig("not a shape", 32)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pools_pinned_and_on_device():
    pools = build_pools(PoolConfig(SHAPE, 32, 4))
    assert pools.device.kv.is_cuda
    assert pools.host.pinned and pools.host.kv.is_pinned()
    k, v = torch.randn(3, 4, 2, 4), torch.randn(3, 4, 2, 4)
    pools.device.write(torch.arange(4), None, k, v)
    rk, rv = pools.device.read(torch.arange(4))
    assert rk.device.type == "cpu" and torch.equal(rk, k) and torch.equal(rv, v)


def test_cp_rank_host_pool_must_exceed_its_device_share():
    from hicache_fsm.cp import build_cp_pools

    config = PoolConfig(SHAPE, 32, 4, host_tokens=16, device="cpu")  # rank 0 of 2 owns 16 device tokens
    with pytest.raises(ConfigError, match=r"larger than the device pool it backs \(16 tokens\)"):
        build_cp_pools(config, 2, 0)
    assert build_cp_pools(attrs.evolve(config, host_tokens=20), 2, 0).host.size_tokens == 20


def test_page_id_allocation_hands_out_what_alloc_would_and_refuses_a_double_free():
    import numpy as np

    from hicache_fsm.allocator import PageAllocator
    from hicache_fsm.errors import AllocationError

    by_ids, by_slots = PageAllocator(32, 4), PageAllocator(32, 4)
    pages = by_ids.alloc_page_ids(12)
    assert pages.tolist() == (by_slots.alloc(12)[::4] // 4).tolist() == [0, 1, 2]
    assert by_ids.slot_tensor(pages).tolist() == list(range(12))
    by_ids.free_page_ids(pages[1:2])
    with pytest.raises(AllocationError):
        by_ids.free_page_ids(np.array([2, 1], dtype=np.int64))  # page 1 is free already: nothing is freed
    assert by_ids.free_pages == 6 and by_ids.is_allocated(2)
    assert by_ids.alloc_page_ids(64) is None
