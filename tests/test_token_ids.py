"""Token ids are checked at the API boundary: a typed error naming the first bad one, nothing changed."""

from __future__ import annotations

import time
from array import array

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_helpers import drain, make_cache, pages, put
from hicache_fsm.errors import BadIndices, BadTokenIds, HiCacheError, TokenIdTypeError, UnknownJob
from hicache_fsm.jobs import Completion
from hicache_fsm.storage.memory import MemoryBackend
from hicache_fsm.tokens import (
    TOKEN_ID_LIMIT, array_head_bytes, as_token_ids, check_id_array, checked_id_array, checked_id_bytes, id_array,
    id_array_head_bytes,
    pack_id_array, pack_token_ids, token_id_bytes,
)

BAD = [
    (-1, BadTokenIds, "outside"),
    (2**40, BadTokenIds, "outside"),
    (TOKEN_ID_LIMIT, BadTokenIds, "outside"),
    (0.5, TokenIdTypeError, "must be an int"),
    (None, TokenIdTypeError, "must be an int"),
    ("a", TokenIdTypeError, "must be an int"),
    (True, TokenIdTypeError, "bool"),
    (np.float32(3.0), TokenIdTypeError, "must be an int"),
    (np.bool_(False), TokenIdTypeError, "bool"),
    (torch.tensor(True), TokenIdTypeError, "bool"),
]


@pytest.mark.parametrize("bad,error,match", BAD)
def test_first_bad_position_and_value_are_named(bad, error, match):
    tokens = [5, 6, 7, bad, -1]
    with pytest.raises(error, match=match) as info:
        as_token_ids(tokens)
    assert info.value.position == 3 and info.value.value is bad
    assert "position 3" in str(info.value)
    assert isinstance(info.value, (HiCacheError, ValueError)) and isinstance(info.value, BadIndices)


def test_type_errors_are_also_type_errors_and_range_errors_value_errors():
    with pytest.raises(TypeError):
        as_token_ids([1, "x"])
    with pytest.raises(ValueError):
        as_token_ids([1, -1])


@pytest.mark.parametrize("tokens", [[1, 2], (1, 2), np.array([1, 2]), torch.tensor([1, 2], dtype=torch.int32),
                                    [np.int64(1), torch.tensor(2)], range(1, 3)])
def test_integer_sequences_arrays_and_scalars_are_accepted(tokens):
    assert as_token_ids(tokens) == (1, 2)


def test_integer_scalars_key_storage_like_the_ints_they_equal():
    from hicache_fsm.storage.keys import page_keys

    plain = list(range(5, 13))
    scalars = [np.int64(t) for t in plain[:4]] + [torch.tensor(t) for t in plain[4:]]
    assert page_keys(as_token_ids(scalars), 4) == page_keys(plain, 4)


@pytest.mark.parametrize("tokens", ["abcd", b"ab", 7, None, torch.zeros(2, 2, dtype=torch.long),
                                    torch.zeros(4), np.array([0.5, 1.0]), array("d", [1.0]), array("f", [2.0]),
                                    {1, 2}, frozenset({3}), {1: 2}])  # unordered: the prefix would be arbitrary
def test_containers_that_are_not_token_sequences(tokens):
    with pytest.raises(BadTokenIds):
        as_token_ids(tokens)


@pytest.mark.parametrize("raw", [[1, 2], b"\x00\x01", bytearray(8), "abcd"])
def test_token_ids_are_built_from_packed_bytes_only(raw):
    """``TokenIds([1, 2])`` held a list and counted 0 ids; a misaligned buffer dropped its tail."""
    from hicache_fsm.tokens import TokenIds

    with pytest.raises(TokenIdTypeError, match="pack_token_ids"):
        TokenIds(raw)
    assert list(TokenIds(bytes(8))) == [0, 0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-2**40, 2**40), max_size=20))
def test_accepts_exactly_the_range_storage_keys_encode(values):
    good = all(0 <= v < 2**32 for v in values)
    if good:
        assert as_token_ids(values) == tuple(values)
    else:
        with pytest.raises(BadTokenIds) as info:
            as_token_ids(values)
        first = next(i for i, v in enumerate(values) if not 0 <= v < 2**32)
        assert info.value.position == first


