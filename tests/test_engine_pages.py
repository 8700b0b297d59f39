"""``EnginePages`` holds what a plain set of page ids would, and refuses what it would refuse, batch kept or not."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_fsm.allocator import PAGE_ID_DTYPE
from hicache_fsm.engine_pages import EnginePages
from hicache_fsm.errors import BadIndices


def packed(pages: list[int]) -> bytes:
    return np.array(pages, dtype=PAGE_ID_DTYPE).tobytes()


def model_take(model: set[int], pages: list[int]) -> bool:
    """What taking ``pages`` from a plain set does: False (nothing changed) when one is not held or named twice."""
    if len(set(pages)) != len(pages) or not model.issuperset(pages):
        return False
    model.difference_update(pages)
    return True


# one step: hand out a fresh batch of n pages, or take / check / release some pages (by position in a pool of
# ids that covers held, taken and never-handed-out pages), packed or as a list
STEPS = st.one_of(
    st.tuples(st.just("hand_out"), st.integers(0, 6)),
    st.tuples(st.sampled_from(["take_packed", "take", "check", "release", "last_batch"]),
              st.lists(st.integers(0, 40), max_size=6)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(STEPS, max_size=30))
def test_engine_pages_behave_as_a_set_of_the_pages_handed_out(steps):
    pages, model = EnginePages(), set()
    fresh = iter(range(1000, 2000))
    last: list[int] = []
    for op, arg in steps:
        pool = sorted(model) + last + [0, 1, 2]  # held pages, the last batch and pages never handed out
        if op == "hand_out":
            last = [next(fresh) for _ in range(arg)]
            pages.hand_out(packed(last))
            model.update(last)
            continue
        chosen = last if op == "last_batch" else [pool[i % len(pool)] for i in arg]
        before = sorted(model)
        if op == "release":
            pages.release(chosen)
            model.difference_update(chosen)
        elif op == "check":
            ok = len(set(chosen)) == len(chosen) and model.issuperset(chosen)
            if ok:
                pages.check(chosen)
            else:
                with pytest.raises(BadIndices):
                    pages.check(chosen)
        else:
            expected = model_take(model, chosen)
            take = pages.take if op == "take" else (lambda p: pages.take_packed(packed(p)))
            if expected:
                take(chosen)
            else:
                with pytest.raises(BadIndices):
                    take(chosen)
                assert sorted(model) == before  # refused: nothing changed
        assert len(pages) == len(model) and bool(pages) == bool(model)
        assert sorted(pages.copy()) == sorted(model)  # first: a copy made while a batch is kept
        assert sorted(pages) == sorted(model)  # reads merge the batch into the set
        assert all(p in pages for p in model) and 0 not in pages


def test_the_last_batch_is_taken_whole_and_its_pages_are_gone():
    pages = EnginePages()
    pages.hand_out(packed([7, 3, 5]))
    pages.take_packed(packed([7, 3, 5]))
    assert len(pages) == 0 and not pages and 7 not in pages
    with pytest.raises(BadIndices, match="not handed out"):
        pages.take_packed(packed([7, 3, 5]))  # taken already: refused, whatever the form


def test_a_batch_in_another_order_or_in_part_is_checked_page_by_page():
    pages = EnginePages()
    pages.hand_out(packed([1, 2, 3, 4]))
    pages.take_packed(packed([2, 1]))  # part of it, reordered
    assert sorted(pages) == [3, 4]
    with pytest.raises(BadIndices, match="twice"):
        pages.take_packed(packed([3, 3]))
    assert sorted(pages) == [3, 4]


def test_copies_are_independent():
    pages = EnginePages()
    pages.hand_out(packed([1, 2]))
    twin = pages.copy()
    pages.take_packed(packed([1, 2]))
    assert sorted(twin) == [1, 2] and not pages
    twin.clear()
    assert not twin and len(twin) == 0
