"""``insert`` after ``match_prefix`` of the same ids reuses their packing (a batch's too), and never a stale one.

A list or an ``array("q")`` may change between the two calls (an engine
appends decoded ids to the ids it matched): whatever it holds when ``insert``
runs is what is cached, checked as if it had never been seen. A tuple or a
list is compared with a copy of the last one's items, an integer array or tensor
by its bytes: another object of the same ids (built anew for each call) reuses the
packing too.
"""

from __future__ import annotations

from array import array

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_helpers import drain, make_cache, put
from hicache_fsm.errors import BadTokenIds, TokenIdTypeError
from hicache_fsm.tokens import TokenIds, pack_token_ids

PAGE = 4


def _insert_after_match(cache, matched, inserted_as) -> object:
    """Match ``matched``, then insert it (after ``inserted_as`` changed it, if it did) on fresh slots."""
    cache.match_prefix(matched)
    tokens = inserted_as(matched)
    return cache.insert(tokens, cache.alloc_device(len(tokens)))


def _cached_ids(cache) -> set[tuple[int, ...]]:
    """The ids from the root to each node of the tree."""
    out = set()
    for node in cache.tree.nodes():
        ids: list[int] = []
        while node is not None and not node.is_root:
            ids[:0] = list(node.key)
            node = node.parent
        out.add(tuple(ids))
    return out


def _same_kind(seq, items: list[int]):
    """``items`` in the container kind of ``seq`` (slice assignment to an array takes an array)."""
    return array(seq.typecode, items) if isinstance(seq, array) else items


CHANGES = {
    "none": lambda lst: None,
    "append_page": lambda lst: lst.extend([7, 8, 9, 10]),
    "drop_page": lambda lst: lst.__delitem__(slice(-PAGE, None)),
    "set_first": lambda lst: lst.__setitem__(0, lst[0] + 1),
    "set_last": lambda lst: lst.__setitem__(-1, lst[-1] + 1000),
    "clear_then_refill": lambda lst: lst.__setitem__(slice(None), _same_kind(lst, [5] * len(lst))),
}
MUTABLE_FORMS = {"list": list, "array": lambda ids: array("q", ids)}


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 50), min_size=PAGE, max_size=4 * PAGE), change=st.sampled_from(sorted(CHANGES)),
       form=st.sampled_from(sorted(MUTABLE_FORMS)))
def test_a_list_or_array_changed_between_match_and_insert_caches_what_it_holds_at_insert(ids, change, form):
    ids = ids[: len(ids) - len(ids) % PAGE]
    memo_cache, ex = make_cache(page=PAGE)
    twin, twin_ex = make_cache(page=PAGE)

    def changed(lst):
        CHANGES[change](lst)
        return lst

    request = MUTABLE_FORMS[form](ids)
    _insert_after_match(memo_cache, request, changed)  # the same object at both calls
    expected = list(ids)
    CHANGES[change](expected)
    twin.match_prefix(tuple(ids))
    twin.insert(tuple(expected), twin.alloc_device(len(expected)))  # a fresh tuple: packed anew
    drain(memo_cache, ex)
    drain(twin, twin_ex)
    assert _cached_ids(memo_cache) == _cached_ids(twin)
    memo_cache.check_invariants()


BAD_INTO = [("list", -1, BadTokenIds), ("list", 2**33, BadTokenIds), ("list", 0.5, TokenIdTypeError),
            ("list", "7", TokenIdTypeError), ("list", None, TokenIdTypeError),
            ("array", -1, BadTokenIds), ("array", 2**33, BadTokenIds)]  # an array("q") holds ints only


@pytest.mark.parametrize("form,bad,error", BAD_INTO)
def test_a_bad_id_put_into_a_matched_list_or_array_is_refused_by_insert_and_changes_nothing(form, bad, error):
    cache, _ = make_cache(page=PAGE)
    request = MUTABLE_FORMS[form](range(1, 9))
    cache.match_prefix(request)
    request[5] = bad
    idx = cache.alloc_device(8)
    before = cache.snapshot()
    with pytest.raises(error) as info:
        cache.insert(request, idx)
    assert info.value.position == 5
    assert cache.snapshot() == before
    cache.free_device(idx)
    cache.check_invariants()


