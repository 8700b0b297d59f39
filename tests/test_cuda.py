"""HiCache on a CUDA device pool with the TorchExecutor (skipped without CUDA)."""

from __future__ import annotations

import time

import pytest
import torch

from hicache_fsm.cache import HiCache
from hicache_fsm.config import CacheConfig
from hicache_fsm.executors import SlotWait, TorchExecutor
from hicache_fsm.pools import LAYOUTS, DeviceKVPool, HostKVPool, KVShape

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PAGE = 16
SHAPE = KVShape(layers=8, heads=8, head_dim=64, dtype=torch.float16)  # 16 KiB per token: loads take a while


def make(layout: str, device_pages: int = 64, host_pages: int = 128, slots: int = 3):
    dev = DeviceKVPool(SHAPE, device_pages * PAGE, PAGE, "cuda")
    host = HostKVPool(SHAPE, host_pages * PAGE, PAGE, layout, pin_memory=True)
    ex = TorchExecutor(dev, host, producer_slots=slots)
    return HiCache(dev, host, CacheConfig(write_policy="write_through"), ex), dev, host


def settle(cache, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while cache.pending_job_ids():
        cache.poll()
        if time.monotonic() > deadline:
            raise AssertionError(f"jobs still pending: {cache.pending_job_ids()}")
        time.sleep(0.001)


def insert_random(cache, dev, tokens, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = len(tokens)
    k = torch.randn((SHAPE.layers, n, SHAPE.heads, SHAPE.head_dim), generator=g, device="cuda").to(SHAPE.dtype)
    v = torch.randn((SHAPE.layers, n, SHAPE.heads, SHAPE.head_dim), generator=g, device="cuda").to(SHAPE.dtype)
    idx = cache.alloc_device(n)
    dev.write(idx, None, k, v)
    res = cache.insert(tokens, idx)
    return res.node, k, v


def read_per_layer(dev, lb):
    """Read each layer right after waiting for it, on the current stream."""
    idx = lb.device_indices.to("cuda")
    ks, vs = [], []
    for layer in range(SHAPE.layers):
        lb.wait(layer)
        ks.append(dev.k[layer, idx].clone())
        vs.append(dev.v[layer, idx].clone())
    return torch.stack(ks), torch.stack(vs)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_is_bit_exact_with_per_layer_waits(layout):
    cache, dev, host = make(layout)
    tokens = tuple(range(8 * PAGE))
    node, k, v = insert_random(cache, dev, tokens, 0)
    settle(cache)
    assert node.state == "device_host"
    assert cache.evict(len(tokens)) == len(tokens)
    dev.kv.zero_()  # nothing stale can pass for loaded data
    lb = cache.load_back(cache.match_prefix(tokens).last_host_node)
    assert lb is not None
    cache.flush()
    assert isinstance(lb.handle._wait, SlotWait)
    got_k, got_v = read_per_layer(dev, lb)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    settle(cache)
    assert node.state == "device_host"
    cache.check_invariants()
    cache.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_consecutive_load_batches_overlap_and_each_waits_on_its_own_slot(layout):
    cache, dev, host = make(layout, device_pages=96, host_pages=192, slots=3)
    prompts = [tuple(range(i * 1000, i * 1000 + 6 * PAGE)) for i in range(5)]
    written = {}
    for i, tokens in enumerate(prompts):
        node, k, v = insert_random(cache, dev, tokens, i)
        written[tokens] = (k, v)
    settle(cache)
    cache.evict(10**9)
    loads = []
    for tokens in prompts:  # one batch per load: flush between them; 5 batches on a ring of 3 slots
        lb = cache.load_back(cache.match_prefix(tokens).last_host_node)
        cache.flush()
        loads.append((tokens, lb))
    waits = [lb.handle._wait for _, lb in loads]
    assert all(isinstance(w, SlotWait) for w in waits)
    assert len({id(w.slot) for w in waits[:3]}) == 3  # consecutive batches use different producer slots
    for tokens, lb in reversed(loads):  # consumers in any order
        got_k, got_v = read_per_layer(dev, lb)
        k, v = written[tokens]
        assert torch.equal(got_k, k) and torch.equal(got_v, v)
    settle(cache)
    cache.check_invariants()
    cache.close()


def test_load_of_a_chain_under_a_loading_ancestor_waits_for_both():
    cache, dev, host = make("layer_first")
    parent_tokens = tuple(range(4 * PAGE))
    child_tokens = parent_tokens + tuple(range(5000, 5000 + 4 * PAGE))
    _, pk, pv = insert_random(cache, dev, parent_tokens, 1)
    settle(cache)
    m = cache.match_prefix(child_tokens)
    idx = cache.alloc_device(4 * PAGE)
    g = torch.Generator(device="cuda").manual_seed(2)
    ck = torch.randn((SHAPE.layers, 4 * PAGE, SHAPE.heads, SHAPE.head_dim), generator=g, device="cuda").half()
    cv = torch.randn_like(ck)
    dev.write(idx, None, ck, cv)
    cache.insert(child_tokens, torch.cat([m.device_indices, idx]))
    settle(cache)
    cache.evict(10**9)
    lb_parent = cache.load_back(cache.match_prefix(parent_tokens).last_host_node)
    cache.flush()
    lb_child = cache.load_back(cache.match_prefix(child_tokens).last_host_node)
    assert lb_child.nodes[0].parent is lb_parent.last_node
    cache.flush()
    full_idx = torch.cat([lb_parent.device_indices, lb_child.device_indices]).to("cuda")
    for layer in range(SHAPE.layers):
        lb_child.wait(layer)  # waits for the parent's layer too
        assert torch.equal(dev.k[layer, full_idx], torch.cat([pk[layer], ck[layer]]))
        assert torch.equal(dev.v[layer, full_idx], torch.cat([pv[layer], cv[layer]]))
    settle(cache)
    cache.close()
