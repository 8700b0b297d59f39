"""An engine keeps one ``TokenIds`` per request: grown by ``extended``, taken as it is by every cache call.

Growing a ``TokenIds`` step by step gives the bytes packing the whole list at
once gives; a bad id in an extension is named by its position in the whole
request and leaves the request's ids as they were; integer arrays and
tensors of every dtype pack and refuse exactly as the same ids in a list; and
``match_prefix``, ``insert`` and ``prefetch`` answer alike for a ``TokenIds``
and for the list it packs, without turning it back into Python ints.
"""

from __future__ import annotations

import functools
from array import array

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hicache_fsm
import storage_util
from cache_helpers import drain, make_cache
from hicache_fsm import radix, tokens
from hicache_fsm.errors import BadTokenIds, TokenIdTypeError
from hicache_fsm.tokens import TOKEN_ID_LIMIT, TokenIds, pack_token_ids

ids_st = st.lists(st.integers(0, TOKEN_ID_LIMIT - 1), max_size=24)

# how an engine may hold a chunk of ids: the int32 forms only when every id fits
FORMS = {
    "list": list,
    "tuple": tuple,
    "packed": pack_token_ids,
    "numpy int64": lambda v: np.array(v, dtype=np.int64),
    "numpy uint32": lambda v: np.array(v, dtype=np.uint32),
    "torch int64": lambda v: torch.tensor(v, dtype=torch.int64),
    "numpy int32": lambda v: np.array(v, dtype=np.int32),
    "torch int32": lambda v: torch.tensor(v, dtype=torch.int32),
    "array q": lambda v: array("q", v),  # as SGLang's scheduler holds a request's ids
}


def _form(name: str, values: list[int]):
    if "int32" in name and any(v >= 2**31 for v in values):
        name = "list"
    return FORMS[name](values)


def _first_bad(values: list) -> int | None:
    return next((i for i, v in enumerate(values) if not 0 <= v < TOKEN_ID_LIMIT), None)


def test_the_package_exports_the_engine_form():
    assert hicache_fsm.TokenIds is TokenIds and hicache_fsm.pack_token_ids is pack_token_ids
    assert {"TokenIds", "pack_token_ids"} <= set(dir(hicache_fsm))
    with pytest.raises(AttributeError):
        hicache_fsm.no_such_name  # noqa: B018


@settings(max_examples=80, deadline=None)
@given(chunks=st.lists(ids_st, max_size=6), forms=st.lists(st.sampled_from(sorted(FORMS)), min_size=6, max_size=6))
def test_growing_step_by_step_equals_packing_at_once(chunks, forms):
    whole = [v for chunk in chunks for v in chunk]
    want = pack_token_ids(whole)
    ids = pack_token_ids([])
    for chunk, form in zip(chunks, forms):
        ids = ids.extended(_form(form, chunk))
    assert ids == want and ids.raw == want.raw and ids.tolist() == whole and len(ids) == len(whole)
    added = functools.reduce(lambda acc, part: acc + _form(forms[0], part), chunks, pack_token_ids([]))
    assert added == want
    assert hash(ids) == hash(want)


BAD_IDS = [(-1, BadTokenIds), (TOKEN_ID_LIMIT, BadTokenIds), (2**40, BadTokenIds), (0.5, TokenIdTypeError),
           (None, TokenIdTypeError), (True, TokenIdTypeError), ("7", TokenIdTypeError)]


@settings(max_examples=80, deadline=None)
@given(good=ids_st, new=ids_st, at=st.integers(0, 24), bad=st.sampled_from(BAD_IDS),
       form=st.sampled_from(["list", "tuple", "numpy int64", "torch int64", "array q"]))
def test_a_bad_new_id_is_named_by_its_place_in_the_request_and_changes_nothing(good, new, at, bad, form):
    value, error = bad
    if form.startswith(("numpy", "torch", "array")) and error is TokenIdTypeError:
        form = "list"  # an integer array cannot hold a float, None or str: it is the list that does
    pos = min(at, len(new))
    new = new[:pos] + [value] + new[pos:]
    ids = pack_token_ids(good)
    raw = ids.raw
    extension = FORMS[form](new)
    for grow in (ids.extended, ids.__add__):
        with pytest.raises(error) as info:
            grow(extension)
        assert info.value.position == len(good) + pos
        assert f"position {len(good) + pos}" in str(info.value)
    assert ids.raw == raw and ids.tolist() == good