def test_an_array_written_through_a_numpy_view_after_the_match_is_checked_again_by_insert():
    """A view's write leaves no trace on the array object: ``insert`` reads its memory as it is then."""
    cache, _ = make_cache(page=PAGE)
    request = array("q", range(1, 9))
    cache.match_prefix(request)
    np.frombuffer(request, dtype=np.int64)[5] = -1
    idx = cache.alloc_device(8)
    with pytest.raises(BadTokenIds) as info:
        cache.insert(request, idx)
    assert info.value.position == 5 and request[5] == -1
    cache.free_device(idx)
    cache.check_invariants()


def test_an_item_whose_comparison_raises_is_named_by_packing_not_leaked():
    """``==`` of a numpy array put into the list raises ValueError; insert still answers with the typed error."""
    cache, _ = make_cache(page=PAGE)
    request = [1, 2, 3, 4]
    cache.match_prefix(request)
    request[2] = np.array([3, 3])
    idx = cache.alloc_device(4)
    with pytest.raises(TokenIdTypeError) as info:
        cache.insert(request, idx)
    assert info.value.position == 2
    cache.free_device(idx)


def test_match_then_insert_of_the_same_ids_checks_them_once_in_every_form(monkeypatch):
    import hicache_fsm.request_ids as request_ids

    cache, _ = make_cache(page=PAGE)
    put(cache, range(1, 1 + PAGE))  # every request below begins with this page: match_prefix reads it whole
    checked = []  # the form and length of each check
    real_pack, real_check = request_ids.pack_token_ids, request_ids.check_id_array
    monkeypatch.setattr(request_ids, "pack_token_ids",
                        lambda t: checked.append((type(t).__name__, len(t))) or real_pack(t))
    monkeypatch.setattr(request_ids, "check_id_array",
                        lambda ids: checked.append(("array", len(ids))) or real_check(ids))
    real_checked_bytes = request_ids.checked_id_bytes  # a whole array, checked as it is packed
    monkeypatch.setattr(request_ids, "checked_id_bytes",
                        lambda ids: checked.append(("array", len(ids))) or real_checked_bytes(ids))
    real_head = request_ids.id_array_head_bytes  # a tensor's first page, checked on its bytes
    monkeypatch.setattr(request_ids, "id_array_head_bytes",
                        lambda ids, n: checked.append(("array", min(n, len(ids)))) or real_head(ids, n))
    for i, form in enumerate((tuple, list, lambda ids: array("q", ids))):
        request = form(list(range(1, 1 + PAGE)) + list(range(10 * i + 10, 10 * i + 10 + PAGE)))
        cache.match_prefix(request)
        cache.insert(request, cache.alloc_device(2 * PAGE))
    # a tuple or list has its first page checked to ask for a miss, then the whole request once (a list as the
    # tuple snapshot it is compared with later), but the first tuple: it holds the page ``put`` packed last, then
    # more, so only its new ids are packed (by the extension); an array is checked whole once, and found equal by
    # insert
    assert checked == [("tuple", PAGE), ("list", PAGE), ("tuple", 2 * PAGE), ("array", 2 * PAGE)]
    checked.clear()
    hit = torch.tensor(list(range(1, 1 + PAGE)) + [70, 71, 72, 73])
    cache.match_prefix(hit)
    cache.insert(hit.clone(), cache.alloc_device(2 * PAGE))  # another tensor of the same ids
    assert checked == [("array", PAGE), ("array", 2 * PAGE)]  # its first page on its bytes, then the whole once
    checked.clear()
    miss = torch.arange(100, 108)
    cache.match_prefix(miss)
    cache.insert(miss, cache.alloc_device(8))
    # a miss checks its first page alone; insert then checks the whole tensor (ids never packed before)
    assert checked == [("array", PAGE), ("array", 8)]


@pytest.mark.parametrize("change", ["none", "set_last", "append_page"])
def test_insert_of_an_array_reuses_the_walk_of_its_match_only_while_its_ids_are_equal(monkeypatch, change):
    from hicache_fsm.radix import RadixTree

    cache, _ = make_cache(page=PAGE)
    put(cache, range(1, 1 + 2 * PAGE))
    walks = []
    real_walk = RadixTree.walk
    monkeypatch.setattr(RadixTree, "walk", lambda self, *a: walks.append(1) or real_walk(self, *a))
    request = array("q", list(range(1, 1 + 2 * PAGE)) + [40, 41, 42, 43])
    cache.match_prefix(request)  # packed into one TokenIds ...
    CHANGES[change](request)
    result = cache.insert(request, cache.alloc_device(len(request)))  # ... and into another, equal unless changed
    assert len(walks) == (1 if change == "none" else 2)
    assert tuple(request) in _cached_ids(cache)
    assert result.cached_tokens == 2 * PAGE


