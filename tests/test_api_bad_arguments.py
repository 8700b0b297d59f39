"""Bad arguments to the Python API: a typed error up front, with a one-line message, and nothing changed.

Each call here once failed inside the library (an AttributeError, numpy's or
pathlib's error) or not at all; now it raises the library's own error before
touching anything, so the pools it was given still build a cache.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any, Callable

import pytest
import torch
from mooncake_fixture import free_port

from hicache_fsm.allocator import PageAllocator
from hicache_fsm.cache import HiCache
from hicache_fsm.errors import ConfigError, SpecError, StorageLinkError, StorageUnavailable
from hicache_fsm.machine import compile_machine
from hicache_fsm.pools import DeviceKVPool, HostKVPool, KVShape
from hicache_fsm.spec import load_all, load_builtin, load_spec
from hicache_fsm.storage import mooncake
from hicache_fsm.transitions_dispatch import TransitionsDispatcher

SHAPE = KVShape(1, 1, 4)
PAGE = 16
KV_DIM = 1 << 20  # pools.MAX_KV_DIM, spelled out so this file also runs against the code before the bound
MOONCAKE_ENV = ("MC_STORE_CLIENT_SETUP_RETRIES", "MC_LOG_LEVEL", "GLOG_minloglevel", "MC_TCP_BIND_ADDRESS")
Pools = tuple[DeviceKVPool, HostKVPool]


@pytest.fixture
def pools() -> Pools:
    return DeviceKVPool(SHAPE, 4 * PAGE, PAGE, "cpu"), HostKVPool(SHAPE, 8 * PAGE, PAGE, pin_memory=False)


def builds_a_cache(pools: Pools) -> None:
    """Nothing changed: the same pools still serve a new cache."""
    HiCache(*pools).close()


BAD_CALLS: list[tuple[str, Callable[[Pools], Any], type[Exception]]] = [
    ("hicache-none-pools", lambda p: HiCache(None, None), ConfigError),
    ("hicache-int-dispatcher", lambda p: HiCache(*p, dispatcher=5), ConfigError),
    ("hicache-other-machine", lambda p: HiCache(*p, dispatcher=compile_machine(load_builtin("prefetch"))),
     ConfigError),
    ("device-pool-none-shape", lambda p: DeviceKVPool(None, PAGE, PAGE, "cpu"), ConfigError),
    ("device-pool-str-shape", lambda p: DeviceKVPool("x", PAGE, PAGE, "cpu"), ConfigError),
    ("host-pool-none-shape", lambda p: HostKVPool(None, 2 * PAGE, PAGE, pin_memory=False), ConfigError),
    ("host-matching-none", lambda p: HostKVPool.matching(None, 2 * PAGE), ConfigError),
    ("device-pool-past-memory", lambda p: DeviceKVPool(SHAPE, 10**30, PAGE, "cpu"), ConfigError),
    ("host-pool-past-memory", lambda p: HostKVPool(SHAPE, 10**30, PAGE, pin_memory=False), ConfigError),
    ("allocator-past-memory", lambda p: PageAllocator(10**30, PAGE), ConfigError),
    ("device-kv-past-memory", lambda p: DeviceKVPool(KVShape(KV_DIM, KV_DIM, KV_DIM), PAGE, PAGE, "cpu"),
     ConfigError),
    ("shape-huge-layers", lambda p: KVShape(10**30, 1, 1), ConfigError),
    ("shape-huge-heads", lambda p: KVShape(1, KV_DIM + 1, 1), ConfigError),
    ("shape-huge-head-dim", lambda p: KVShape(1, 1, KV_DIM + 1), ConfigError),
    ("load-spec-int", lambda p: load_spec(5), SpecError),
    ("load-spec-none", lambda p: load_spec(None), SpecError),
    ("load-spec-bytes", lambda p: load_spec(b"x.yaml"), SpecError),
    ("load-spec-nul", lambda p: load_spec("x\0.yaml"), SpecError),
    ("load-all-int", lambda p: load_all(5), SpecError),
    ("load-all-int-path", lambda p: load_all([5]), SpecError),
    ("load-all-bytes", lambda p: load_all(b"x.yaml"), SpecError),
]


@pytest.mark.parametrize("call, error", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_call_raises_typed_error_and_changes_nothing(pools: Pools, call, error) -> None:
    with pytest.raises(error) as info:
        call(pools)
    assert "\n" not in str(info.value)
    builds_a_cache(pools)


def test_residency_dispatchers_are_accepted(pools: Pools) -> None:
    """The check refuses what is not a residency machine, not the dispatchers the cache can run under."""
    HiCache(*pools, dispatcher=compile_machine(load_builtin("residency"))).close()
    HiCache(*pools, dispatcher=TransitionsDispatcher(load_builtin("residency"))).close()


def test_realistic_sizes_are_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bounds are past any real model or machine: they never refuse what could be held."""
    from hicache_fsm.pools import MAX_KV_DIM, check_pool_fits

    assert MAX_KV_DIM == KV_DIM
    big = KVShape(126, 128, 576, torch.bfloat16)  # more layers, heads and head dim than any model has together
    assert big.token_bytes > 0
    PageAllocator(10_000_000, PAGE)  # ten million slots: 80 MB of tables
    monkeypatch.setattr("hicache_fsm.pools.physical_memory_bytes", lambda: 4 << 40)  # a 4 TiB host
    check_pool_fits(KVShape(80, 8, 128, torch.bfloat16), 10_000_000, torch.device("cpu"))  # 3 TiB of KV


