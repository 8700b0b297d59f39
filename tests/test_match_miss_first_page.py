"""``match_prefix`` decides a miss on the request's first page and reads nothing after it.

Every id the walk reads is checked: a bad id in the first page, or anywhere
in a request whose first page begins a cached prefix, is refused with the
usual typed error and nothing changed. A request whose first page begins no
cached prefix is a miss, whatever follows that page; ``insert`` of it still
checks every id. The same for every form an engine may hold ids in.
"""

from __future__ import annotations

from array import array

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_helpers import drain, log_id_reads, make_cache, put
from hicache_fsm.errors import BadTokenIds

PAGE = 4
OUT_OF_RANGE = [-1, 2**32, 2**40]
NOT_INTS = [0.5, None, "a", True]
FORMS = {  # form -> (builder, the bad values it can hold)
    "tuple": (tuple, OUT_OF_RANGE + NOT_INTS),
    "list": (list, OUT_OF_RANGE + NOT_INTS),
    "array_q": (lambda ids: array("q", ids), OUT_OF_RANGE),
    "numpy_int64": (lambda ids: np.array(ids, dtype=np.int64), OUT_OF_RANGE),
    "tensor_int64": (lambda ids: torch.tensor(ids, dtype=torch.int64), OUT_OF_RANGE),
    "tensor_int32": (lambda ids: torch.tensor(ids, dtype=torch.int32), [-1, -(2**31)]),
    "numpy_uint64": (lambda ids: np.array(ids, dtype=np.uint64), [2**32, 2**63]),
}


def _cached(prefixes):
    cache, ex = make_cache(page=PAGE, device_pages=32, host_pages=64)
    for prefix in prefixes:
        put(cache, prefix)
    drain(cache, ex)
    return cache


def _answer(match):
    return match.device_hit_length, match.host_hit_length, match.device_indices.tolist()


@settings(max_examples=150, deadline=None)
@given(
    prefixes=st.lists(st.lists(st.integers(1, 3), min_size=PAGE, max_size=3 * PAGE).map(
        lambda ids: ids[: len(ids) - len(ids) % PAGE]), max_size=4),
    request=st.lists(st.integers(1, 3), min_size=1, max_size=4 * PAGE),
    bad_at=st.integers(0, 4 * PAGE - 1),
    form=st.sampled_from(sorted(FORMS)),
    data=st.data(),
)
def test_a_bad_id_is_refused_exactly_when_the_walk_reads_it(prefixes, request, bad_at, form, data):
    build, bad_values = FORMS[form]
    cache = _cached(prefixes)
    bad_at %= len(request)
    tokens = list(request)
    tokens[bad_at] = data.draw(st.sampled_from(bad_values), label="bad")
    first_page = tuple(request[:PAGE])
    read_whole = bad_at < PAGE or (len(request) >= PAGE and any(tuple(p[:PAGE]) == first_page for p in prefixes))
    before = cache.snapshot()
    if read_whole:
        with pytest.raises(BadTokenIds) as info:
            cache.match_prefix(build(tokens))
        assert info.value.position == bad_at
        assert cache.snapshot() == before
    else:  # a miss, as for the request without the bad id
        twin = _cached(prefixes)
        want = _answer(twin.match_prefix(build(request)))
        assert _answer(cache.match_prefix(build(tokens))) == want == (0, 0, [])
        after, twin_after = cache.snapshot(), twin.snapshot()
        assert {k: after[k] for k in ("counters", "clock")} == {k: twin_after[k] for k in ("counters", "clock")}
    cache.check_invariants()
    if len(tokens) % PAGE == 0:  # insert reads every id, whatever match_prefix read
        idx = cache.alloc_device(len(tokens))
        before = cache.snapshot()
        with pytest.raises(BadTokenIds) as info:
            cache.insert(build(tokens), idx)
        assert info.value.position == bad_at
        assert cache.snapshot() == before
        cache.free_device(idx)


def test_a_miss_reads_only_the_first_page():
    """Ids after a first page that begins no cached prefix are never looked at (a miss costs one page)."""

    class Unreadable:
        def __index__(self):
            raise AssertionError("an id after a missed first page was read")

    cache = _cached([[1, 2, 3, 4, 5, 6, 7, 8]])
    for form in (tuple, list):
        miss = cache.match_prefix(form([9, 9, 9, 9] + [Unreadable()] * 8))
        assert _answer(miss) == (0, 0, [])
    with pytest.raises(BadTokenIds):  # the first page begins a cached prefix: every id is read
        cache.match_prefix([1, 2, 3, 4] + [Unreadable()] * 4)


@pytest.mark.parametrize("form", ["array_q", "numpy_int64", "tensor_int32"])
def test_a_miss_checks_one_page_of_an_array_and_a_hit_all_of_it(monkeypatch, form):
    """A miss checks the first page alone (an ``array.array``'s by ``array_head_bytes``;
    another array's on its raw bytes, ``id_array_head_bytes``); a hit checks every id once more, in one
    vectorised pass."""
    checked: list[int] = []
    log_id_reads(monkeypatch, checked, ("check_id_array", "checked_id_bytes", "array_head_bytes",
                                        "id_array_head_bytes"))
    build = FORMS[form][0]
    cache = _cached([[1, 2, 3, 4]])
    assert cache.match_prefix(build(list(range(5, 5 + 4 * PAGE)))).device_hit_length == 0
    assert checked == [PAGE]
    assert cache.match_prefix(build([1, 2, 3, 4] + list(range(20, 20 + 3 * PAGE)))).device_hit_length == PAGE
    # a hit: the first page checked and looked up (by array_head_bytes for an array.array, on its bytes for another
    # array), then every id checked once
    assert checked == [PAGE, PAGE, 4 * PAGE]


def test_insert_after_a_miss_packs_the_whole_request_once():
    """The first page packed by a miss is not remembered as the request's packing."""
    cache = _cached([])
    request = tuple(range(10, 10 + 3 * PAGE))
    assert cache.match_prefix(request).device_hit_length == 0
    result = put(cache, request)
    assert result.new_tokens == len(request)
    assert cache.match_prefix(request).device_hit_length == len(request)
