"""``match_prefix`` with ids in an integer array or tensor: checked and packed only as far as needed.

A miss is known from the first page (no cached prefix begins with it), so
only that page is checked and packed; otherwise the whole request is, in
vectorised passes. Whatever the form, the answer, the tree and the counters
are those a tuple of the same ids gives (which ids are read, and so refused
when bad: ``test_match_miss_first_page``).
"""

from __future__ import annotations

from array import array

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_helpers import log_id_reads, make_cache
from hicache_fsm.errors import BadIndices

PAGE = 4
FORMS = {
    "array_q": lambda ids: array("q", ids),
    "array_i": lambda ids: array("i", ids),
    "numpy_int64": lambda ids: np.array(ids, dtype=np.int64),
    "tensor_int32": lambda ids: torch.tensor(ids, dtype=torch.int32),
}

# requests share first pages often enough to hit, split and miss
_page = st.sampled_from([(1, 2, 3, 4), (1, 2, 3, 5), (5, 6, 7, 8), (9, 9, 9, 9)])
_request = st.lists(_page, min_size=0, max_size=4).map(lambda pages: [t for p in pages for t in p])
_tail = st.lists(st.integers(1, 20), max_size=PAGE - 1)  # a part page, never matched


def _picture(cache) -> dict:
    """``snapshot`` less job ids (they are numbered across every cache of the process)."""
    snap = cache.snapshot()
    snap["nodes"] = [node[:-1] + (len(node[-1]),) for node in snap["nodes"]]
    snap["pending"], snap["outbox"] = len(snap["pending"]), len(snap["outbox"])
    return snap


def _answer(result) -> tuple:
    return (result.device_indices.tolist(), result.last_device_node.id, result.last_host_node.id,
            result.host_hit_length)


@settings(max_examples=60, deadline=None)
@given(cached=st.lists(_request, max_size=4), asked=st.lists(st.tuples(_request, _tail), min_size=1, max_size=6),
       form=st.sampled_from(sorted(FORMS)))
def test_an_id_array_matches_as_the_tuple_of_its_ids(cached, asked, form):
    caches = [make_cache(page=PAGE)[0] for _ in range(2)]
    for cache in caches:
        for ids in cached:
            if ids:
                match = cache.match_prefix(tuple(ids))
                rest = cache.alloc_device(len(ids) - match.device_hit_length)
                if rest is not None:
                    cache.insert(tuple(ids), torch.cat([match.device_indices, rest]))
    as_array, as_tuple = caches
    for ids, tail in asked:
        request = ids + tail
        assert _answer(as_array.match_prefix(FORMS[form](request))) == _answer(as_tuple.match_prefix(tuple(request)))
    assert _picture(as_array) == _picture(as_tuple)  # hit counts, recency, splits, counters, clock
    as_array.check_invariants()


@pytest.mark.parametrize("form", ["array_q", "numpy_int64", "tensor_int32"])
def test_a_miss_packs_the_first_page_only_and_a_hit_packs_the_rest(monkeypatch, form):
    """An ``array.array``'s first page is packed by ``array_head_bytes``, another array's from its raw bytes; a hit then
    packs it all."""
    packed: list[int] = []
    log_id_reads(monkeypatch, packed, ("pack_id_array", "checked_id_bytes", "array_head_bytes", "id_array_head_bytes"))
    build = FORMS[form]
    cache, _ = make_cache(page=PAGE)
    cache.insert((1, 2, 3, 4), cache.alloc_device(PAGE))
    miss = cache.match_prefix(build(list(range(5, 5 + 4 * PAGE))))
    assert packed == [PAGE] and miss.device_hit_length == 0
    hit = cache.match_prefix(build([1, 2, 3, 4] + list(range(20, 20 + 3 * PAGE))))
    assert packed == [PAGE, PAGE, 4 * PAGE] and hit.device_hit_length == PAGE
    assert cache.counters["miss_tokens"] == 4 * PAGE + 3 * PAGE


def test_an_unhashable_namespace_with_an_id_array_is_refused_on_a_miss_too():
    cache, _ = make_cache(page=PAGE)
    before = cache.snapshot()
    with pytest.raises(BadIndices):
        cache.match_prefix(array("q", range(1, 9)), namespace=["not", "hashable"])
    assert cache.snapshot() == before
