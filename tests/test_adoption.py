"""Adopting engine memory: views that share bytes, and tensors the pool cannot write, are refused up front.

A pool whose views overlap would let the load of one request overwrite another
request's live KV without any error; a sparse, meta or ``requires_grad`` tensor
would fail untyped on first use. Each is refused with one ConfigError and
nothing is built.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_fsm.adoption import check_disjoint
from hicache_fsm.engine_kv import adopt_sglang_mha, adopt_vllm
from hicache_fsm.errors import ConfigError
from hicache_fsm.pools import DeviceKVPool, PageAllocator

LAYERS, HEADS, DIM, PAGE, PAGES = 2, 2, 4, 4, 8
TOKENS = PAGE * PAGES


def mha_buffers(n: int = LAYERS) -> list[torch.Tensor]:
    return [torch.zeros(TOKENS, HEADS, DIM) for _ in range(n)]


def test_k_and_v_views_of_one_tensor_are_refused():
    kv = torch.zeros(TOKENS, HEADS, 2 * DIM)
    k, v = kv[..., :DIM], kv[..., DIM:]  # disjoint halves: fine
    adopt_sglang_mha([k], [v], PAGE)
    with pytest.raises(ConfigError, match="overlap"):
        adopt_sglang_mha([kv[..., :DIM]], [kv[..., 1:DIM + 1]], PAGE)  # V starts inside K's rows


def test_the_same_buffer_twice_is_refused():
    ks = mha_buffers()
    with pytest.raises(ConfigError, match=r"layer (\d) part 0 and layer \1 part 1 share memory"):
        adopt_sglang_mha(ks, ks, PAGE)
    with pytest.raises(ConfigError, match="overlap"):
        adopt_sglang_mha([ks[0], ks[0]], mha_buffers(), PAGE)  # two layers on one buffer


def test_layers_carved_from_one_allocation_must_not_meet():
    big = torch.zeros(3 * TOKENS, HEADS, DIM)
    layers = [big[i * TOKENS:(i + 1) * TOKENS] for i in range(3)]
    adopt_sglang_mha(layers[:1], layers[1:2], PAGE)  # back to back: fine
    shifted = big[PAGE:PAGE + TOKENS]
    with pytest.raises(ConfigError, match="overlap"):
        adopt_sglang_mha([layers[0]], [shifted], PAGE)


def test_a_view_reaching_a_byte_twice_is_refused():
    row = torch.zeros(1, HEADS, DIM)
    with pytest.raises(ConfigError, match="reaches some bytes twice"):
        adopt_sglang_mha([row.expand(TOKENS, HEADS, DIM)], mha_buffers(1), PAGE)


def test_vllm_interleaved_k_and_v_are_not_an_overlap():
    hnd = torch.zeros(PAGES, 2, HEADS, PAGE, DIM).permute(1, 0, 3, 2, 4)  # K and V interleave per block
    pool = adopt_vllm([hnd])
    assert pool.size_tokens == TOKENS
    with pytest.raises(ConfigError, match="overlap"):
        adopt_vllm([hnd, hnd])


@pytest.mark.parametrize("make, match", [
    (lambda *shape: torch.zeros(shape).to_sparse(), "dense"),
    (lambda *shape: torch.zeros(shape, device="meta"), "meta"),
    (lambda *shape: torch.zeros(shape, requires_grad=True), "grad"),
], ids=["sparse", "meta", "requires_grad"])
def test_tensors_the_pool_cannot_write_are_refused(make, match):
    with pytest.raises(ConfigError, match=match):
        adopt_sglang_mha([make(TOKENS, HEADS, DIM)], mha_buffers(1), PAGE)
    with pytest.raises(ConfigError, match=match):
        DeviceKVPool.adopt([(make(PAGES, PAGE, HEADS, DIM), make(PAGES, PAGE, HEADS, DIM))])


def test_bare_tensors_and_bogus_allocators_are_refused():
    view = torch.zeros(PAGES, PAGE, HEADS, DIM)
    with pytest.raises(ConfigError, match="layer_pages: expected a list"):
        DeviceKVPool.adopt(view)
    with pytest.raises(ConfigError, match=r"layer_pages\[0\]: expected a list"):
        DeviceKVPool.adopt([view])
    with pytest.raises(ConfigError, match="buffers: expected a list"):
        DeviceKVPool.adopt([(view, torch.zeros_like(view))], buffers=view)
    with pytest.raises(ConfigError, match="allocator must be a PageAllocator"):
        DeviceKVPool.adopt([(view, torch.zeros_like(view))], allocator=object())
    with pytest.raises(ConfigError, match="allocator must be a PageAllocator"):
        adopt_sglang_mha(mha_buffers(), mha_buffers(), PAGE, allocator="pages")
    with pytest.raises(ConfigError, match="mla must be a bool"):
        DeviceKVPool.adopt([(view,)], mla="yes")
    with pytest.raises(ConfigError, match="reserved pages"):  # SGLang's page 0 would be handed out
        adopt_sglang_mha(mha_buffers(), mha_buffers(), PAGE, allocator=PageAllocator(TOKENS, PAGE))
    pool = adopt_sglang_mha(mha_buffers(), mha_buffers(), PAGE, allocator=PageAllocator(TOKENS, PAGE, reserved_pages=1))
    assert pool.allocator.free_pages == PAGES - 1


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_overlap_verdict_matches_the_bytes(data):
    """Two strided views of one buffer: refused exactly when some byte is reachable through both."""
    base = torch.arange(64, dtype=torch.float32)

    def view():
        shape = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
        strides = data.draw(st.lists(st.integers(0, 9), min_size=len(shape), max_size=len(shape)))
        reach = sum((n - 1) * s for n, s in zip(shape, strides))
        offset = data.draw(st.integers(0, 63 - reach)) if reach <= 63 else None
        return None if offset is None else base.as_strided(shape, strides, offset)

    a, b = view(), view()
    if a is None or b is None:
        return
    index = torch.arange(64, dtype=torch.float32)
    reached = [torch.as_strided(index, a.shape, a.stride(), a.storage_offset()).reshape(-1).long(),
               torch.as_strided(index, b.shape, b.stride(), b.storage_offset()).reshape(-1).long()]
    everything = torch.cat(reached)
    overlap = everything.unique().numel() != everything.numel()
    if overlap:
        with pytest.raises(ConfigError, match="overlap"):
            check_disjoint([("a", a), ("b", b)])
    else:
        check_disjoint([("a", a), ("b", b)])
