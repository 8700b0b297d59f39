"""The same-run baselines of ``bench scale`` do the work they stand for: they match what a radix tree matches."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_fsm.bench.baselines import PlainPrefixCache, RadixLikeSGLang
from hicache_fsm.radix import RadixTree

PAGE = 2
seqs = st.lists(st.lists(st.integers(0, 3), max_size=12), min_size=1, max_size=10)


def _tree_match(tree: RadixTree, tokens: list) -> int:
    _, matched, partial = tree.walk(tokens)
    return matched + partial


@settings(max_examples=80, deadline=None)
@given(inserted=seqs, probes=seqs)
def test_baselines_match_the_longest_cached_page_prefix(inserted, probes):
    plain, sgl, tree = PlainPrefixCache(PAGE), RadixLikeSGLang(PAGE), RadixTree(PAGE)
    for s in inserted:
        aligned = s[: len(s) - len(s) % PAGE]
        idx = torch.arange(len(aligned), dtype=torch.int64)
        plain.insert(aligned, idx)
        sgl.insert(list(aligned), idx)
        path, matched, partial = tree.walk(aligned)
        parent = path[-1] if path else tree.root
        if partial:
            parent = tree.split(parent.children[tree.child_key(None, aligned, matched)], partial)
            matched += partial
        if matched < len(aligned):
            tree.add_child(parent, aligned, None, matched)
    for p in probes + inserted:
        want = _tree_match(tree, p)
        assert plain.match_prefix(p)[0].numel() == want
        assert sgl.match_prefix(list(p))[0].numel() == want


def _lock(cache, node, delta: int) -> None:
    if isinstance(cache, PlainPrefixCache):
        cache.lock(node, delta)
    elif delta > 0:
        cache.inc_lock_ref(node)
    else:
        cache.dec_lock_ref(node)


def test_eviction_frees_unlocked_leaves_only():
    for cache in (PlainPrefixCache(PAGE), RadixLikeSGLang(PAGE)):
        old, new = [1, 1], [2, 2]
        cache.insert(old, torch.arange(2))
        cache.insert(new, torch.arange(2))
        _, node = cache.match_prefix(new)
        _lock(cache, node, 1)
        assert cache.evict(4) == 2  # only the unlocked leaf can go
        assert cache.match_prefix(old)[0].numel() == 0 and cache.match_prefix(new)[0].numel() == 2
        _lock(cache, node, -1)
        assert cache.evict(2) == 2 and cache.match_prefix(new)[0].numel() == 0


def test_the_plain_baseline_evicts_the_least_recently_used_first():
    cache = PlainPrefixCache(PAGE)
    for t in ([1, 1], [2, 2], [3, 3]):
        cache.insert(t, torch.arange(2))
    cache.match_prefix([1, 1])  # its logical clock: [2, 2] is now the oldest
    assert cache.evict(2) == 2
    assert [cache.match_prefix(t)[0].numel() for t in ([1, 1], [2, 2], [3, 3])] == [2, 0, 2]
