"""``bench scale --peer``: SGLang's own RadixCache does the same work as ours, and its absence is said in one line.

The peer tests need ``sglang`` importable (they are skipped otherwise); the
ones about a missing SGLang hide it with ``sys.modules['sglang'] = None``.
"""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_fsm import cli
from hicache_fsm.bench import scale, sglang_peer
from hicache_fsm.executors import AckExecutor
from hicache_fsm.cache import HiCache
from hicache_fsm.config import CacheConfig
from hicache_fsm.pools import DeviceKVPool, HostKVPool, KVShape

PAGE = scale.PAGE
SHAPE = KVShape(layers=1, heads=1, head_dim=1, dtype=torch.int8)


@pytest.fixture
def no_sglang(monkeypatch):
    """An interpreter where ``import sglang`` fails."""
    monkeypatch.setitem(sys.modules, "sglang", None)


def test_peer_sglang_without_sglang_exits_2_with_one_line(no_sglang, capsys):
    assert cli.main(["bench", "scale", "--peer", "sglang", "--sizes", "64", "--quick"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hicache-fsm bench scale: error: --peer sglang:")
    assert "SGLang" in lines[0]


def test_auto_peer_without_sglang_says_so_in_one_line_and_goes_on(no_sglang, capsys):
    assert scale.resolve_peer("auto") is None
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench scale: no SGLang peer:")


def test_no_peer_asked_means_no_import_and_no_message(no_sglang, capsys):
    assert scale.resolve_peer("none") is None
    assert capsys.readouterr().err == ""


@pytest.fixture(scope="module")
def sgl() -> sglang_peer.SGLangRadix:
    pytest.importorskip("sglang")
    try:
        return sglang_peer.load()
    except sglang_peer.PeerUnavailable as exc:
        pytest.skip(str(exc))


def _ours(tokens: int) -> HiCache:
    """Our cache as ``bench scale`` configures it (write-through to the host, priority eviction)."""
    device = DeviceKVPool(SHAPE, tokens, PAGE, "cpu")
    host = HostKVPool(SHAPE, tokens, PAGE, pin_memory=False)
    config = CacheConfig(write_policy="write_through", eviction_policy="priority")
    return HiCache(device, host, config, AckExecutor())


def _put_ours(cache: HiCache, tokens: tuple, priority: int = 0) -> int:
    m = cache.match_prefix(tokens)
    new = cache.alloc_device(len(tokens) - m.device_hit_length)
    cached = cache.insert(tokens, torch.cat([m.device_indices, new]), priority=priority).cached_tokens
    cache.poll()
    cache.poll()
    return cached


def _put_peer(peer: sglang_peer.SGLangRadixPeer, tokens: tuple) -> int:
    key = peer.engine_form(tokens)
    indices, _ = peer.match_prefix(key)
    fresh = torch.arange(len(tokens) - indices.numel(), dtype=torch.int64)
    return peer.insert(key, torch.cat([indices, fresh]))


def _page(symbol: int) -> tuple:
    return tuple(symbol * PAGE + j + 1 for j in range(PAGE))


pages = st.lists(st.integers(0, 2), min_size=1, max_size=5)


@settings(max_examples=25, deadline=None)
@given(inserted=st.lists(pages, min_size=1, max_size=6), probes=st.lists(pages, max_size=6),
       tail=st.integers(0, PAGE - 1), form=st.sampled_from(sorted(sglang_peer.PEER_FORMS)))
def test_peer_matches_and_inserts_what_ours_does(sgl, inserted, probes, tail, form):
    """In either form the peer can be handed (an array or a list), it caches what ours caches."""
    ours, peer = _ours(64 * PAGE), sglang_peer.SGLangRadixPeer(sgl, PAGE, form)
    for seq in inserted:
        tokens = sum((_page(s) for s in seq), ())
        assert _put_peer(peer, tokens) == _put_ours(ours, tokens)
    for seq in probes + inserted:
        tokens = sum((_page(s) for s in seq), ()) + tuple(range(1, tail + 1))  # a partial last page never matches
        want = ours.match_prefix(tokens).device_hit_length
        key = peer.engine_form(tokens)
        assert peer.match_length(key) == want
        assert peer.match_prefix(key)[0].numel() == want


def test_peer_evicts_the_pages_ours_evicts_in_the_benchmark_scenario(sgl):
    """``bench scale``'s evict: one-page prefixes fill the device, 64 pages go, the oldest in both caches."""
    nodes = 96
    ours, peer = _ours(nodes * PAGE), sglang_peer.SGLangRadixPeer(sgl, PAGE)
    prefixes = [(scale.VOCAB + i,) + tuple(range(1, PAGE)) for i in range(nodes)]
    for t in prefixes:
        _put_ours(ours, t, priority=1)
        _put_peer(peer, t)
    assert ours.device_allocator.available_tokens == 0
    assert peer.evict(64 * PAGE) == ours.evict(64 * PAGE) == 64 * PAGE
    assert peer.allocator.freed == 64 * PAGE
    gone_ours = [t for t in prefixes if ours.match_prefix(t).device_hit_length == 0]
    gone_peer = [t for t in prefixes if peer.match_length(peer.engine_form(t)) == 0]
    assert gone_peer == gone_ours == prefixes[:64]


def test_peer_keeps_a_locked_request_as_ours_does(sgl):
    request = sum((_page(s) for s in (0, 1, 2, 0)), ())
    other = sum((_page(s) for s in (1, 1)), ())
    ours, peer = _ours(16 * PAGE), sglang_peer.SGLangRadixPeer(sgl, PAGE)
    for t in (request, other):
        _put_ours(ours, t)
        _put_peer(peer, t)
    ours_node = ours.match_prefix(request).last_device_node
    _, peer_node = peer.match_prefix(peer.engine_form(request))
    ours.lock(ours_node)
    peer.inc_lock_ref(peer_node)
    assert peer.evict(16 * PAGE) == ours.evict(16 * PAGE) == len(other)
    assert peer.match_length(peer.engine_form(request)) == ours.match_prefix(request).device_hit_length == len(request)
    ours.unlock(ours_node)
    peer.dec_lock_ref(peer_node)
    assert peer.evict(16 * PAGE) == ours.evict(16 * PAGE) == len(request)


def test_bench_all_keeps_the_hand_written_tail_of_the_page(tmp_path):
    """The SGLang figures are measured by hand (SGLang is not a dependency): rewriting the page keeps them."""
    from hicache_fsm.bench import all as bench_all

    page = tmp_path / "performance.md"
    assert bench_all.kept_tail(page) == ""
    page.write_text("# generated\n\n" + bench_all.KEPT + "\n\n## By hand\n", encoding="utf-8")
    assert bench_all.kept_tail(page) == "\n" + bench_all.KEPT + "\n\n## By hand\n"
    page.write_text("# generated, no hand-written part\n", encoding="utf-8")
    assert bench_all.kept_tail(page) == ""


@pytest.mark.parametrize("ids", ["array", "list"])
def test_the_peer_is_timed_on_the_form_the_result_names(sgl, ids):
    """With ours on Python ids the peer gets a list, with an array an array; ``ids`` says which."""
    out = scale.measure(100, chunks=1, calls=2, headroom_pages=0, seed=0, warmup_cycles=2, peer=sgl, ids=ids)
    assert out["ids"][sglang_peer.NAME] == sglang_peer.PEER_FORMS[ids][1]
    assert out["vs_sglang_peer_match"] > 0