# ------------------------------------------------------------------ through the cache


def _rejected(cache, fn, *args):
    before = cache.snapshot()
    with pytest.raises(BadTokenIds):
        fn(*args)
    assert cache.snapshot() == before
    cache.check_invariants()


@pytest.mark.parametrize("bad,error,match", BAD[:7])
def test_cache_entry_points_refuse_bad_ids_and_change_nothing(bad, error, match):
    cache, ex = make_cache()
    put(cache, pages(2))
    drain(cache, ex)
    tokens = list(pages(2)) + [bad] * 4
    idx = cache.alloc_device(12)
    _rejected(cache, cache.insert, tokens + [9] * 4, idx)
    _rejected(cache, cache.match_prefix, tokens)
    cache.free_device(idx)


@pytest.mark.parametrize("bad", [b for b, _, _ in BAD[:7]])
def test_prefetch_refuses_bad_ids_and_changes_nothing(bad):
    cache, ex = make_cache()
    try:
        cache.attach_storage(MemoryBackend(), prefetch_threshold=4)
        m = cache.match_prefix(pages(2))
        _rejected(cache, cache.prefetch, "r", list(pages(2)) + [bad] * 4, m)
    finally:
        cache.close()


def test_padding_ids_with_storage_attached_end_in_one_typed_error():
    """The reproducer of a padding id (-1) reaching storage keys: refused at insert, nothing pinned."""
    cache, ex = make_cache()
    try:
        cache.attach_storage(MemoryBackend(), prefetch_threshold=4)
        put(cache, list(range(1, 9)))
        idx = cache.alloc_device(8)
        before = cache.snapshot()
        with pytest.raises(BadTokenIds, match="position 0"):
            cache.insert([-1] * 8, idx)
        assert cache.snapshot() == before
        cache.free_device(idx)
        put(cache, list(range(100, 108)))
        deadline = time.monotonic() + 120  # a safety stop for stuck threads only
        while cache.pending_job_ids() and time.monotonic() < deadline:  # host, then storage backups
            ex.complete_all()
            cache.poll()
            time.sleep(0.01)
        assert not cache.pending_job_ids()
        cache.check_invariants()
        st = cache.stats()["storage"]
        assert st["healthy"] and st["backend_stats"]["sets"] == 4 and st["backend_stats"]["errors"] == 0
        assert all(cache.match_prefix(t).device_hit_length == 8 for t in (range(1, 9), range(100, 108)))
    finally:
        cache.close()


def test_completion_with_a_list_job_id_is_an_unknown_job():
    cache, ex = make_cache()
    put(cache, pages(2))
    before = cache.snapshot()
    for bad in ([1], "1", 1.0, None, True):
        with pytest.raises(UnknownJob, match="job ids are ints"):
            cache.complete(Completion(bad, True))
        assert cache.snapshot() == before


# ------------------------------------------------------------------ one packed form


class _Index:
    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


class _IntSubclass(int):
    pass


@pytest.mark.parametrize("odd", [torch.tensor(7), np.int32(7), _Index(7), _IntSubclass(7)],
                         ids=["0-d tensor", "numpy scalar", "__index__", "int subclass"])
def test_an_integer_like_id_anywhere_in_a_list_keys_the_tree_like_the_int_it_equals(odd):
    """Packing normalizes: a node inserted with an odd element is hit by plain ints (and the other way)."""
    plain = [1, 2, 3, 7, 5, 6, 7, 8]
    mixed = [1, 2, 3, odd, 5, 6, 7, 8]
    assert pack_token_ids(mixed) == pack_token_ids(plain)
    for first, second in ((mixed, plain), (plain, mixed)):
        cache, ex = make_cache()
        put(cache, first)
        drain(cache, ex)
        assert cache.match_prefix(second).device_hit_length == len(plain)
        assert all(type(t) is int for n in cache.tree.nodes() for t in n.key)
        cache.check_invariants()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=40))