ARRAY_FORMS = {  # integer arrays and tensors ``RequestIds`` compares by their bytes
    "array q": lambda ids: array("q", ids),
    "array i": lambda ids: array("i", ids),
    "array I": lambda ids: array("I", ids),
    "numpy int64": lambda ids: np.array(ids, dtype=np.int64),
    "numpy uint32": lambda ids: np.array(ids, dtype=np.uint32),
    "numpy big-endian int64": lambda ids: np.array(ids, dtype=">i8"),
    "numpy strided": lambda ids: np.repeat(np.array(ids, dtype=np.int64), 2)[::2],
    "tensor int64": lambda ids: torch.tensor(ids, dtype=torch.int64),
    "tensor int32": lambda ids: torch.tensor(ids, dtype=torch.int32),
}
STEPS = {  # the next request's ids from the last one's
    "same": lambda last, new: list(last),
    "slice": lambda last, new: last[: len(last) // 2],
    "extend": lambda last, new: list(last) + new,
    "change one": lambda last, new: [new[0]] + list(last[1:]) if last else new,
    "fresh": lambda last, new: new,
}
ID = st.one_of(st.integers(0, 60), st.sampled_from([-1, 2**31, 2**32 - 1, 2**32, 2**40]))


def _outcome(pack, form, ids):
    """What packing ``form(ids)`` gives: the packed bytes, or the typed error and the position it names."""
    try:
        return pack(form(ids)).raw
    except (BadTokenIds, TokenIdTypeError) as e:
        return type(e), e.position


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(sorted(STEPS)), st.sampled_from(sorted(ARRAY_FORMS)),
                                st.lists(ID, min_size=1, max_size=12)), min_size=1, max_size=8))
def test_arrays_packed_in_turn_give_what_packing_each_alone_gives(steps):
    """The array memo reuses a packing only for the same ids: any order of equal, sliced, extended, changed and
    fresh arrays of any dtype packs (or is refused, naming the same position) as a fresh packing of each."""
    from hicache_fsm.request_ids import RequestIds

    ids_of = RequestIds(driver=None, page_size=PAGE)
    last: list[int] = []
    for step, form_name, new in steps:
        ids = STEPS[step](last, new)
        form = ARRAY_FORMS[form_name]
        try:
            form(ids)
        except (OverflowError, ValueError, RuntimeError):  # an id this dtype cannot hold: not a request of it
            continue
        assert _outcome(ids_of.packed, form, ids) == _outcome(pack_token_ids, form, ids)
        last = ids


def test_an_array_memo_checks_only_new_ids_and_never_answers_for_the_same_bytes_read_as_another_dtype(monkeypatch):
    import hicache_fsm.request_ids as request_ids

    checked = []  # the lengths of the whole arrays checked
    real_check = request_ids.check_id_array
    monkeypatch.setattr(request_ids, "check_id_array", lambda ids: checked.append(len(ids)) or real_check(ids))
    real_checked_bytes = request_ids.checked_id_bytes  # a whole array, checked as it is packed
    monkeypatch.setattr(request_ids, "checked_id_bytes",
                        lambda ids: checked.append(len(ids)) or real_checked_bytes(ids))
    ids_of = request_ids.RequestIds(driver=None, page_size=PAGE)
    wide = array("q", [1, 2, 3, 4])
    assert ids_of.packed(wide).tolist() == [1, 2, 3, 4]
    grown = array("q", [1, 2, 3, 4, 2**32])
    with pytest.raises(BadTokenIds) as info:  # the new id alone is checked, and named by its place in the whole
        ids_of.packed(grown)
    assert info.value.position == 4
    assert checked == [4]  # the known ids were not checked again
    narrow = array("i")
    narrow.frombytes(wide.tobytes())  # the same bytes: 1, 0, 2, 0, ... as int32
    assert ids_of.packed(narrow).tolist() == [1, 0, 2, 0, 3, 0, 4, 0]
    assert checked == [4, 8]


