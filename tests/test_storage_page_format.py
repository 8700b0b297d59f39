"""A stored page is read only by a reader in the same page format: never wrong bytes.

Each backend (file, memory, redis, mooncake) is written by a host pool in one
layout / dtype / KV shape / page size and read by pools in every other one. A
reader whose format differs gets a miss, ``format_mismatch`` counts it, and one
warning is logged per foreign format; a reader whose bytes agree (layer_first
and page_first_direct share the layer-major page order) gets the exact bytes.
"""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
from mooncake_fixture import start_master
from storage_util import kv, load_and_read, make_cache, prompt, put, ready, settle, wait_until

from hicache_fsm.pools import LAYOUTS, HostKVPool, KVShape
from hicache_fsm.storage import KeyNamespace, open_backend, page_keys
from hicache_fsm.storage.blob import FORMAT_VERSION
from hicache_fsm.storage.page_format import PageFormat, page_format_of

SHAPE = KVShape(layers=3, heads=2, head_dim=8, dtype=torch.bfloat16)
PAGE = 4
NS = KeyNamespace("fmt")


@pytest.fixture(scope="module")
def mooncake_url(tmp_path_factory):
    master = start_master(tmp_path_factory.mktemp("mooncake-fmt"))
    yield master.url
    master.stop()


@pytest.fixture(params=["file", "memory", "redis", "mooncake"])
def opener(request, tmp_path):
    """Opens a fresh backend instance on one shared store (so each reader warns afresh)."""
    if request.param == "file":
        url = f"file://{tmp_path}/l3"
    elif request.param == "memory":
        url = f"memory://fmt-{abs(hash(request.node.nodeid))}"
    elif request.param == "redis":
        url = request.getfixturevalue("redis_server").url
    else:
        url = request.getfixturevalue("mooncake_url")
    opened = []

    def open_one():
        b = open_backend(url, namespace=NS)
        opened.append(b)
        return b

    yield open_one
    for b in opened:
        b.close()


def filled(layout: str, shape: KVShape = SHAPE, page_size: int = PAGE, seed: int = 0) -> HostKVPool:
    pool = HostKVPool(shape, 8 * page_size, page_size, layout, pin_memory=False)
    gen = torch.Generator().manual_seed(seed)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen).to(shape.dtype))
    return pool


def same_order(a: str, b: str) -> bool:
    major = {"layer_first": "layer", "page_first_direct": "layer", "page_first": "token"}
    return major[a] == major[b]


def mismatch_warnings(caplog) -> int:
    return sum(1 for r in caplog.records if "expects" in r.getMessage() and r.levelno == logging.WARNING)


def test_every_pair_of_layouts(opener, caplog):
    caplog.set_level(logging.WARNING, logger="hicache_fsm.storage")
    writer = opener()
    for i, (w, r) in enumerate(itertools.product(LAYOUTS, LAYOUTS)):
        src = filled(w, seed=i)
        keys = page_keys(prompt(3 * PAGE, seed=100 + i), PAGE)
        assert writer.batch_set_from(keys, src, [0, 1, 2]) == [True] * 3
        reader = opener()
        dst = filled(r, seed=999)
        got = reader.batch_get_into(keys, dst, [3, 4, 5])
        if same_order(w, r):
            assert got == [True] * 3, (w, r)
            for s, d in zip([0, 1, 2], [3, 4, 5]):
                assert torch.equal(dst.read_page(d), src.read_page(s)), (w, r)
            k, v = dst.read(torch.arange(3 * PAGE, 6 * PAGE))
            rk, rv = src.read(torch.arange(0, 3 * PAGE))
            assert torch.equal(k, rk) and torch.equal(v, rv), (w, r)  # the same KV, token by token
        else:
            assert got == [False] * 3, (w, r)
            assert reader.stats()["format_mismatch"] == 3 and reader.stats()["corrupt"] == 0
            assert reader.stats()["hits"] == 0
    # one warning per reader that met a foreign format, not one per page
    assert mismatch_warnings(caplog) == sum(1 for w, r in itertools.product(LAYOUTS, LAYOUTS) if not same_order(w, r))


