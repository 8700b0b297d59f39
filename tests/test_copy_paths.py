"""The CUDA copy paths: indexed kernels through a GPU view of the pinned host pool, and the staged fallback.

On CUDA every host layout is copied by ``zero_copy`` (one gather and one
scatter per layer and part, on a view of the pinned host memory); without a
view, page_first and page_first_direct pools fall back to ``copy_staged``
(whole host blocks staged on the GPU). Both are plain torch, so on the CPU
they are checked against the pools' own read/write, bit for bit, for owned
and adopted device pools, every layout and float32, bfloat16 and float8 (the
zero-copy functions given the host buffer itself as the view); on CUDA the
same round trips go through the public copy functions.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_fsm import copy_staged, zero_copy
from hicache_fsm.copy import backup_to_host, load_to_device, plan_runs
from hicache_fsm.engine_kv import adopt_sglang_mha, adopt_vllm
from hicache_fsm.pools import LAYOUTS, DeviceKVPool, HostKVPool, KVShape

SHAPE = KVShape(layers=3, heads=2, head_dim=4, dtype=torch.float32)
# float8: the indexed kernels have none, pages move as integers of the same width (``page_index``)
DTYPES = [torch.float32, torch.bfloat16, torch.float8_e4m3fn]
PAGES = 12


def _device_pool(kind: str, ps: int, device: str, dtype: torch.dtype) -> DeviceKVPool:
    tokens = PAGES * ps
    shape = KVShape(SHAPE.layers, SHAPE.heads, SHAPE.head_dim, dtype)
    dims = (SHAPE.heads, SHAPE.head_dim)
    if kind == "owned":
        return DeviceKVPool(shape, tokens, ps, device=device)
    if kind == "sglang_mha":
        k = [torch.zeros((tokens, *dims), dtype=dtype, device=device) for _ in range(SHAPE.layers)]
        v = [torch.zeros((tokens, *dims), dtype=dtype, device=device) for _ in range(SHAPE.layers)]
        return adopt_sglang_mha(k, v, ps, reserved_pages=0)
    return adopt_vllm([torch.zeros((2, PAGES, ps, *dims), dtype=dtype, device=device) for _ in range(SHAPE.layers)])


def _tokens(pages: list[int], ps: int) -> torch.Tensor:
    return (torch.tensor(pages, dtype=torch.int64)[:, None] * ps + torch.arange(ps)).reshape(-1)


def _random_kv(n: int, seed: int, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn((SHAPE.layers, n, SHAPE.heads, SHAPE.head_dim), generator=g).to(device, dtype)
                 for _ in range(2))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bits of ``t`` (float8 has no equality on the CPU; NaN bits compare as bits)."""
    return t.cpu().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _others(pages: list[int], ps: int) -> torch.Tensor | None:
    """The tokens of the pages not in ``pages``, or None when there are none."""
    rest = sorted(set(range(PAGES)) - set(pages))
    return _tokens(rest, ps) if rest else None