@pytest.mark.parametrize("form", ["array q", "numpy int64", "tensor int64"])
def test_an_array_grown_past_the_one_remembered_is_packed_once_then_remembered_whole(monkeypatch, form):
    """A request grown by decoding: ``match_prefix`` of its ids packs only the new ones, and the ``insert`` after it
    packs nothing (the grown ids were remembered in place of the shorter ones, not extended again per call)."""
    from hicache_fsm.request_ids import RequestIds

    extensions = []  # how many new ids each extension packed
    real = TokenIds.extended
    monkeypatch.setattr(TokenIds, "extended", lambda self, new: extensions.append(len(new)) or real(self, new))
    ids_of = RequestIds(driver=None, page_size=PAGE)
    to = ARRAY_FORMS[form]
    ids_of.packed(to([1, 2, 3, 4]))  # the prefill's ids
    grown = to([1, 2, 3, 4, 5, 6])
    first = ids_of.packed(grown)  # match_prefix of the finished request
    assert first.tolist() == [1, 2, 3, 4, 5, 6] and extensions == [2]
    assert ids_of.packed(grown) is first and ids_of.packed(to([1, 2, 3, 4, 5, 6])) is first  # its insert
    assert ids_of.packed(to([1, 2, 3, 4, 5])).tolist() == [1, 2, 3, 4, 5]  # a slice of it: no packing either
    assert extensions == [2]


def _count_packings(monkeypatch) -> list:
    """The length of every whole check (an array) or packing (a tuple or list) ``RequestIds`` makes from now on."""
    import hicache_fsm.request_ids as request_ids

    made: list = []
    real_pack, real_check = request_ids.pack_token_ids, request_ids.check_id_array
    monkeypatch.setattr(request_ids, "pack_token_ids", lambda t: made.append(len(t)) or real_pack(t))
    monkeypatch.setattr(request_ids, "check_id_array", lambda ids: made.append(len(ids)) or real_check(ids))
    real_checked_bytes = request_ids.checked_id_bytes  # a whole array, checked as it is packed
    monkeypatch.setattr(request_ids, "checked_id_bytes", lambda ids: made.append(len(ids)) or real_checked_bytes(ids))
    return made


BATCH_FORMS = {"tuple": tuple, "list": list} | ARRAY_FORMS


@pytest.mark.parametrize("form", sorted(BATCH_FORMS))
def test_a_batch_matched_before_its_inserts_is_packed_once(monkeypatch, form):
    """A scheduler matches every request of a batch, then inserts each: the inserts pack nothing again (each handed
    as another object of the same ids: a list built anew, an equal array), but a strided view, which has no one
    run of bytes to compare."""
    from hicache_fsm.request_ids import RequestIds

    ids_of = RequestIds(driver=None, page_size=PAGE)
    to = BATCH_FORMS[form]
    batch = [to([i, 2 * i + 1, 3 * i + 2, 40 + i]) for i in range(8)]
    first = [ids_of.packed(ids, used=False) for ids in batch]  # the matches
    made = _count_packings(monkeypatch)
    again = [to([i, 2 * i + 1, 3 * i + 2, 40 + i]) for i in range(8)]
    packed = [ids_of.packed(ids) for ids in again]  # the inserts
    assert packed == first and [p.tolist() for p in packed] == [[int(i) for i in ids] for ids in batch]
    if form == "numpy strided":
        assert made == [4] * 8
    else:
        assert made == [] and all(p is f for p, f in zip(packed, first))


@pytest.mark.parametrize("form", ["tuple", "list"])
def test_ids_built_anew_for_each_call_are_packed_once(monkeypatch, form):
    """An engine that builds a request's ids afresh for every call (its prompt's list plus its output's): the
    insert after the match packs nothing, a shorter one (the first of those ids) nothing, a grown one (decoded
    ids appended) its new ids only, then is remembered whole; any changed id is packed anew, as it is now."""
    from hicache_fsm.request_ids import RequestIds

    extensions = []  # how many new ids each extension packed
    real = TokenIds.extended
    monkeypatch.setattr(TokenIds, "extended", lambda self, new: extensions.append(len(new)) or real(self, new))
    ids_of = RequestIds(driver=None, page_size=PAGE)
    to = {"tuple": tuple, "list": list}[form]
    prompt, output = [1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12]
    matched = ids_of.packed(to(prompt + output), used=False)
    made = _count_packings(monkeypatch)
    assert ids_of.packed(to(prompt + output)) is matched  # the insert, on another object
    assert ids_of.packed(to(prompt)).tolist() == prompt  # the first of them
    output += [13, 14, 15, 16]
    grown = ids_of.packed(to(prompt + output))
    assert grown.tolist() == prompt + output and made == [] and extensions == [4]
    assert ids_of.packed(to(prompt + output)) is grown  # remembered whole: not extended again
    assert ids_of.packed(list(prompt + output)) is grown and ids_of.packed(tuple(prompt + output)) is grown
    assert made == [] and extensions == [4]
    changed = prompt + output
    changed[5] = 99  # the same first and last ids, another in between
    assert ids_of.packed(to(changed)).tolist() == changed and made == [len(changed)]
    with pytest.raises(BadTokenIds) as info:  # a bad decoded id: named by its place in the whole
        ids_of.packed(to(changed + [4, -1]))
    assert info.value.position == len(changed) + 1
    assert ids_of.packed(to(changed)).tolist() == changed and made == [len(changed)]  # still remembered


