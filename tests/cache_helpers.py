"""Shared builders for the cache tests: small CPU pools, KV that is a function of the prefix."""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable

import torch

from hicache_fsm.cache import HiCache
from hicache_fsm.config import CacheConfig
from hicache_fsm.executors import ManualExecutor, TorchExecutor
from hicache_fsm.pools import DeviceKVPool, HostKVPool, KVShape

SHAPE = KVShape(layers=2, heads=1, head_dim=2)


def make_cache(
    page: int = 4,
    device_pages: int = 16,
    host_pages: int = 32,
    config: CacheConfig | None = None,
    manual: bool = True,
    layout: str = "layer_first",
    shape: KVShape = SHAPE,
) -> tuple[HiCache, ManualExecutor | TorchExecutor]:
    dev = DeviceKVPool(shape, device_pages * page, page, "cpu")
    host = HostKVPool(shape, host_pages * page, page, layout, pin_memory=False)
    ex = ManualExecutor(dev, host) if manual else TorchExecutor(dev, host)
    return HiCache(dev, host, config or CacheConfig(), ex), ex


def expected_kv(tokens, namespace=None, shape: KVShape = SHAPE) -> tuple[torch.Tensor, torch.Tensor]:
    """KV of each token as a function of (namespace, the prefix up to it): equal prefixes, equal KV."""
    vals = []
    crc = zlib.crc32(repr(namespace).encode())
    for t in tokens:
        crc = zlib.crc32(int(t).to_bytes(8, "little", signed=True), crc)
        vals.append(float(crc % 100_003))
    base = torch.tensor(vals, dtype=torch.float32)
    n = len(vals)
    grid = torch.arange(shape.layers * shape.heads * shape.head_dim, dtype=torch.float32).view(
        shape.layers, 1, shape.heads, shape.head_dim)
    k = base.view(1, n, 1, 1) + grid * 0.25
    v = -base.view(1, n, 1, 1) - grid * 0.5
    return k.contiguous(), v.contiguous()


def put(cache: HiCache, tokens, namespace=None, priority: int = 0):
    """The engine path: match, lock the hit, allocate the rest, write its KV, insert, unlock.

    None if the device is full. The lock keeps ``alloc_device``'s eviction
    away from the matched prefix whose indices the engine is about to reuse.
    """
    tokens = tuple(tokens)
    m = cache.match_prefix(tokens, namespace)
    cache.lock(m.last_device_node)
    try:
        n_new = len(tokens) - m.device_hit_length
        idx = cache.alloc_device(n_new)
        if idx is None:
            return None
        k, v = expected_kv(tokens, namespace)
        if n_new:
            cache.device_pool.write(idx, None, k[:, m.device_hit_length:], v[:, m.device_hit_length:])
        full = torch.cat([m.device_indices, idx]) if m.device_hit_length else idx
        return cache.insert(tokens, full, namespace, priority)
    finally:
        cache.unlock(m.last_device_node)


def put_fresh(cache: HiCache, tokens, namespace=None, priority: int = 0):
    """Insert with fresh slots for every token (duplicates of cached parts are freed)."""
    tokens = tuple(tokens)
    idx = cache.alloc_device(len(tokens))
    if idx is None:
        return None
    k, v = expected_kv(tokens, namespace)
    cache.device_pool.write(idx, None, k, v)
    return cache.insert(tokens, idx, namespace, priority)


def device_kv(cache: HiCache, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return cache.device_pool.read(indices)


def host_kv(cache: HiCache, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return cache.host_pool.read(indices)


def drain(cache: HiCache, ex) -> None:
    """Start and complete every job (manual executor), then apply the acks."""
    for _ in range(8):
        cache.poll()
        if isinstance(ex, ManualExecutor):
            ex.complete_all()
        cache.poll()
        if not cache.pending_job_ids():
            return
    raise AssertionError(f"jobs still pending: {cache.pending_job_ids()}")


def pages(n: int, page: int = 4, start: int = 0) -> tuple[int, ...]:
    return tuple(range(start, start + n * page))


def in_thread(fn: Callable[[], object]) -> dict[str, object]:
    """Run ``fn`` in a new thread; its result under "value" or the exception it raised under "error"."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out


def log_id_reads(monkeypatch, log: list[int], names: tuple[str, ...]) -> None:
    """Wrap the functions ``names`` of ``hicache_fsm.request_ids`` so each call appends to ``log`` how many ids it
    reads: all it is handed, or ``min(n, len(ids))`` for a first-page reader called as ``(ids, n)``."""
    import hicache_fsm.request_ids as request_ids

    for name in names:
        real = getattr(request_ids, name)

        def logged(ids, *n, real=real):
            log.append(min((len(ids), *n)))
            return real(ids, *n)

        monkeypatch.setattr(request_ids, name, logged)
