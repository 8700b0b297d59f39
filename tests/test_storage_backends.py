"""The L3 backends (memory, file, redis) against one contract, plus backend-specific failures."""

from __future__ import annotations

import errno
import logging
import os
import time
import uuid

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hicache_fsm.config import MAX_SECONDS
from hicache_fsm.errors import (
    ConfigError,
    StorageError,
    StorageFull,
    StorageKeyError,
    StorageTimeout,
    StorageUnavailable,
    StorageURLError,
)
from hicache_fsm.storage import KeyNamespace, StorageBackend, open_backend, page_keys
from hicache_fsm.storage.blob import CHECKSUMS, payload_checksum
from hicache_fsm.storage.file import FileBackend
from hicache_fsm.storage.memory import MemoryBackend
from hicache_fsm.storage.page_format import PageFormat
from redis_fixture import redis_server  # noqa: F401  (fixture)

BACKENDS = ["memory", "file", "redis"]


class FakeHostPool:
    """The duck-typed host pool interface: a page is its K half then its V half (two views)."""

    def __init__(self, pages: int, page_nbytes: int, *, views: bool = True) -> None:
        assert page_nbytes % 2 == 0
        self.page_nbytes = page_nbytes
        self.page_size = 4
        self.kv = torch.zeros(2, pages, page_nbytes // 2, dtype=torch.uint8)
        if not views:
            self.page_views = None  # type: ignore[assignment]

    def page_views(self, page_id: int) -> list[torch.Tensor]:
        return [self.kv[0, page_id], self.kv[1, page_id]]

    def read_page(self, page_id: int) -> torch.Tensor:
        return torch.cat([self.kv[0, page_id], self.kv[1, page_id]])

    def write_page(self, page_id: int, data) -> None:
        flat = torch.as_tensor(data, dtype=torch.uint8).reshape(-1)
        half = self.page_nbytes // 2
        self.kv[0, page_id].copy_(flat[:half])
        self.kv[1, page_id].copy_(flat[half:])

    def fill_random(self, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.kv.copy_(torch.randint(0, 256, self.kv.shape, dtype=torch.uint8, generator=gen))


@pytest.fixture(params=BACKENDS)
def make_backend(request, tmp_path):
    """make_backend(namespace=None, **options) -> a fresh backend of the parametrized kind."""
    kind = request.param
    opened: list[StorageBackend] = []
    store = f"test-{uuid.uuid4().hex}"
    server = request.getfixturevalue("redis_server") if kind == "redis" else None

    def make(namespace: KeyNamespace | None = None, **options) -> StorageBackend:
        namespace = namespace or KeyNamespace("model")
        if kind == "memory":
            backend = open_backend(f"memory://{store}", namespace=namespace, **options)
        elif kind == "file":
            backend = open_backend(f"file://{tmp_path}/store", namespace=namespace, **options)
        else:
            options.setdefault("socket_timeout", 2.0)
            backend = open_backend(server.url, namespace=namespace, **options)
        opened.append(backend)
        return backend

    make.kind = kind
    make.server = server
    yield make
    for backend in opened:
        backend.close()
    MemoryBackend.drop_shared(store)


KEYS = page_keys(list(range(64)), 4)  # 16 chained page hashes


def test_round_trip_and_exists_prefix(make_backend):
    b = make_backend()
    values = [os.urandom(100 + i) for i in range(4)]
    assert b.batch_set([KEYS[0], KEYS[1], KEYS[3]], [values[0], values[1], values[3]]) == [True] * 3
    assert b.batch_exists(KEYS[:4]) == 2  # stops at the first missing key
    assert b.batch_exists([KEYS[2], KEYS[3]]) == 0
    assert b.batch_exists([KEYS[3], KEYS[0]]) == 2
    assert b.batch_exists([]) == 0
    assert b.batch_get(KEYS[:4]) == [values[0], values[1], None, values[3]]
    assert b.batch_get([]) == []
    # bytes-likes and tensors are accepted as values
    assert b.batch_set([KEYS[4], KEYS[5]], [bytearray(b"xy"), torch.arange(4, dtype=torch.int16)])
    assert b.batch_get([KEYS[4], KEYS[5]]) == [b"xy", torch.arange(4, dtype=torch.int16).numpy().tobytes()]
    assert b.set(KEYS[6], b"") and b.get(KEYS[6]) == b"" and b.exists(KEYS[6])
    s = b.stats()
    assert s["hits"] == 6 and s["misses"] == 1 and s["sets"] == 6 and s["corrupt"] == 0
    assert s["bytes_written"] == sum(map(len, [values[0], values[1], values[3]])) + 2 + 8


def test_skip_existing(make_backend):
    b = make_backend()
    assert b.batch_set([KEYS[0]], [b"first"]) == [True]
    assert b.batch_set([KEYS[0], KEYS[1]], [b"second", b"other"]) == [True, True]
    assert b.batch_get([KEYS[0]]) == [b"first"]
    s = b.stats()
    assert s["skipped_existing"] == 1 and s["bytes_written"] == len(b"first") + len(b"other")


def test_zero_copy_round_trip(make_backend):
    b = make_backend()
    src = FakeHostPool(6, 4096)
    src.fill_random(1)
    assert b.batch_set_from(KEYS[:3], src, [4, 0, 2]) == [True] * 3
    dst = FakeHostPool(8, 4096)
    assert b.batch_get_into(KEYS[:4], dst, torch.tensor([7, 1, 3, 5])) == [True, True, True, False]
    assert torch.equal(dst.read_page(7), src.read_page(4))
    assert torch.equal(dst.read_page(1), src.read_page(0))
    assert torch.equal(dst.read_page(3), src.read_page(2))
    # the plain API sees the same bytes, and a pool without page_views works through read/write_page
    assert b.batch_get([KEYS[1]]) == [src.read_page(0).numpy().tobytes()]
    plain = FakeHostPool(2, 4096, views=False)
    assert b.batch_get_into([KEYS[2]], plain, [1]) == [True]
    assert torch.equal(plain.read_page(1), src.read_page(2))
    assert b.batch_set_from([KEYS[9]], plain, [1]) == [True]
    assert b.batch_get([KEYS[9]]) == [src.read_page(2).numpy().tobytes()]
    assert b.stats()["bytes_read"] == 6 * 4096


def test_get_into_wrong_page_size_is_a_miss(make_backend):
    b = make_backend()
    b.batch_set([KEYS[0]], [b"x" * 100])
    assert b.batch_get_into([KEYS[0]], FakeHostPool(1, 64), [0]) == [False]
    assert b.stats()["corrupt"] == 1


def test_argument_errors(make_backend):
    b = make_backend()
    with pytest.raises(StorageKeyError):
        b.batch_set([KEYS[0]], [b"a", b"b"])
    with pytest.raises(StorageKeyError):
        b.batch_get_into([KEYS[0]], FakeHostPool(2, 16), [0, 1])
    for bad in ["", "a/b", "with space", "../up"]:
        with pytest.raises(StorageKeyError):
            b.batch_get([bad])
    with pytest.raises(StorageKeyError):
        b.batch_exists("abc")  # a str is not a batch


def test_corrupt_value_is_a_counted_logged_miss(make_backend, caplog):
    b = make_backend()
    src = FakeHostPool(2, 256)
    src.fill_random(2)
    b.batch_set_from(KEYS[:2], src, [0, 1])
    assert b.debug_corrupt(KEYS[0])
    with caplog.at_level(logging.WARNING, logger="hicache_fsm.storage"):
        assert b.batch_get([KEYS[0], KEYS[1]]) == [None, src.read_page(1).numpy().tobytes()]
        assert b.batch_set_from(KEYS[:1], src, [0]) == [True]  # the corrupt page was removed: stored again
        assert b.debug_corrupt(KEYS[0])
        assert b.batch_get_into(KEYS[:2], FakeHostPool(2, 256), [0, 1]) == [False, True]
    s = b.stats()
    assert s["corrupt"] == 2 and s["corrupt_removed"] == 2 and s["misses"] == 2 and s["hits"] == 2
    assert any("corrupt" in r.getMessage() for r in caplog.records if r.name == "hicache_fsm.storage")


def test_namespaces_isolate_tenants(make_backend):
    a = make_backend(KeyNamespace("model", tenant="alice"))
    b = make_backend(KeyNamespace("model", tenant="bob"))
    rank1 = make_backend(KeyNamespace("model", tenant="alice", tp_rank=1, tp_size=2))
    a.batch_set(KEYS[:2], [b"alice0", b"alice1"])
    assert b.batch_exists(KEYS[:2]) == 0 and b.batch_get(KEYS[:2]) == [None, None]
    assert rank1.batch_exists(KEYS[:2]) == 0
    b.batch_set([KEYS[0]], [b"bob0"])  # same page key, different tenant: stored separately
    assert a.batch_get([KEYS[0]]) == [b"alice0"] and b.batch_get([KEYS[0]]) == [b"bob0"]
    a.clear()
    assert a.batch_exists(KEYS[:2]) == 0
    assert b.batch_get([KEYS[0]]) == [b"bob0"]


def test_closed_backend_refuses(make_backend):
    b = make_backend()
    b.close()
    b.close()  # idempotent
    with pytest.raises(StorageUnavailable):
        b.batch_get([KEYS[0]])


@pytest.mark.parametrize("checksum", ["wsum64", "crc32"])
def test_checksum_choices_interoperate(make_backend, checksum):
    writer = make_backend(checksum=checksum)
    reader = make_backend(checksum="crc32" if checksum == "wsum64" else "wsum64")
    writer.batch_set([KEYS[0]], [b"payload" * 99])
    assert reader.batch_get([KEYS[0]]) == [b"payload" * 99]
    with pytest.raises(StorageKeyError):
        make_backend(checksum="md5")


# ---------------------------------------------------------------- size cap (memory, file)


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_size_cap_evicts_least_recently_used(kind, tmp_path):
    url = "memory://" if kind == "memory" else f"file://{tmp_path}"
    b = open_backend(url, namespace=KeyNamespace("m"), max_bytes=3500)  # 3 pages of 1000 B (+ header) fit
    pages = [os.urandom(1000) for _ in range(5)]
    assert b.batch_set(KEYS[:3], pages[:3]) == [True] * 3
    assert b.batch_get([KEYS[0]]) == [pages[0]]  # page 0 is now most recent
    assert b.batch_set([KEYS[3]], [pages[3]]) == [True]
    assert b.batch_get(KEYS[:4]) == [pages[0], None, pages[2], pages[3]]
    assert b.stats()["evictions"] == 1
    # a page bigger than the cap is refused, not stored, nothing evicted for it
    assert b.batch_set([KEYS[4]], [b"z" * 4000]) == [False]
    assert b.batch_exists([KEYS[4]]) == 0 and b.stats()["set_failures"] == 1
    b.close()


def test_file_lru_order_seeded_from_mtimes(tmp_path):
    url = f"file://{tmp_path}"
    b = open_backend(url, namespace=KeyNamespace("m"))
    b.batch_set(KEYS[:3], [b"a" * 1000, b"b" * 1000, b"c" * 1000])
    now = time.time()
    for age, key in zip([10, 30, 20], KEYS[:3]):  # KEYS[1] is the oldest, then KEYS[2]
        os.utime(b.path_for(key), (now - age, now - age))
    b.close()
    capped = open_backend(url, namespace=KeyNamespace("m"), max_bytes=2400)  # room for two
    assert capped.batch_exists([KEYS[0]]) == 1 and capped.batch_exists([KEYS[2]]) == 1
    assert capped.batch_exists([KEYS[1]]) == 0
    capped.batch_set([KEYS[3]], [b"d" * 1000])  # evicts KEYS[2], the older survivor
    assert [capped.batch_exists([k]) for k in KEYS[:4]] == [1, 0, 0, 1]
    capped.close()


# ---------------------------------------------------------------- file specifics


def test_file_layout_hides_user_strings(tmp_path):
    b = FileBackend(tmp_path, KeyNamespace("model", tenant="acme"))
    b.batch_set(["plain-key"], [b"v"])
    path = b.path_for("plain-key")
    assert os.path.exists(path) and path.startswith(str(tmp_path))
    rel = os.path.relpath(path, tmp_path)
    assert "plain-key" not in rel and "acme" not in rel and "model" not in rel
    assert [n for n in os.listdir(os.path.dirname(path)) if n.endswith(".tmp")] == []
    with open(path, "rb") as f:
        assert f.read(4) == b"HCKV"


def test_file_short_or_misplaced_file_is_a_miss(tmp_path):
    b = FileBackend(tmp_path, KeyNamespace("m"))
    src = FakeHostPool(3, 512)
    src.fill_random(3)

    def damage() -> None:  # a read removes the damaged files: damage a fresh copy before each path
        b.batch_set_from(KEYS[:3], src, [0, 1, 2])
        with open(b.path_for(KEYS[0]), "r+b") as f:
            f.truncate(os.path.getsize(b.path_for(KEYS[0])) - 1)
        with open(b.path_for(KEYS[1]), "r+b") as f:
            f.truncate(10)  # shorter than a header
        os.makedirs(os.path.dirname(b.path_for(KEYS[3])), exist_ok=True)
        os.replace(b.path_for(KEYS[2]), b.path_for(KEYS[3]))  # a whole, valid page under the wrong name

    damage()
    assert b.batch_get(KEYS[:4]) == [None, None, None, None]
    damage()
    assert b.batch_get_into(KEYS[:4], FakeHostPool(4, 512), [0, 1, 2, 3]) == [False] * 4
    assert b.stats()["corrupt"] == 6  # every page that exists but is damaged, on both paths
    assert b.stats()["corrupt_removed"] == 6


def test_file_disk_full_raises_and_leaves_nothing(tmp_path, monkeypatch):
    b = FileBackend(tmp_path, KeyNamespace("m"))
    real_writev = os.writev
    calls = []

    def failing_writev(fd, buffers):
        calls.append(fd)
        if len(calls) == 1:  # first write lands part of the page, the next one hits a full disk
            return real_writev(fd, [memoryview(buffers[0])[:10]])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "writev", failing_writev)
    with pytest.raises(StorageFull) as info:
        b.batch_set([KEYS[0]], [b"x" * 5000])
    assert isinstance(info.value, StorageError)
    monkeypatch.setattr(os, "writev", real_writev)
    shard = os.path.dirname(b.path_for(KEYS[0]))
    assert not os.path.exists(b.path_for(KEYS[0]))
    assert os.listdir(shard) == []  # the temporary file is gone too
    assert b.stats()["errors"] == 1 and b.batch_exists([KEYS[0]]) == 0
    assert b.batch_set([KEYS[0]], [b"x" * 5000]) == [True]  # space is back: works again


def test_file_other_io_error_is_storage_error(tmp_path, monkeypatch):
    b = FileBackend(tmp_path, KeyNamespace("m"))
    b.batch_set([KEYS[0]], [b"vv"])

    def eio(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "readv", eio)
    with pytest.raises(StorageError):
        b.batch_get_into([KEYS[0]], FakeHostPool(1, 2), [0])


def test_file_io_threads_and_reopen(tmp_path):
    b = FileBackend(tmp_path, KeyNamespace("m"), io_threads=3)
    src = FakeHostPool(8, 2048)
    src.fill_random(4)
    assert b.batch_set_from(KEYS[:8], src, range(8)) == [True] * 8
    b.close()
    again = FileBackend(tmp_path, KeyNamespace("m"), io_threads=2)
    dst = FakeHostPool(8, 2048)
    assert again.batch_get_into(KEYS[:8], dst, range(8)) == [True] * 8
    assert torch.equal(dst.kv, src.kv)
    again.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=st.lists(st.binary(max_size=3000), min_size=1, max_size=5), checksum=st.sampled_from(["wsum64", "crc32"]))