def test_lists_tuples_arrays_and_tensors_pack_to_the_same_bytes(values):
    want = pack_token_ids(values)
    assert pack_token_ids(tuple(values)) == want and as_token_ids(want) == tuple(values)
    assert pack_token_ids(np.array(values, dtype=np.int64)) == want
    assert pack_token_ids(torch.tensor(values, dtype=torch.int64)) == want
    assert len(want) == len(values) and want.tolist() == values
    assert token_id_bytes(want) == want.raw == b"".join(v.to_bytes(4, "little") for v in values)


INTEGER_TYPECODES = "bBhHiIlLqQ"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 127), max_size=40), st.sampled_from(INTEGER_TYPECODES))
def test_an_array_of_any_integer_typecode_packs_like_the_list_of_its_ids(values, typecode):
    """SGLang's scheduler holds ids as ``array("q")``: its buffer is read in one vectorised pass."""
    assert pack_token_ids(array(typecode, values)) == pack_token_ids(values)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-2**40, 2**40), max_size=20))
def test_an_int64_array_is_refused_at_the_first_id_out_of_range(values):
    ids = array("q", values)
    if all(0 <= v < 2**32 for v in values):
        assert as_token_ids(ids) == tuple(values)
    else:
        with pytest.raises(BadTokenIds) as info:
            as_token_ids(ids)
        first = next(i for i, v in enumerate(values) if not 0 <= v < 2**32)
        assert info.value.position == first and info.value.value == values[first]


@pytest.mark.parametrize("typecode", "bhilq")
def test_a_negative_id_in_a_signed_array_is_refused_at_its_position(typecode):
    with pytest.raises(BadTokenIds) as info:
        as_token_ids(array(typecode, [3, 2, -1, 4]))
    assert info.value.position == 2 and info.value.value == -1


def test_an_array_of_floats_names_the_first_float():
    with pytest.raises(TokenIdTypeError) as info:
        as_token_ids(array("d", [2.0, 0.5]))
    assert info.value.position == 0


@pytest.mark.parametrize("form", [lambda v: array("q", v), lambda v: np.array(v, dtype=np.int64),
                                  lambda v: torch.tensor(v, dtype=torch.int32)], ids=["array_q", "numpy", "tensor"])
def test_an_engine_checks_an_id_array_once_and_packs_slices_of_it(form):
    """The public pieces ``match_prefix`` uses: ``id_array`` reads, ``check_id_array`` checks, ``pack_id_array`` packs."""
    ids = checked_id_array(form([5, 6, 7, 8]))
    assert pack_id_array(ids[:2]) == pack_token_ids([5, 6]) and pack_id_array(ids) == pack_token_ids([5, 6, 7, 8])
    bad = form([5, 6, 7, -1])
    check_id_array(id_array(bad)[:3])  # the good part passes alone
    for check in (lambda: check_id_array(id_array(bad)), lambda: checked_id_array(bad)):
        with pytest.raises(BadTokenIds) as info:
            check()
        assert info.value.position == 3
    assert id_array((5, 6)) is None and checked_id_array([5, 6]) is None and id_array(np.array([0.5])) is None


def _typecode_range(code: str) -> tuple[int, int]:
    """The values an ``array.array`` of integer typecode ``code`` holds: [low, high)."""
    bits = 8 * array(code).itemsize
    return (-(1 << (bits - 1)), 1 << (bits - 1)) if code.islower() else (0, 1 << bits)


_TYPECODE_RANGES = {code: _typecode_range(code) for code in "bBhHiIlLqQ"}


@settings(max_examples=200, deadline=None)
@given(data=st.data(), code=st.sampled_from(sorted(_TYPECODE_RANGES)), n=st.integers(0, 12))
def test_an_arrays_head_is_packed_as_its_ids_are_or_left_to_the_vectorised_check(data, code, n):
    """``array_head_bytes``: the first ``n`` ids packed exactly as ``pack_token_ids`` packs them, or None when one
    of them is out of range (the vectorised check then names it); an array of floats gives None."""
    low, high = _TYPECODE_RANGES[code]
    values = data.draw(st.lists(st.integers(low, high - 1), max_size=16))
    head = values[:n]
    got = array_head_bytes(array(code, values), n)
    if all(0 <= v < TOKEN_ID_LIMIT for v in head):
        assert got == pack_token_ids(head).raw
    else:
        assert got is None
        with pytest.raises(BadTokenIds):
            check_id_array(id_array(array(code, head)))
    assert array_head_bytes(array("d", [1.0, 2.0]), n) is None