def test_ids_built_anew_through_the_cache_are_checked_once(monkeypatch):
    """``match_prefix`` of a list, then ``insert`` of another list of the same ids: checked once, cached as they are."""
    cache, _ = make_cache(page=PAGE)
    put(cache, range(1, 1 + PAGE))  # the request begins with this page: match_prefix reads it whole
    prompt, output = list(range(1, 1 + PAGE)), [60, 61, 62, 63]
    match = cache.match_prefix(prompt + output)
    made = _count_packings(monkeypatch)
    cache.insert(prompt + output, torch.cat([match.device_indices, cache.alloc_device(PAGE)]))
    assert made == []
    monkeypatch.undo()
    assert tuple(prompt + output) in _cached_ids(cache)
    cache.check_invariants()


def test_a_batch_through_the_cache_is_checked_once_per_request(monkeypatch):
    cache, _ = make_cache(page=PAGE)
    put(cache, range(1, 1 + PAGE))  # every request begins with this page: match_prefix reads each whole
    lists = [list(range(1, 1 + PAGE)) + [50 + i] * PAGE for i in range(4)]
    arrays = [array("q", list(range(1, 1 + PAGE)) + [80 + i] * PAGE) for i in range(4)]
    for batch in (lists, arrays):
        slots = []
        for request in batch:
            match = cache.match_prefix(request)
            slots.append(torch.cat([match.device_indices, cache.alloc_device(PAGE)]))
        made = _count_packings(monkeypatch)
        for request, idx in zip(batch, slots):
            cache.insert(request, idx)
        assert made == []
        monkeypatch.undo()
    assert {tuple(r) for r in lists + arrays} <= _cached_ids(cache)
    cache.check_invariants()


def test_an_earlier_request_changed_since_is_packed_again_as_it_is_now():
    from hicache_fsm.request_ids import RequestIds

    ids_of = RequestIds(driver=None, page_size=PAGE)
    lists = [[1, 2, 3, i] for i in range(4)]
    arrays = [np.array([5, 6, 7, 10 + i], dtype=np.int64) for i in range(4)]
    grown = array("q", [9, 9, 9, 9])
    for ids in [*lists, *arrays, grown]:
        ids_of.packed(ids, used=False)  # matched, not inserted yet
    lists[0][1] = 99
    lists[1].append(8)
    arrays[0][1] = 98  # the same length and last id: found, compared, and packed anew
    arrays[1][1] = -1
    grown.append(7)
    assert ids_of.packed(lists[0]).tolist() == [1, 99, 3, 0]
    assert ids_of.packed(lists[1]).tolist() == [1, 2, 3, 1, 8]
    assert ids_of.packed(arrays[0]).tolist() == [5, 98, 7, 10]
    with pytest.raises(BadTokenIds) as info:
        ids_of.packed(arrays[1])
    assert info.value.position == 1
    assert ids_of.packed(grown).tolist() == [9, 9, 9, 9, 7]
    assert ids_of.packed(lists[2]).tolist() == [1, 2, 3, 2]  # an unchanged one packs as it did
    assert ids_of.packed(np.array([5, 6, 7, 12])).tolist() == [5, 6, 7, 12]