def test_device_pool_bound_is_its_gpu_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU pool is weighed against that GPU's memory, not the host's (no GPU needed: its size is faked)."""
    from hicache_fsm.pools import check_pool_fits

    gpu = types.SimpleNamespace(total_memory=80 << 30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: gpu)
    monkeypatch.setattr("hicache_fsm.pools.physical_memory_bytes", lambda: 4 << 40)
    shape = KVShape(80, 8, 128, torch.bfloat16)  # 320 KiB a token
    check_pool_fits(shape, 200_000, torch.device("cuda", 0))  # 61 GiB
    with pytest.raises(ConfigError, match="memory on cuda:0"):
        check_pool_fits(shape, 300_000, torch.device("cuda", 0))  # 92 GiB


@pytest.fixture
def clean_mooncake_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """None of the variables the mooncake backend sets, so that setting one shows."""
    for name in MOONCAKE_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.usefixtures("clean_mooncake_env")
def test_refused_mooncake_attach_leaves_environment(pools: Pools) -> None:
    """A master nobody listens for is refused before the client is set up, and sets nothing in os.environ."""
    cache = HiCache(*pools)
    before = dict(os.environ)
    with pytest.raises(StorageLinkError):
        cache.attach_storage(f"mooncake://127.0.0.1:{free_port()}")
    assert dict(os.environ) == before
    cache.close()
    builds_a_cache(pools)


class _RefusingStore:
    """A stand-in ``MooncakeDistributedStore`` whose setup records the environment it saw, then fails."""

    seen: list[dict[str, str | None]] = []

    def setup(self, *args: Any) -> int:
        self.seen.append({name: os.environ.get(name) for name in MOONCAKE_ENV})
        return -1

    def close(self) -> None:
        pass


@pytest.fixture
def refusing_mooncake(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, str | None]]:
    """A mooncake whose master answers the probe but refuses every setup (the library itself need not be here)."""
    store = types.ModuleType("mooncake.store")
    store.MooncakeDistributedStore = _RefusingStore
    package = types.ModuleType("mooncake")
    package.store = store
    monkeypatch.setitem(sys.modules, "mooncake", package)
    monkeypatch.setitem(sys.modules, "mooncake.store", store)
    monkeypatch.setattr(mooncake, "probe_rpc", lambda host, port, timeout: None)
    monkeypatch.setattr(mooncake, "SETUP_RETRY_S", 0)
    monkeypatch.setattr(_RefusingStore, "seen", [])
    return _RefusingStore.seen


@pytest.mark.usefixtures("clean_mooncake_env")
def test_each_mooncake_setup_binds_its_own_local_host(refusing_mooncake: list[dict[str, str | None]],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The bind address is each attach's own, the rest as the user set it, and all of it put back afterwards."""
    monkeypatch.setenv("MC_LOG_LEVEL", "INFO")
    before = dict(os.environ)
    for local in ("127.0.0.2", "127.0.0.3"):
        refusing_mooncake.clear()
        with pytest.raises(StorageUnavailable, match="setup"):
            mooncake.MooncakeBackend(f"mooncake://127.0.0.1:1?segment_mb=1&buffer_mb=1&local_host={local}",
                                     connect_timeout=0.01)
        assert dict(os.environ) == before
        assert {seen["MC_TCP_BIND_ADDRESS"] for seen in refusing_mooncake} == {local}
        assert {seen["MC_LOG_LEVEL"] for seen in refusing_mooncake} == {"INFO"}
        assert {seen["MC_STORE_CLIENT_SETUP_RETRIES"] for seen in refusing_mooncake} == {"1"}