def _holds_only(pool, tokens: torch.Tensor, others: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor) -> None:
    """``pool`` holds ``k``/``v`` at ``tokens`` (bit for bit) and zeros at every other page."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    got_k, got_v = pool.read(tokens)
    assert torch.equal(_bits(got_k), _bits(k)) and torch.equal(_bits(got_v), _bits(v))
    if others is not None:
        assert not any(_bits(part).any() for part in pool.read(others))


def _round_trip(kind: str, layout: str, ps: int, dev_pages: list[int], host_pages: list[int],
                back_pages: list[int], device: str, seed: int, backup, load, pinned: bool | None = None,
                dtype: torch.dtype = torch.float32) -> None:
    """Write KV into device pages, back it up, zero the device, load it back layer by layer: same bits, and
    no page outside the copy touched."""
    dev = _device_pool(kind, ps, device, dtype)
    host = HostKVPool(dev.shape, PAGES * ps, ps, layout, pin_memory=device == "cuda" if pinned is None else pinned)
    d_idx, h_idx, b_idx = _tokens(dev_pages, ps), _tokens(host_pages, ps), _tokens(back_pages, ps)
    k, v = _random_kv(d_idx.numel(), seed, device, dtype)
    dev.write(d_idx, None, k, v)
    backup(dev, host, plan_runs(d_idx, h_idx, ps))
    _holds_only(host, h_idx, _others(host_pages, ps), k, v)  # the host pool started zeroed
    for buffer in dev.buffers:
        buffer.zero_()
    staging: dict = {}
    runs = plan_runs(b_idx, h_idx, ps)
    for layer in range(SHAPE.layers):
        load(dev, host, runs, layer, staging)
    _holds_only(dev, b_idx, _others(back_pages, ps), k, v)


def _staged_backup(dev, host, runs) -> None:
    copy_staged.backup_staged(dev, host, runs, non_blocking=False)


def _staged_load(dev, host, runs, layer, staging) -> None:
    copy_staged.load_staged(dev, host, runs, layer, non_blocking=False, staging=staging)


def _mapped_backup(dev, host, runs) -> None:
    zero_copy.backup_mapped(dev, host.kv, host.layout, runs, None)


def _mapped_layer_backup(dev, host, runs) -> None:
    for layer in range(dev.layers):  # as CP layer writes do
        zero_copy.backup_mapped(dev, host.kv, host.layout, runs, layer)


def _mapped_load(dev, host, runs, layer, staging) -> None:
    zero_copy.load_mapped(dev, host.kv, host.layout, runs, layer, staging)


def _executor_backup(dev, host, runs) -> None:
    backup_to_host(dev, host, runs=runs, non_blocking=True)


def _executor_load(dev, host, runs, layer, staging) -> None:
    load_to_device(dev, host, layer=layer, runs=runs, non_blocking=True, staging=staging)


pages = st.integers(1, PAGES).flatmap(lambda n: st.tuples(*(st.permutations(range(PAGES)).map(lambda p: p[:n])
                                                              for _ in range(3))))


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(["owned", "sglang_mha", "vllm"]), layout=st.sampled_from(copy_staged.STAGED_LAYOUTS),
       ps=st.sampled_from([1, 4]), chosen=pages, small_rounds=st.booleans(), seed=st.integers(0, 2**16),
       dtype=st.sampled_from(DTYPES))
def test_staged_round_trip_is_bit_exact_on_cpu(kind, layout, ps, chosen, small_rounds, seed, dtype):
    """On the CPU the copy functions take their CPU path: the staged one is called directly."""
    with pytest.MonkeyPatch.context() as mp:
        if small_rounds:  # a backup in rounds of one byte's budget: every run staged on its own
            mp.setattr(copy_staged, "STAGE_MAX_BYTES", 1)
        _round_trip(kind, layout, ps, *chosen, "cpu", seed, _staged_backup, _staged_load, dtype=dtype)


@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from(["owned", "sglang_mha", "vllm"]), layout=st.sampled_from(LAYOUTS),
       ps=st.sampled_from([1, 4]), chosen=pages, by_layer=st.booleans(), seed=st.integers(0, 2**16),
       dtype=st.sampled_from(DTYPES), deterministic=st.booleans())
def test_mapped_round_trip_is_bit_exact_on_cpu(kind, layout, ps, chosen, by_layer, seed, dtype, deterministic):
    """Also in torch's deterministic mode, where a scatter is an ``index_put_`` (see ``page_index``)."""
    backup = _mapped_layer_backup if by_layer else _mapped_backup
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        _round_trip(kind, layout, ps, *chosen, "cpu", seed, backup, _mapped_load, dtype=dtype)
    finally:
        torch.use_deterministic_algorithms(before)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_pool_without_pinned_memory_has_no_device_view():
    """Only pinned memory is mapped into the GPU: a kernel reading pageable memory would fault the context."""
    host = HostKVPool(SHAPE, PAGES * 4, 4, "layer_first", pin_memory=False)
    assert zero_copy.host_view(host, torch.device("cuda", torch.cuda.current_device())) is None
    assert zero_copy.host_view(host, torch.device("cpu")) is None


