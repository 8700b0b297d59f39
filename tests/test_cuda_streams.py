"""The CUDA executor's stream contract (skipped without CUDA).

A batch's copies run after the work queued on the pool's GPU's current stream
when the batch starts, and ``wait(layer)`` orders that stream after the
layer's copy, whichever GPU is current; a failed submit fails its batch.
Each test queues a long sleep on the stream whose order matters, so a copy or
a read that ignored the order would see zeros: the data check is exact and
needs no timing.
"""

from __future__ import annotations

import time

import pytest
import torch

from hicache_fsm import executors
from hicache_fsm.cache import HiCache
from hicache_fsm.config import CacheConfig
from hicache_fsm.errors import ConfigError
from hicache_fsm.executors import TorchExecutor
from hicache_fsm.pools import DeviceKVPool, HostKVPool, KVShape

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PAGE = 16
SHAPE = KVShape(layers=4, heads=8, head_dim=64, dtype=torch.float16)
SLEEP_CYCLES = 200_000_000  # about 0.1 s of one GPU thread: far longer than the Python between two calls


def build(device: str, layout: str = "layer_first"):
    dev = DeviceKVPool(SHAPE, 64 * PAGE, PAGE, device)
    host = HostKVPool(SHAPE, 128 * PAGE, PAGE, layout, pin_memory=True)
    ex = TorchExecutor(dev, host)
    return HiCache(dev, host, CacheConfig(write_policy="write_through"), ex), dev, ex


def settle(cache, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout  # a hang guard only: no verdict reads the clock
    while cache.pending_job_ids():
        cache.poll()
        if time.monotonic() > deadline:
            raise AssertionError(f"jobs still pending: {cache.pending_job_ids()}")
        time.sleep(0.001)


def random_kv(device: torch.device, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    dims = (SHAPE.layers, n, SHAPE.heads, SHAPE.head_dim)
    k = torch.randn(dims, generator=g, device=device).to(SHAPE.dtype)
    v = torch.randn(dims, generator=g, device=device).to(SHAPE.dtype)
    torch.cuda.synchronize(device)
    return k, v


def insert_late(cache, dev, tokens, k, v):
    """Insert ``tokens`` whose KV the pool's current stream writes only after a long sleep."""
    idx = cache.alloc_device(len(tokens))
    with torch.cuda.device(dev.device):
        torch.cuda._sleep(SLEEP_CYCLES)
        dev.write(idx, None, k, v)
    return cache.insert(tokens, idx).node


def reload_and_read(cache, dev, ex, tokens):
    """Load evicted ``tokens`` back behind a sleeping load stream, read each layer after its wait."""
    dev.kv.zero_()  # nothing stale can pass for loaded data
    lb = cache.load_back(cache.match_prefix(tokens).last_host_node)
    assert lb is not None
    with torch.cuda.device(dev.device), torch.cuda.stream(ex.load_stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # the load lands late: a read not ordered after it sees zeros
    cache.flush()
    ks, vs = [], []
    with torch.cuda.device(dev.device):
        idx = lb.device_indices.to(dev.device)
        for layer in range(SHAPE.layers):
            lb.wait(layer)
            ks.append(dev.k[layer, idx].clone())
            vs.append(dev.v[layer, idx].clone())
    return torch.stack(ks), torch.stack(vs)


def test_a_bare_cuda_pool_names_the_gpu_its_memory_is_on():
    dev = DeviceKVPool(SHAPE, 4 * PAGE, PAGE, "cuda")
    assert dev.device == torch.device("cuda", torch.cuda.current_device()) == dev.kv.device


def test_a_draft_pool_on_another_device_than_the_target_is_refused():
    dev = DeviceKVPool(SHAPE, 4 * PAGE, PAGE, "cuda")
    host = HostKVPool(SHAPE, 4 * PAGE, PAGE, pin_memory=True)
    draft = DeviceKVPool(SHAPE, 4 * PAGE, PAGE, "cpu")
    draft_host = HostKVPool(SHAPE, 4 * PAGE, PAGE, pin_memory=True)
    with pytest.raises(ConfigError, match="one executor's streams serve one device"):
        TorchExecutor(dev, host, draft, draft_host)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_backup_follows_the_engines_write_and_reads_follow_each_layers_load(layout):
    cache, dev, ex = build("cuda", layout)
    tokens = tuple(range(8 * PAGE))
    k, v = random_kv(dev.device, len(tokens), 0)
    node = insert_late(cache, dev, tokens, k, v)
    settle(cache)
    assert node.state == "device_host"
    assert cache.evict(len(tokens)) == len(tokens)
    got_k, got_v = reload_and_read(cache, dev, ex, tokens)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    settle(cache)
    cache.check_invariants()
    cache.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_pool_on_a_gpu_that_is_not_current_orders_its_copies_on_that_gpu():
    torch.cuda.set_device(0)
    cache, dev, ex = build("cuda:1")
    assert dev.device == torch.device("cuda", 1)
    tokens = tuple(range(8 * PAGE))
    k, v = random_kv(dev.device, len(tokens), 1)
    insert_late(cache, dev, tokens, k, v)  # written on cuda:1's stream while cuda:0 is current
    settle(cache)
    assert cache.evict(len(tokens)) == len(tokens)
    got_k, got_v = reload_and_read(cache, dev, ex, tokens)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    settle(cache)
    cache.close()


def test_a_copy_that_raises_on_the_gpu_fails_its_batch_and_the_cache_goes_on(monkeypatch):
    cache, dev, ex = build("cuda")
    tokens = tuple(range(8 * PAGE))
    k, v = random_kv(dev.device, len(tokens), 2)
    insert_late(cache, dev, tokens, k, v)
    settle(cache)
    assert cache.evict(len(tokens)) == len(tokens)
    free = dev.allocator.available_tokens
    real = executors.load_to_device

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(executors, "load_to_device", out_of_memory)
    lb = cache.load_back(cache.match_prefix(tokens).last_host_node)
    assert lb is not None
    cache.poll()  # the submit fails: the load fails, no error escapes into the engine
    settle(cache)
    node = cache.match_prefix(tokens).last_host_node
    assert node is not None and node.state == "host"
    assert dev.allocator.available_tokens == free  # the reserved slots came back
    cache.check_invariants()
    monkeypatch.setattr(executors, "load_to_device", real)
    got_k, got_v = reload_and_read(cache, dev, ex, tokens)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    cache.close()