def test_earlier_packings_drop_the_oldest_beyond_their_count_or_their_bytes(monkeypatch):
    from hicache_fsm.request_ids import EARLIER_REQUESTS, EarlierPackings, RequestIds

    kept = EarlierPackings(count=3, max_bytes=100)
    for k in range(5):
        kept.keep(k, (k,), 10)
    assert len(kept) == 3 and kept.take(0) is None and kept.take(1) is None and kept.take(2) == (2,)
    kept.keep("big", ("big",), 95)  # 20 + 95 bytes: the two oldest go
    assert kept.take(3) is None and kept.take(4) is None and kept.take("big") == ("big",) and len(kept) == 0
    kept.keep("huge", ("huge",), 101)  # more than the bound alone: not kept
    assert len(kept) == 0

    ids_of = RequestIds(driver=None, page_size=PAGE)
    arrays = [array("q", [1, 2, 3, i]) for i in range(EARLIER_REQUESTS + 2)]  # the last, and as many as are kept
    for ids in arrays:
        ids_of.packed(ids, used=False)
    made = _count_packings(monkeypatch)
    ids_of.packed(arrays[1])  # remembered: the oldest kept
    assert made == []
    ids_of.packed(arrays[0])  # dropped: checked again
    assert made == [4]


POOL_FORMS = {"tuple": tuple, "list": list} | {
    name: ARRAY_FORMS[name] for name in ("array q", "numpy int64", "numpy uint32", "tensor int32")}


def _put(ids: object, value: int) -> bool:
    """Change the first id of a mutable request in place (to ``value``, or one more when it holds that already);
    False when its form cannot (a tuple) or cannot hold the new id."""
    if isinstance(ids, tuple):
        return False
    try:
        ids[0] = value + 1 if int(ids[0]) == value else value
    except (OverflowError, ValueError, RuntimeError, TypeError):
        return False
    return True


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["pack", "change", "new", "copy", "grow", "shrink"]),
                              st.integers(0, 2), st.sampled_from(sorted(POOL_FORMS)),
                              st.lists(ID, min_size=1, max_size=6), st.booleans()),
                    min_size=1, max_size=40))
def test_remembered_packings_give_what_packing_each_request_afresh_gives(ops):
    """Requests made, changed in place, copied into other objects (another form, fewer ids, more ids) and handed
    again in any order, each packing for a match or for an insert: every packing equals a fresh one (or the same
    refusal at the same position), however many were remembered before it."""
    from hicache_fsm.request_ids import RequestIds

    ids_of = RequestIds(driver=None, page_size=PAGE)
    pool: dict[int, object] = {}
    for op, slot, form, values, used in ops:
        if op in ("copy", "grow", "shrink") and slot in pool:  # another object, made from the ids the slot holds
            held = [int(x) for x in pool[slot]]
            values = {"copy": held, "grow": held + values, "shrink": held[:-1] or held}[op]
        if op != "pack" and op != "change" or slot not in pool:
            try:
                pool[slot] = POOL_FORMS[form](values)
            except (OverflowError, ValueError, RuntimeError):  # an id this dtype cannot hold
                continue
        elif op == "change" and not _put(pool[slot], values[0]):
            continue
        ids = pool[slot]
        pack = lambda x: ids_of.packed(x, used=used)  # noqa: E731 - the packing this step makes
        assert _outcome(pack, lambda x: x, ids) == _outcome(pack_token_ids, lambda x: x, ids)


@pytest.mark.parametrize("form", ["list", "array q"])
def test_a_request_inserted_right_after_its_match_is_not_kept_for_later(monkeypatch, form):
    """One request at a time (match, insert, next): the earlier packings stay empty, so a request handed again
    later is packed again; only packings no insert used yet are kept."""
    from hicache_fsm.request_ids import RequestIds

    ids_of = RequestIds(driver=None, page_size=PAGE)
    to = BATCH_FORMS[form]
    requests = [to([1, 2, 3, 10 + i]) for i in range(4)]
    for ids in requests:
        ids_of.packed(ids, used=False)  # its match
        ids_of.packed(ids)  # its insert
    made = _count_packings(monkeypatch)
    ids_of.packed(requests[0])
    assert made == [4]


def test_keeping_no_earlier_packing_packs_every_request_handed_again(monkeypatch):
    """``keep_earlier(0)`` (how ``bench scale`` times a first packing): a batch's inserts pack their ids again."""
    from hicache_fsm.request_ids import RequestIds

    ids_of = RequestIds(driver=None, page_size=PAGE)
    ids_of.keep_earlier(0)
    batch = [array("q", [1, 2, 3, 10 + i]) for i in range(3)]
    for ids in batch:
        ids_of.packed(ids, used=False)
    made = _count_packings(monkeypatch)
    assert [ids_of.packed(ids).tolist() for ids in batch] == [[1, 2, 3, 10 + i] for i in range(3)]
    assert made == [4, 4, 4]  # the last one matched was replaced by the first insert's packing