def test_a_backup_stages_in_rounds_of_bounded_size(monkeypatch):
    host = HostKVPool(SHAPE, PAGES * 4, 4, "page_first")
    token_bytes = SHAPE.layers * SHAPE.heads * SHAPE.head_dim * 4  # every layer of one part, float32
    monkeypatch.setattr(copy_staged, "STAGE_MAX_BYTES", 8 * token_bytes)
    runs = [(0, 0, 4), (8, 4, 4), (16, 8, 8), (40, 24, 4)]
    assert copy_staged.stage_rounds(host, runs) == [[(0, 0, 4), (8, 4, 4)], [(16, 8, 8)], [(40, 24, 4)]]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["owned", "sglang_mha", "vllm"])
@pytest.mark.parametrize("layout", copy_staged.STAGED_LAYOUTS)
@pytest.mark.parametrize("small_rounds", [False, True])
def test_staged_round_trip_is_bit_exact_on_cuda(kind, layout, small_rounds, monkeypatch):
    if small_rounds:
        monkeypatch.setattr(copy_staged, "STAGE_MAX_BYTES", 1)
    g = torch.Generator().manual_seed(len(kind) + len(layout))
    chosen = [torch.randperm(PAGES, generator=g)[:9].tolist() for _ in range(3)]
    _round_trip(kind, layout, 4, *chosen, "cuda", 7, _executor_backup, _executor_load, pinned=False)  # no view


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["owned", "sglang_mha", "vllm"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_pinned_pool_round_trips_through_the_host_view_on_cuda(kind, layout, dtype):
    host = HostKVPool(SHAPE, PAGES * 4, 4, layout)
    view = zero_copy.host_view(host, torch.device("cuda", torch.cuda.current_device()))
    assert view is not None and view.data_ptr() == host.kv.data_ptr()  # the fast path is taken here
    g = torch.Generator().manual_seed(len(kind) + len(layout))
    chosen = [torch.randperm(PAGES, generator=g)[:9].tolist() for _ in range(3)]
    _round_trip(kind, layout, 4, *chosen, "cuda", 11, _executor_backup, _executor_load, dtype=dtype)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["owned", "sglang_mha", "vllm"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layer_by_layer_backups_round_trip_on_cuda(kind, layout):
    """Single-layer backups (CP layer writes) of every layout, through the public copy functions."""
    g = torch.Generator().manual_seed(len(kind) + len(layout))
    chosen = [torch.randperm(PAGES, generator=g)[:9].tolist() for _ in range(3)]

    def by_layer(dev, host, runs) -> None:
        for layer in range(dev.layers):
            backup_to_host(dev, host, layer=layer, runs=runs, non_blocking=True)

    _round_trip(kind, layout, 4, *chosen, "cuda", 13, by_layer, _executor_load)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_blocking_backup_through_the_view_is_done_when_it_returns(layout):
    """Kernels that write host memory run asynchronously: a ``non_blocking=False`` copy waits for them."""
    dev = _device_pool("owned", 4, "cuda", torch.float32)
    host = HostKVPool(dev.shape, PAGES * 4, 4, layout)
    assert zero_copy.host_view(host, dev.device) is not None  # the path under test
    pages = _tokens(list(range(PAGES)), 4)
    k, v = _random_kv(pages.numel(), 3, "cuda", torch.float32)
    dev.write(pages, None, k, v)
    torch.cuda.synchronize()
    busy = torch.ones((4096, 4096), device="cuda")
    for _ in range(20):  # the stream is busy for a while: a kernel not waited for would not have run yet
        busy = busy @ busy
    backup_to_host(dev, host, pages, pages)  # non_blocking=False
    got_k, got_v = host.read(pages)  # no synchronize
    assert torch.equal(got_k, k.cpu()) and torch.equal(got_v, v.cpu())