@pytest.mark.parametrize("other", ["dtype", "shape", "page_size"], ids=str)
def test_dtype_shape_and_page_size_differences(opener, other, caplog):
    """Each reader's pages have exactly the writer's byte size, so only the recorded format tells them apart."""
    caplog.set_level(logging.WARNING, logger="hicache_fsm.storage")
    if other == "dtype":
        shape, page_size = KVShape(layers=3, heads=2, head_dim=8, dtype=torch.float16), PAGE
    elif other == "shape":
        shape, page_size = KVShape(layers=3, heads=4, head_dim=4, dtype=torch.bfloat16), PAGE
    else:
        shape, page_size = KVShape(layers=6, heads=2, head_dim=8, dtype=torch.bfloat16), PAGE // 2
    writer, reader = opener(), opener()
    src = filled("layer_first")
    dst = filled("layer_first", shape, page_size, seed=5)
    assert dst.page_nbytes == src.page_nbytes  # same size: only the format differs
    keys = page_keys(prompt(2 * PAGE, seed=7), PAGE)
    assert writer.batch_set_from(keys, src, [0, 1]) == [True, True]
    before = dst.kv.clone()
    assert reader.batch_get_into(keys, dst, [0, 1]) == [False, False]
    assert reader.stats()["format_mismatch"] == 2
    assert mismatch_warnings(caplog) == 1
    if reader.scheme in ("memory", "redis"):  # zero-copy readers land bytes before checking (a miss: unspecified)
        assert torch.equal(dst.kv, before)
    assert reader.batch_get(keys, page_format=page_format_of(src)) != [None, None]  # the writer's format reads


def test_bytes_api_and_the_recorded_format(tmp_path):
    b = open_backend(f"file://{tmp_path}", namespace=NS)
    fmt = PageFormat.of("page_first", SHAPE, PAGE)
    assert fmt.text() == "kv1 token_major L3 H2 D8 bfloat16 P4"
    assert PageFormat.of("layer_first", SHAPE, PAGE) == PageFormat.of("page_first_direct", SHAPE, PAGE)
    keys = page_keys(prompt(PAGE, seed=3), PAGE)
    assert b.batch_set(keys, [b"x" * 16], page_format=fmt) == [True]
    assert b.batch_get(keys) == [None]  # untyped reader
    assert b.batch_get(keys, page_format=fmt) == [b"x" * 16]
    with open(b.path_for(keys[0]), "rb") as f:
        head = f.read(64)
    assert head[4] == FORMAT_VERSION and b"kv1 token_major" in head
    b.close()


@pytest.mark.parametrize(("writer_layout", "reader_layout"),
                         [("page_first", "layer_first"), ("layer_first", "page_first_direct")])
def test_two_caches_with_different_layouts_share_a_directory(tmp_path, writer_layout, reader_layout):
    """The issue's case: a page_first writer and a layer_first reader under one model name."""
    opts = {"prefetch_threshold": 8, "stop_policy": "wait_complete", "retry_interval": 0.01, "probe_interval": 0.02}
    url = f"file://{tmp_path}/shared"
    t = prompt(128, seed=21)
    writer = make_cache(layout=writer_layout)
    reader = make_cache(layout=reader_layout)
    try:
        writer.attach_storage(url, **opts)
        put(writer, t)
        wait_until(writer, lambda: writer.stats()["storage"]["backup_tokens_stored"] == 128, what="backup")
        reader.attach_storage(url, **opts)
        assert reader.prefetch("r", t, reader.match_prefix(t))
        ready(reader, "r")
        inserted = reader.stats()["storage"]["prefetch_inserted_tokens"]
        if same_order(writer_layout, reader_layout):
            assert inserted == 128
        else:
            assert inserted == 0
            assert reader.stats()["storage"]["backend_stats"]["format_mismatch"] >= 1
        k, v, n = load_and_read(reader, t)  # whatever arrived, loaded to the device: exactly the model's KV
        rk, rv = kv(t)
        assert n == inserted and torch.equal(k, rk[:, :n]) and torch.equal(v, rv[:, :n])
        settle(reader)
        reader.check_invariants()
    finally:
        writer.close()
        reader.close()
