"""Helpers for the storage-tier tests: small caches over real KV and bounded waits."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import torch

from hicache_fsm.cache import HiCache
from hicache_fsm.config import CacheConfig
from hicache_fsm.model import TinyModel
from hicache_fsm.pools import DeviceKVPool, HostKVPool
from hicache_fsm.storage.link import THREAD_PREFIX

PAGE = 4
WAIT = 120.0  # seconds: a safety stop for stuck threads only (fails loudly), never reached on a busy machine

_MODEL: TinyModel | None = None


def model() -> TinyModel:
    global _MODEL
    if _MODEL is None:
        _MODEL = TinyModel(layers=2, heads=2, head_dim=8, vocab=256, seed=0)
    return _MODEL


def make_cache(device_pages: int = 32, host_pages: int = 64, page_size: int = PAGE, layout: str = "layer_first",
               **config) -> HiCache:
    m = model()
    shape = m.kv_shape
    device = DeviceKVPool(shape, device_pages * page_size, page_size, "cpu")
    host = HostKVPool(shape, host_pages * page_size, page_size, layout, pin_memory=False)
    config.setdefault("write_policy", "write_through")
    return HiCache(device, host, CacheConfig(**config))


def prompt(n: int, seed: int = 0) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, 256, (n,), generator=g).tolist())


_KV: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def kv(tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's K/V of ``tokens`` (memoised, so the same sequence always gives the same tensors)."""
    key = tuple(tokens)
    if key not in _KV:
        _, k, v = model().prefill(list(key))
        _KV[key] = (k, v)
    return _KV[key]


def put(cache: HiCache, tokens: Sequence[int]):
    """Compute the KV of ``tokens`` and insert it (the cache takes the slots)."""
    k, v = kv(tokens)
    idx = cache.alloc_device(len(tokens))
    assert idx is not None, "device pool too small for the test"
    cache.device_pool.write(idx, None, k, v)
    return cache.insert(tokens, idx).node


def wait_until(cache: HiCache, cond: Callable[[], bool], timeout: float = WAIT, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while True:
        cache.poll()
        if cond():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; stats={cache.stats().get('storage')}")
        time.sleep(0.002)


def ready(cache: HiCache, rid, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not cache.prefetch_ready(rid):
        if time.monotonic() > deadline:
            raise AssertionError(f"prefetch {rid!r} not ready after {timeout}s")
        time.sleep(0.002)


def path_nodes(cache: HiCache, tokens: Sequence[int]):
    path, matched, _ = cache.tree.walk(tuple(tokens))
    return path, matched


def cached_kv(cache: HiCache, tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """K/V the cache holds for the longest cached prefix of ``tokens`` (device copy, else host); its length."""
    path, matched = path_nodes(cache, tokens)
    ks, vs = [], []
    for node in path:
        if node.device_indices is not None and node.state not in ("loading", "loading_storing", "loading_stored"):
            k, v = cache.device_pool.read(node.device_indices)
        else:
            k, v = cache.host_pool.read(node.host_indices)
        ks.append(k)
        vs.append(v)
    if not ks:
        return torch.empty(0), torch.empty(0), 0
    return torch.cat(ks, 1), torch.cat(vs, 1), matched


def assert_kv_intact(cache: HiCache, tokens: Sequence[int], min_tokens: int | None = None) -> int:
    """The cached prefix of ``tokens`` has exactly the model's KV; returns its length."""
    k, v, n = cached_kv(cache, tokens)
    if min_tokens is not None:
        assert n >= min_tokens, f"only {n} of {min_tokens} tokens still cached"
    if n:  # the KV ``put(tokens)`` wrote (the model's numerics depend on the sequence length)
        rk, rv = kv(tokens)
        assert torch.equal(k, rk[:, :n]) and torch.equal(v, rv[:, :n]), "cached KV differs from what was written"
    return n


def settle(cache: HiCache, timeout: float = WAIT) -> None:
    """Poll until no storage transfer is in flight."""
    wait_until(cache, lambda: cache.storage_transfers_in_flight() == 0, timeout, "storage transfers to finish")


def storage_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX) and t.is_alive()]


def evict_all(cache: HiCache, tokens: Sequence[int]) -> None:
    """Take ``tokens``' nodes off the device and then off the host (they must be stored)."""
    path, _ = path_nodes(cache, tokens)
    for node in reversed(path):
        if node.state in ("device_host", "device_host_stored"):
            cache.evict_node(node)
    cache.evict_host(cache.host_pool.size_tokens)


def load_and_read(cache: HiCache, tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """match + load_back + wait every layer; K/V on the device of the whole matched prefix."""
    m = cache.match_prefix(tokens)
    lb = cache.load_back(m.last_host_node)
    if lb is not None:
        for layer in range(cache.device_pool.layers):
            lb.wait(layer)
        idx = torch.cat([m.device_indices, lb.device_indices])
    else:
        idx = m.device_indices
    cache.poll()
    k, v = cache.device_pool.read(idx)
    return k, v, int(idx.numel())