@pytest.mark.parametrize("code", ["q", "Q", "l", "L"])
@pytest.mark.parametrize("n", [256, 257, 1000])
def test_a_wide_arrays_head_longer_than_its_word_check_is_packed_by_struct(code, n):
    """8-byte ids are checked as words up to 256 of them; a longer first page takes ``struct``, with the same
    answer: the ids packed, or None for one out of range."""
    values = list(range(7, 7 + n))
    assert array_head_bytes(array(code, values), n) == pack_token_ids(values).raw
    assert array_head_bytes(array(code, values + [1]), n) == pack_token_ids(values).raw
    values[-1] = 2**32
    assert array_head_bytes(array(code, values), n) is None
    assert array_head_bytes(array(code, values), n - 1) == pack_token_ids(values[:-1]).raw


_DTYPES = ["<i4", "<u4", "<i8", "<u8", ">i4", ">i8", "<i2", "<u2", "i1", "u1"]


@settings(max_examples=300, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(_DTYPES), n=st.integers(0, 12))
def test_an_id_arrays_head_is_packed_from_its_bytes_as_its_ids_are_or_left_to_the_vectorised_check(data, dtype, n):
    """``id_array_head_bytes``: the first ``n`` ids of a numpy array packed exactly as ``pack_token_ids`` packs
    them, or None when one is out of range or the dtype has no byte check (byte-swapped, narrower than 4 bytes);
    None never hides a bad id from ``check_id_array``."""
    info = np.iinfo(np.dtype(dtype))
    values = data.draw(st.lists(st.integers(int(info.min), int(info.max)), max_size=16))
    ids = np.array(values, dtype=dtype)
    got = id_array_head_bytes(ids, n)
    head = values[:n]
    in_range = all(0 <= v < TOKEN_ID_LIMIT for v in head)
    if got is not None:
        assert in_range and got == pack_token_ids(head).raw
    elif in_range:
        assert not np.dtype(dtype).isnative or np.dtype(dtype).itemsize < 4
    else:
        with pytest.raises(BadTokenIds):
            check_id_array(ids[:n])


@settings(max_examples=200, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(_DTYPES), one_pass=st.booleans())
def test_an_id_array_is_checked_as_it_is_packed_or_its_first_bad_id_named(data, dtype, one_pass):
    """``checked_id_bytes``: the ids packed as ``pack_token_ids`` packs them, or ``BadTokenIds`` at the first id out
    of range, whether numpy checks them in the conversion (``casting="same_value"``) or a separate pass does."""
    import hicache_fsm.tokens as tokens

    info = np.iinfo(np.dtype(dtype))
    values = data.draw(st.lists(st.integers(int(info.min), int(info.max)), max_size=12))
    ids = np.array(values, dtype=dtype)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tokens, "SAME_VALUE_CASTS", one_pass and tokens.SAME_VALUE_CASTS)  # an older numpy: two passes
        bad = [i for i, v in enumerate(values) if not 0 <= v < TOKEN_ID_LIMIT]
        if not bad:
            assert checked_id_bytes(ids) == pack_token_ids(values).raw
        else:
            with pytest.raises(BadTokenIds) as raised:
                checked_id_bytes(ids)
            assert raised.value.position == bad[0] and raised.value.value == values[bad[0]]


def test_an_int32_tensors_head_is_packed_from_its_bytes():
    ids = torch.tensor([7, 2**31 - 1, 0, 5], dtype=torch.int32)
    assert id_array_head_bytes(id_array(ids), 3) == pack_token_ids([7, 2**31 - 1, 0]).raw
    assert id_array_head_bytes(id_array(torch.tensor([7, -1], dtype=torch.int32)), 2) is None
