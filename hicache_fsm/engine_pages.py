"""The device pages the engine holds: handed out by ``alloc_device``, not yet inserted or freed.

An engine inserts what it was handed: a request's new pages are, in order,
the pages of the ``alloc_device`` call just before. So the last batch handed
out is kept whole, as its packed page ids, beside a set of the others: an
``insert`` of exactly that batch checks and takes it with one comparison of
bytes, where a set costs a lookup and a removal per page (and the handing
out costs it an insertion per page). Any other use merges the batch into the
set first (reads too, but ``len`` and ``bool``). Invariant: the batch, when
there is one, is held whole, its pages distinct and none of them in the set.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np

from hicache_fsm.allocator import PAGE_ID_DTYPE
from hicache_fsm.errors import BadIndices


class EnginePages:
    """Page ids the engine holds; ``BadIndices`` (nothing changed) for a page it does not hold or names twice."""

    __slots__ = ("_held", "_batch")

    def __init__(self, held: Iterable[int] = ()) -> None:
        self._held: set[int] = set(held)
        self._batch: bytes | None = None  # the last batch handed out, packed as nodes keep page ids

    def hand_out(self, pages: bytes) -> None:
        """The engine now holds ``pages`` (packed page ids of one ``alloc_device``: distinct, held by nobody)."""
        if not pages:
            return
        if self._batch is not None:
            self._merge()
        self._batch = pages

    def take_packed(self, pages: bytes) -> None:
        """Check, then release, the packed page ids ``pages``: the cache holds them from now on."""
        if not pages:
            return
        if pages == self._batch:  # the last batch, whole and in order
            self._batch = None
            return
        self.take(np.frombuffer(pages, dtype=PAGE_ID_DTYPE).tolist())

    def take(self, pages: list[int]) -> None:
        """``check``, then ``pages`` leave: the cache holds them from now on.

        A subset test and the removal the insert makes anyway cost about half
        the intersection the check alone builds. A page named twice shows as a
        removal short of ``len(pages)``: every page was held, so all go back
        before the check names the fault (the pages are as they were).
        """
        self._merge()
        held = self._held
        if held.issuperset(pages):
            before = len(held)
            held.difference_update(pages)
            if before - len(held) == len(pages):
                return
            held.update(pages)
        self.check(pages)

    def check(self, pages: list[int]) -> None:
        """Every page is held, none named twice (nothing changes)."""
        self._merge()
        held = self._held
        if len(held.intersection(pages)) == len(pages):  # all held, none twice
            return
        if len(set(pages)) != len(pages):
            raise BadIndices("device indices name the same page twice")
        foreign = [p for p in pages if p not in held]
        raise BadIndices(
            f"device pages {foreign[:8]} were not handed out by alloc_device (or were already inserted or freed)"
        )

    def release(self, pages: Iterable[int]) -> None:
        """``pages`` leave, unchecked (the caller checked them): revived or freed by the cache."""
        self._merge()
        self._held.difference_update(pages)

    def copy(self) -> "EnginePages":
        twin = EnginePages(self._held)
        twin._batch = self._batch  # bytes: shared, never changed
        return twin

    def clear(self) -> None:
        self._held.clear()
        self._batch = None

    def __contains__(self, page: object) -> bool:
        self._merge()
        return page in self._held

    def __iter__(self) -> Iterator[int]:
        self._merge()
        return iter(self._held)

    def __len__(self) -> int:
        return len(self._held) + (0 if self._batch is None else len(self._batch) // PAGE_ID_DTYPE.itemsize)

    def __bool__(self) -> bool:
        return bool(self._held) or bool(self._batch)

    def _merge(self) -> None:
        batch = self._batch
        if batch is not None:
            self._held.update(np.frombuffer(batch, dtype=PAGE_ID_DTYPE).tolist())
            self._batch = None


__all__ = ["EnginePages"]