@settings(max_examples=60, deadline=None)
@given(values=ids_st, data=st.data())
def test_indexing_and_slicing_read_like_the_list(values, data):
    ids = pack_token_ids(values)
    n = len(values)
    start = data.draw(st.integers(-n - 2, n + 2))
    stop = data.draw(st.integers(-n - 2, n + 2))
    step = data.draw(st.sampled_from([None, 1, 2, -1, 3]))
    part = ids[start:stop:step]
    assert type(part) is TokenIds and part == pack_token_ids(values[start:stop:step])
    for i in range(-n, n):
        assert ids[i] == values[i] and type(ids[i]) is int
    for i in (n, -n - 1):
        with pytest.raises(IndexError):
            ids[i]
    assert list(ids) == values and bytes(ids) == ids.raw


INTEGER_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]


@st.composite
def _integer_arrays(draw):
    dtype = draw(st.sampled_from(INTEGER_DTYPES))
    info = np.iinfo(dtype)
    edge = [v for v in (info.min, info.max, -1, 0, 1, TOKEN_ID_LIMIT - 1, TOKEN_ID_LIMIT, 2**31)
            if info.min <= v <= info.max]
    values = draw(st.lists(st.one_of(st.sampled_from(edge), st.integers(int(info.min), int(info.max))), max_size=16))
    return dtype, values


@settings(max_examples=150, deadline=None)
@given(case=_integer_arrays(), layout=st.sampled_from(["contiguous", "strided", "byteswapped", "torch",
                                                       "torch strided"]),
       offset=st.integers(0, 5))
def test_integer_arrays_of_every_dtype_pack_and_refuse_as_the_list(case, layout, offset):
    dtype, values = case
    arr = np.array(values, dtype=dtype)
    if layout in ("strided", "torch strided"):  # the ids at even places of an array twice as long
        wide = np.zeros(2 * len(values), dtype=dtype)
        wide[::2] = arr
        arr = wide[::2]
    if layout == "byteswapped":
        arr = arr.astype(arr.dtype.newbyteorder())
    held = torch.from_numpy(arr) if layout.startswith("torch") else arr
    assert layout.startswith("torch") == (type(held) is torch.Tensor)
    head = pack_token_ids(list(range(offset)))
    bad = _first_bad(values)
    if bad is None:
        assert pack_token_ids(held) == pack_token_ids(values)
        assert head.extended(held) == pack_token_ids(list(range(offset)) + values)
    else:
        for pack, base in ((pack_token_ids, 0), (head.extended, offset)):
            with pytest.raises(BadTokenIds) as info:
                pack(held)
            assert not isinstance(info.value, TokenIdTypeError)
            assert info.value.position == base + bad and info.value.value == values[bad]


@pytest.mark.parametrize("tensor", [torch.tensor([1.0, 2.0]), torch.tensor([True, False]),
                                    torch.tensor([1 + 1j]), np.array([True]), np.array([1.5])],
                         ids=["float tensor", "bool tensor", "complex tensor", "bool array", "float array"])
def test_arrays_of_other_dtypes_are_type_errors_naming_position_zero(tensor):
    with pytest.raises(TokenIdTypeError) as info:
        pack_token_ids([7, 8]).extended(tensor)
    assert info.value.position == 2


# ------------------------------------------------------------------ through the cache

PAGE = 4
chunk_st = st.lists(st.integers(0, 3), min_size=0, max_size=3 * PAGE + 2)


def _engine_step(cache, ex, ids, use_packed: bool) -> tuple:
    """One request as an engine serves it: match, lock, allocate, insert its whole pages, unlock."""
    held = ids if use_packed else ids.tolist()
    m = cache.match_prefix(held)
    cache.lock(m.last_device_node)
    aligned = len(ids) - len(ids) % PAGE
    new = cache.alloc_device(aligned - m.device_hit_length)
    got = (m.device_hit_length, m.host_hit_length, m.last_device_node.id, m.last_host_node.id)
    if new is not None:
        r = cache.insert(held[:aligned], torch.cat([m.device_indices, new]))
        got += (r.node.id, r.cached_tokens, r.new_tokens)
    cache.unlock(m.last_device_node)
    drain(cache, ex)
    return got


