"""Run coalescing and bit-exact page copies between device and host pools."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_fsm.copy import backup_to_host, coalesce_runs, load_all_layers, load_to_device, plan_runs
from hicache_fsm.errors import BadIndices, ConfigError
from hicache_fsm.pools import LAYOUTS, DeviceKVPool, HostKVPool, KVShape

SHAPE = KVShape(layers=3, heads=2, head_dim=8)


def tokens_of(pages, ps):
    pages = torch.as_tensor(pages, dtype=torch.int64)
    return (pages[:, None] * ps + torch.arange(ps)).reshape(-1)


def random_pages(n_pages, k, gen):
    return torch.randperm(n_pages, generator=gen)[:k]


def fill(pool, gen):
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen).to(pool.kv.dtype))


# ---------------------------------------------------------------- coalesce_runs


def test_coalesce_examples():
    ps = 4
    assert coalesce_runs(tokens_of([0, 1, 2], ps), tokens_of([5, 6, 7], ps), ps) == [(0, 20, 12)]
    assert coalesce_runs(tokens_of([0, 1, 2], ps), tokens_of([5, 7, 8], ps), ps) == [(0, 20, 4), (4, 28, 8)]
    assert coalesce_runs(tokens_of([3, 1, 2], ps), tokens_of([0, 1, 2], ps), ps) == [(12, 0, 4), (4, 4, 8)]
    assert coalesce_runs(tokens_of([2, 2], ps), tokens_of([0, 1], ps), ps) == [(8, 0, 4), (8, 4, 4)]
    assert coalesce_runs(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64), ps) == []
    assert coalesce_runs(torch.arange(5), torch.arange(5, 10), 1) == [(0, 5, 5)]


@pytest.mark.parametrize("src, dst", [
    (torch.arange(8), torch.arange(4)),          # lengths differ
    (torch.arange(1, 5), torch.arange(4)),       # not aligned
    (torch.arange(6), torch.arange(6)),          # partial page
    (torch.tensor([0, 2, 1, 3]), torch.arange(4)),  # not a whole page in order
])
def test_coalesce_rejects(src, dst):
    with pytest.raises(BadIndices):
        coalesce_runs(src, dst, 4)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), ps=st.sampled_from([1, 2, 4]), n=st.integers(0, 12))
def test_coalesce_covers_exactly_the_pairs(data, ps, n):
    src_pages = data.draw(st.lists(st.integers(0, 15), min_size=n, max_size=n))
    dst_pages = data.draw(st.permutations(list(range(16))))[:n]
    src, dst = tokens_of(src_pages, ps), tokens_of(dst_pages, ps)
    runs = coalesce_runs(src, dst, ps)
    pairs = [(s + i, d + i) for s, d, length in runs for i in range(length)]
    assert pairs == list(zip(src.tolist(), dst.tolist()))
    for (s0, d0, l0), (s1, d1, _) in zip(runs, runs[1:]):  # maximal: neighbours don't continue each other
        assert not (s1 == s0 + l0 and d1 == d0 + l0)
    assert all(length % ps == 0 and length > 0 for _, _, length in runs)


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_bit_exact(layout, ps, dtype):
    shape = KVShape(3, 2, 8, dtype)
    gen = torch.Generator().manual_seed(ps * 7 + len(layout))
    dev = DeviceKVPool(shape, 32 * ps, ps, device="cpu")
    host = HostKVPool(shape, 48 * ps, ps, layout)
    fill(dev, gen)
    # a run of consecutive pages on both sides first, so coalescing has something to merge
    dev_pages = [5, 6, 7, 8] + [p for p in torch.randperm(32, generator=gen).tolist() if p not in (5, 6, 7, 8)][:16]
    host_pages = [10, 11, 12, 13] + [p for p in torch.randperm(48, generator=gen).tolist()
                                     if p not in (10, 11, 12, 13)][:16]
    n = len(dev_pages)
    assert plan_runs(tokens_of(dev_pages, ps), tokens_of(host_pages, ps), ps)[0] == (5 * ps, 10 * ps, 4 * ps)
    d_idx, h_idx = tokens_of(dev_pages, ps), tokens_of(host_pages, ps)
    original = dev.read(d_idx)

    backup_to_host(dev, host, d_idx, h_idx)
    hk, hv = host.read(h_idx)
    assert torch.equal(hk, original[0]) and torch.equal(hv, original[1])

    back_pages = random_pages(32, n, gen)
    b_idx = tokens_of(back_pages, ps)
    dev.kv.zero_()
    load_all_layers(dev, host, h_idx, b_idx)
    rk, rv = dev.read(b_idx)
    assert torch.equal(rk, original[0]) and torch.equal(rv, original[1])
    untouched = torch.ones(32 * ps, dtype=torch.bool)
    untouched[b_idx] = False
    assert not dev.kv[:, :, untouched].view(torch.uint8).any()  # bytes: float8 has no sum on the CPU

    dev.kv.zero_()
    for layer in range(shape.layers):  # the per-layer path the CUDA executor uses
        load_to_device(dev, host, h_idx, b_idx, layer)
    rk, rv = dev.read(b_idx)
    assert torch.equal(rk, original[0]) and torch.equal(rv, original[1])


@settings(max_examples=25, deadline=None)
@given(data=st.data(), layout=st.sampled_from(LAYOUTS), ps=st.sampled_from([1, 2, 4]))
def test_round_trip_random_orders(data, layout, ps):
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    dev = DeviceKVPool(SHAPE, 16 * ps, ps, device="cpu")
    host = HostKVPool(SHAPE, 16 * ps, ps, layout)
    fill(dev, gen)
    dev_pages = data.draw(st.permutations(list(range(16))))
    n = data.draw(st.integers(0, 16))
    host_pages = data.draw(st.permutations(list(range(16))))[:n]
    d_idx, h_idx = tokens_of(dev_pages[:n], ps), tokens_of(host_pages, ps)
    want = dev.read(d_idx)
    backup_to_host(dev, host, d_idx, h_idx)
    back = tokens_of(data.draw(st.permutations(list(range(16))))[:n], ps)
    dev.kv.zero_()
    load_all_layers(dev, host, h_idx, back)
    got = dev.read(back)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_single_layer_backup_touches_only_that_layer(layout):
    gen = torch.Generator().manual_seed(1)
    dev = DeviceKVPool(SHAPE, 16, 4, device="cpu")
    host = HostKVPool(SHAPE, 16, 4, layout)
    fill(dev, gen)
    d_idx, h_idx = tokens_of([3, 0], 4), tokens_of([1, 2], 4)
    backup_to_host(dev, host, d_idx, h_idx, layer=1)
    hk, hv = host.read(h_idx)
    dk, dv = dev.read(d_idx)
    assert torch.equal(hk[1], dk[1]) and torch.equal(hv[1], dv[1])
    assert hk[0].abs().sum() == 0 and hk[2].abs().sum() == 0 and hv[2].abs().sum() == 0


def test_precomputed_runs_and_draft_shape():
    draft = KVShape(1, 2, 8)
    gen = torch.Generator().manual_seed(2)
    dev = DeviceKVPool(draft, 16, 4, device="cpu")
    host = HostKVPool(draft, 16, 4, "page_first")
    fill(dev, gen)
    d_idx, h_idx = tokens_of([2, 3], 4), tokens_of([0, 1], 4)
    runs = plan_runs(d_idx, h_idx, 4)
    assert runs == [(8, 0, 8)]
    backup_to_host(dev, host, runs=runs)
    assert torch.equal(host.read(h_idx)[0], dev.read(d_idx)[0])


def test_copy_errors():
    dev = DeviceKVPool(SHAPE, 16, 4, device="cpu")
    host = HostKVPool(SHAPE, 8, 4, "layer_first")
    with pytest.raises(BadIndices, match="host index"):
        backup_to_host(dev, host, tokens_of([0, 1, 2], 4), tokens_of([0, 1, 2], 4))
    with pytest.raises(BadIndices):
        backup_to_host(dev, host, tokens_of([4], 4), tokens_of([0], 4))
    with pytest.raises(BadIndices):
        backup_to_host(dev, host, tokens_of([0], 4), tokens_of([0], 4), layer=3)
    with pytest.raises(BadIndices):
        load_to_device(dev, host, tokens_of([0], 4), tokens_of([0], 4), layer=None)
    other = HostKVPool(KVShape(2, 2, 8), 16, 4)
    with pytest.raises(ConfigError, match="shape"):
        backup_to_host(dev, other, tokens_of([0], 4), tokens_of([0], 4))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_round_trip(layout):
    gen = torch.Generator().manual_seed(4)
    dev = DeviceKVPool(SHAPE, 64, 4, device="cuda")
    host = HostKVPool(SHAPE, 64, 4, layout)
    assert host.kv.is_pinned()
    dev.kv.copy_(torch.randn(dev.kv.shape, generator=gen))
    d_idx = tokens_of(torch.randperm(16, generator=gen)[:10], 4)
    h_idx = tokens_of(torch.randperm(16, generator=gen)[:10], 4)
    want = dev.read(d_idx)
    backup_to_host(dev, host, d_idx, h_idx, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(host.read(h_idx)[0], want[0])
    back = tokens_of(torch.randperm(16, generator=gen)[:10], 4)
    dev.kv.zero_()
    staging: dict = {}
    for layer in range(SHAPE.layers):
        load_to_device(dev, host, h_idx, back, layer, non_blocking=True, staging=staging)
    torch.cuda.synchronize()
    got = dev.read(back)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    backup_to_host(dev, host, back, h_idx, layer=2)
    torch.cuda.synchronize()
    assert torch.equal(host.read(h_idx)[1][2], want[1][2])


@settings(max_examples=40, deadline=None)
@given(data=st.data(), layout=st.sampled_from(LAYOUTS), ps=st.sampled_from([1, 2, 4]),
       layer=st.sampled_from([None, 0, 2]))
def test_gathered_copies_equal_copies_per_run(data, layout, ps, layer):
    """Many runs go through one gather and one scatter: every pool ends exactly as with a copy per run."""
    import hicache_fsm.copy as copy_mod

    seed = data.draw(st.integers(0, 2**16))
    n = data.draw(st.integers(0, 16))
    dev_pages = data.draw(st.permutations(list(range(16))))[:n]
    host_pages = data.draw(st.permutations(list(range(16))))[:n]
    d_idx, h_idx = tokens_of(dev_pages, ps), tokens_of(host_pages, ps)
    finals = []
    for threshold in (1, 10**9):  # always gathered, never gathered
        gen = torch.Generator().manual_seed(seed)
        dev = DeviceKVPool(SHAPE, 16 * ps, ps, device="cpu")
        host = HostKVPool(SHAPE, 16 * ps, ps, layout)
        fill(dev, gen)
        fill(host, gen)
        old = copy_mod.GATHER_MIN_RUNS, copy_mod.GATHER_MAX_RUN_BYTES
        copy_mod.GATHER_MIN_RUNS, copy_mod.GATHER_MAX_RUN_BYTES = threshold, 10**12 // threshold
        try:
            backup_to_host(dev, host, d_idx, h_idx, layer=layer)
            fill(dev, gen)
            if layer is None:
                load_all_layers(dev, host, h_idx, d_idx)
            else:
                load_to_device(dev, host, h_idx, d_idx, layer)
        finally:
            copy_mod.GATHER_MIN_RUNS, copy_mod.GATHER_MAX_RUN_BYTES = old
        finals.append((dev.kv.clone(), host.kv.clone()))
    assert torch.equal(finals[0][0], finals[1][0]) and torch.equal(finals[0][1], finals[1][1])


def test_only_many_small_runs_are_gathered():
    """The gather pays for many small runs; a copy per run for few runs, or for big pages (0.8 against 8 GB/s)."""
    from hicache_fsm.copy import GATHER_MAX_RUN_BYTES, GATHER_MIN_RUNS, gather_pays

    pages = [(64 * i, 64 * (i + 7), 64) for i in range(GATHER_MIN_RUNS)]
    small = GATHER_MAX_RUN_BYTES // 64  # token bytes that make a 64-token run exactly the bound
    assert gather_pays(pages, small)
    assert not gather_pays(pages, small + 1)
    assert not gather_pays(pages[:-1], 1)  # too few runs, however small
    assert not gather_pays(pages, 8 * 8 * 64 * 4)  # 8 layers x 8 heads x 64 dims of float32: 1 MiB pages