def test_file_round_trips_random_bytes(tmp_path_factory, values, checksum):
    b = FileBackend(tmp_path_factory.mktemp("rt"), KeyNamespace("m"), checksum=checksum)
    keys = KEYS[: len(values)]
    assert b.batch_set(keys, values) == [True] * len(values)
    assert b.batch_get(keys) == values
    b.close()


@settings(max_examples=40, deadline=None)
@given(data=st.binary(min_size=1, max_size=2000), cuts=st.lists(st.integers(0, 2000), max_size=4),
       flip=st.integers(0, 10**6))
def test_checksum_independent_of_split_and_catches_bit_flips(data, cuts, flip):
    bounds = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    parts = [data[i:j] for i, j in zip(bounds, bounds[1:])]
    for algo in (CHECKSUMS["wsum64"], CHECKSUMS["crc32"]):
        whole = payload_checksum([data], algo)
        assert payload_checksum(parts, algo) == whole
        damaged = bytearray(data)
        damaged[flip % len(data)] ^= 1 << (flip % 8)
        assert payload_checksum([bytes(damaged)], algo) != whole


@settings(max_examples=200, deadline=None)
@given(data=st.binary(min_size=16, max_size=4096), first=st.integers(0, 10**6), second=st.integers(0, 10**6),
       high=st.booleans())