def _picture(cache) -> dict:
    """``snapshot`` less the job ids (numbered process-wide, so two caches never share them); jobs are drained."""
    snap = cache.snapshot()
    ledger = dict(snap.pop("ledger"))
    ledger["recent"] = sorted(ledger["recent"].values())
    return snap | {"ledger": ledger}


@settings(max_examples=40, deadline=None)
@given(requests=st.lists(st.lists(chunk_st, min_size=1, max_size=3), max_size=5), evict_pages=st.integers(0, 4))
def test_match_and_insert_answer_alike_for_a_packed_request_and_its_list(requests, evict_pages):
    """Each request arrives, then grows (its output ids appended) and is served again."""
    caches = {form: make_cache(page=PAGE, device_pages=12, host_pages=24) for form in (True, False)}
    answers = {form: [] for form in caches}
    for parts in requests:
        for use_packed, (cache, ex) in caches.items():
            ids = pack_token_ids(parts[0])
            for part in parts[1:] + [[]]:
                answers[use_packed].append(_engine_step(cache, ex, ids, use_packed))
                ids = ids.extended(part)
            cache.evict(evict_pages * PAGE)
            drain(cache, ex)
    assert answers[True] == answers[False]
    assert _picture(caches[True][0]) == _picture(caches[False][0])
    for cache, _ in caches.values():
        cache.check_invariants()


def _prefetched(ids, use_packed: bool) -> tuple:
    """Store ``ids``, drop them from memory, prefetch them back; what the engine then sees."""
    cache = storage_util.make_cache()
    try:
        cache.attach_storage("memory://", prefetch_threshold=4, stop_policy="wait_complete")
        storage_util.put(cache, tuple(ids))
        storage_util.wait_until(cache, lambda: all(n.state.endswith("stored") for n in
                                                   storage_util.path_nodes(cache, tuple(ids))[0]), what="backup")
        storage_util.evict_all(cache, tuple(ids))
        held = ids if use_packed else ids.tolist()
        m = cache.match_prefix(held)
        admitted = cache.prefetch("r", held, m)
        storage_util.ready(cache, "r")
        after = cache.match_prefix(held)
        counters = {k: v for k, v in cache.stats()["storage"].items() if k.startswith("prefetch_")}
        cache.check_invariants()
        return admitted, m.host_hit_length, after.host_hit_length, after.device_hit_length, counters
    finally:
        cache.close()


def test_prefetch_answers_alike_for_a_packed_request_and_its_list():
    ids = pack_token_ids(storage_util.prompt(32, seed=5))
    packed, listed = _prefetched(ids, True), _prefetched(ids, False)
    assert packed == listed
    assert packed[0] and packed[2] == 32


def test_no_cache_call_turns_a_packed_request_back_into_ints(monkeypatch):
    """match, insert, prefetch, backups to host and storage: the packed bytes are compared and hashed as they are."""

    def refuse(*_args, **_kwargs):
        raise AssertionError("a TokenIds was unpacked into Python ints on the serving path")

    cache = storage_util.make_cache()
    try:
        cache.attach_storage("memory://", prefetch_threshold=4, stop_policy="wait_complete")
        first = pack_token_ids(storage_util.prompt(32, seed=6))
        k, v = storage_util.kv(first.tolist())
        longer = first.extended(storage_util.prompt(16, seed=7))
        monkeypatch.setattr(TokenIds, "__iter__", refuse)
        monkeypatch.setattr(TokenIds, "tolist", refuse)
        monkeypatch.setattr(tokens, "unpack_token_ids", refuse)
        monkeypatch.setattr(radix, "unpack_token_ids", refuse)
        m = cache.match_prefix(first)
        idx = cache.alloc_device(len(first))
        cache.device_pool.write(idx, None, k, v)
        node = cache.insert(first, idx).node
        storage_util.wait_until(cache, lambda: node.state.endswith("stored"), what="backup")
        cache.evict_node(node)
        cache.evict_host(cache.host_pool.size_tokens)
        m = cache.match_prefix(longer)
        assert m.device_hit_length == m.host_hit_length == 0
        assert cache.prefetch("r", longer, m)
        storage_util.ready(cache, "r")
        assert cache.match_prefix(longer).host_hit_length == len(first)
    finally:
        monkeypatch.undo()
        cache.close()


def test_a_tensor_whose_values_cannot_be_read_is_one_typed_error():
    with pytest.raises(TokenIdTypeError, match="could not be read"):
        pack_token_ids(torch.zeros(3, dtype=torch.int64, device="meta"))