def test_wsum64_catches_every_pair_of_bit_flips(data, first, second, high):
    """Two flips cancel in a one-lane sum mod 2**64 when both sit at bit 47 or above of their words
    (a pair of top bits always did): ``high`` draws such pairs, at one bit position, most of the time."""
    bits = len(data) * 8
    i = first % bits
    if high:  # the same high bit of two different 64-bit words
        words = len(data) // 8
        bit = 47 + first % 17
        i, j = (first % words) * 64 + bit, ((first + 1 + second % (words - 1 or 1)) % words) * 64 + bit
    else:
        j = second % bits
    assume(i != j)
    algo = CHECKSUMS["wsum64"]
    damaged = bytearray(data)
    for b in (i, j):
        damaged[b // 8] ^= 1 << (b % 8)
    assert payload_checksum([bytes(damaged)], algo) != payload_checksum([data], algo)


# ---------------------------------------------------------------- open_backend


def test_open_backend_rejects_unknown_urls(tmp_path):
    for url in ["s3://bucket/x", "nonsense", "file://host/dir", "memory://x/y", "file://", "memory://a[b]"]:
        with pytest.raises(StorageURLError) as info:
            open_backend(url)
        assert isinstance(info.value, ConfigError) and isinstance(info.value, StorageError)
    assert isinstance(open_backend(f"file://{tmp_path}"), FileBackend)
    assert isinstance(open_backend("memory://"), MemoryBackend)


def test_file_urls_decode_one_segment_at_a_time(tmp_path):
    """RFC 8089: a percent-encoded space is part of a name; an encoded slash is no separator but a name no
    POSIX directory can have, so it is refused and nothing is created."""
    spaced = open_backend(f"file://{tmp_path}/a%20b")
    assert isinstance(spaced, FileBackend) and (tmp_path / "a b").is_dir()
    spaced.close()
    for url in [f"file://{tmp_path}/a%2Fb", f"file://{tmp_path}/a%2fb", f"file://{tmp_path}/c%00", "file:///%2F"]:
        with pytest.raises(StorageURLError, match="%2F"):
            open_backend(url)
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()


NO_SERVER = "redis://127.0.0.1:1/0"  # nothing listens: a refusal below comes before any connect


@pytest.mark.parametrize("url, options, named", [
    ("file", {"bogus": 1}, "bogus"),
    ("file", {"fsync": "yes"}, "fsync"),
    ("file", {"io_threads": 2.0}, "io_threads"),
    ("memory://", {"max_entries": 3}, "max_entries"),
    (NO_SERVER, {"socket_timeout": -1}, "socket_timeout"),
    (NO_SERVER, {"socket_timeout": "5"}, "socket_timeout"),
    (NO_SERVER, {"connect_timeout": float("nan")}, "connect_timeout"),
    (NO_SERVER, {"max_connections": "4"}, "max_connections"),
    (NO_SERVER, {"chunk_pages": 1.5}, "chunk_pages"),
    (NO_SERVER, {"retries": True}, "retries"),
    (NO_SERVER, {"ttl": True}, "ttl"),
    (NO_SERVER, {"check": "no"}, "check"),
    (NO_SERVER, {"root": "/tmp"}, "root"),
    ("redis://127.0.0.1:1/abc", {}, "database"),
    ("redis://127.0.0.1:1/0?bogus=1", {}, "bogus"),
    ("mooncake://127.0.0.1:1", {"socket_timeout": 1.0}, "socket_timeout"),
    ("mooncake://127.0.0.1:1", {"connect_timeout": 0}, "connect_timeout"),
])
def test_an_option_a_backend_cannot_use_is_refused_by_name_before_anything_is_opened(tmp_path, url, options, named):
    """Not a TypeError from a constructor or redis-py, not a value taken as another (``"no"`` read as true)."""
    store = tmp_path / "store"
    with pytest.raises(StorageURLError, match=named):
        open_backend(f"file://{store}" if url == "file" else url, **options)
    assert not store.exists()


@settings(max_examples=60, deadline=None)
@given(value=st.one_of(st.integers(-3, 10), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                       st.text(max_size=3), st.none()))
def test_a_redis_timeout_is_taken_exactly_when_it_is_a_positive_finite_number(value):
    """(Finite: at most ``MAX_SECONDS``, the longest wait a thread or socket takes.)"""
    try:
        backend = open_backend(NO_SERVER, socket_timeout=value, check=False)
    except StorageURLError:
        assert isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_SECONDS
    else:
        assert not isinstance(value, bool) and 0 < value <= MAX_SECONDS
        backend.close()


# ---------------------------------------------------------------- redis specifics


def test_redis_killed_then_restarted(redis_server):  # noqa: F811
    b = open_backend(redis_server.url, namespace=KeyNamespace("m"), socket_timeout=2.0, connect_timeout=0.5)
    b.batch_set([KEYS[0]], [b"v0"])
    redis_server.kill()
    with pytest.raises(StorageUnavailable):  # refused at once: a wait would end in StorageTimeout
        b.batch_get([KEYS[0]])
    with pytest.raises(StorageUnavailable):
        b.batch_set([KEYS[1]], [b"v1"])
    redis_server.restart()  # no persistence: the old page is gone, the backend reconnects
    assert b.batch_exists([KEYS[0]]) == 0
    assert b.batch_set([KEYS[1]], [b"v1"]) == [True]
    assert b.batch_get([KEYS[1]]) == [b"v1"]
    assert b.stats()["errors"] == 2
    b.close()


def test_redis_timeout_then_recovers(redis_server):  # noqa: F811
    b = open_backend(redis_server.url, namespace=KeyNamespace("m"), socket_timeout=0.2, max_connections=1)
    b.batch_set(KEYS[:2], [b"a", b"b"])
    redis_server.pause()
    try:
        with pytest.raises(StorageTimeout):
            b.batch_get([KEYS[0]])
    finally:
        redis_server.resume()
    assert b.batch_get([KEYS[1], KEYS[0]]) == [b"b", b"a"]  # no reply read out of turn
    b.close()


def test_redis_unreachable_at_open(redis_server):  # noqa: F811
    url = redis_server.url
    redis_server.kill()
    with pytest.raises(StorageUnavailable):
        open_backend(url, namespace=KeyNamespace("m"), connect_timeout=0.5)


def test_redis_values_raw_and_clear_is_scoped(redis_server):  # noqa: F811
    import redis

    b = open_backend(redis_server.url, namespace=KeyNamespace("m", tenant="t"), ttl=60)
    b.batch_set([KEYS[0]], [b"payload"])
    raw = redis.Redis.from_url(redis_server.url)
    skey = b.namespace.storage_key(KEYS[0])
    stored = raw.get(skey)
    assert stored.startswith(b"HCKV") and stored.endswith(b"payload")
    assert 0 < raw.ttl(skey) <= 60
    raw.set("unrelated", b"keep")
    raw.set("m/t2/0of1/x", b"keep")
    b.clear()
    assert raw.get(skey) is None and raw.get("unrelated") == b"keep" and raw.get("m/t2/0of1/x") == b"keep"
    raw.close()
    b.close()


def test_bench_storage_smoke(tmp_path, capsys):
    from hicache_fsm.cli import main

    assert main(["bench", "storage", "--url", f"file://{tmp_path}/s", "--pages", "3", "--layers", "1",
                 "--kv-heads", "1", "--head-dim", "64", "--repeats", "1", "--json"]) == 0
    out = capsys.readouterr().out
    import json

    result = json.loads(out)
    for field in ("set_gbps", "get_gbps", "raw_set_gbps", "raw_get_gbps", "set_ratio", "get_ratio"):
        assert result[field] > 0


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_zero_copy_with_the_real_host_pool(make_backend, layout):
    pools = pytest.importorskip("hicache_fsm.pools")
    shape = pools.KVShape(layers=3, heads=2, head_dim=8, dtype=torch.bfloat16)
    src = pools.HostKVPool(shape, size_tokens=32, page_size=4, layout=layout, pin_memory=False)
    src.kv.copy_(torch.randn(src.kv.shape, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16))
    dst = pools.HostKVPool(shape, size_tokens=32, page_size=4, layout=layout, pin_memory=False)
    b = make_backend()
    assert b.batch_set_from(KEYS[:3], src, [5, 0, 7]) == [True] * 3
    assert b.batch_get_into(KEYS[:3], dst, [1, 2, 3]) == [True] * 3
    for s, d in [(5, 1), (0, 2), (7, 3)]:
        assert torch.equal(dst.read_page(d), src.read_page(s))
    assert b.batch_get([KEYS[0]]) == [None]  # the bytes API reads untyped pages only ...
    fmt = PageFormat.of(layout, shape, 4)  # ... unless told the format
    assert b.batch_get([KEYS[0]], page_format=fmt) == [src.read_page(5).numpy().tobytes()]
