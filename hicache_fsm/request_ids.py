"""A request's token ids as the cache's calls take them: checked and packed once, and a miss reads one page.

``HiCache.match_prefix`` and ``insert`` take ids in whatever form the engine
holds them (a tuple, a list, an integer array or tensor, or a ``TokenIds``).
``RequestIds`` turns them into what the call needs: ``packed`` checks and
packs a whole request, remembering the last tuple's or list's ids, and the
last integer array's, so that ``insert`` after ``match_prefix`` of the same
ids (in the same object or another) packs nothing again, and ids grown by
decoding have only the new ones packed; ``match_walk`` walks the tree for
``match_prefix`` reading, and so checking, only the first page of a request
that no cached prefix begins with. A packing ``match_prefix`` made that no
``insert`` has used yet is kept when the next request replaces it, a bounded
number of them (``EarlierPackings``): a scheduler matches a whole batch before
it inserts any of it. An engine that inserts each request right after its
match never fills that table, and pays nothing for it.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import TYPE_CHECKING, Hashable

from hicache_fsm.tokens import (
    TokenIds,
    array_head_bytes,
    check_id_array,
    checked_id_bytes,
    id_array,
    id_array_head_bytes,
    pack_id_array,
    pack_token_ids,
)

if TYPE_CHECKING:
    import numpy as np

    from hicache_fsm.radix import TreeNode
    from hicache_fsm.residency_driver import ResidencyDriver


EARLIER_REQUESTS = 32  # requests remembered besides the last: a batch matched before its inserts
EARLIER_BYTES = 8 << 20  # and at most this much memory held for them (ids copied and packed)


class EarlierPackings(OrderedDict):
    """Packings of requests packed before the last one, oldest dropped first beyond a count or a size.

    Key -> (entry, its bytes), oldest first (an OrderedDict drops its oldest
    in O(1); a dict used as a queue scans the slots its deletions left at its
    front). ``take`` hands an entry back and forgets it (the caller checks
    that the ids did not change, and makes it the last one again); ``keep``
    adds one. Empty, it is false (a C-level test: the hot path asks first).
    """

    def __init__(self, count: int = EARLIER_REQUESTS, max_bytes: int = EARLIER_BYTES) -> None:
        super().__init__()
        self.count, self.max_bytes = count, max_bytes
        self.bytes = 0

    def take(self, key: Hashable) -> tuple | None:
        kept = self.pop(key, None)
        if kept is None:
            return None
        self.bytes -= kept[1]
        return kept[0]

    def keep(self, key: Hashable, entry: tuple, size: int) -> None:
        if not self.count or size > self.max_bytes:  # nothing is kept, or not this one
            return
        old = self.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        self[key] = (entry, size)
        self.bytes += size
        while len(self) > self.count or self.bytes > self.max_bytes:
            self.bytes -= self.popitem(last=False)[1][1]


class RequestIds:
    """Checks and packs the ids each call reads; remembers the tuples and lists, and the integer arrays' ids, it
    packed whole: the last one of each, and a bounded number before it that no insert used yet
    (``EarlierPackings``)."""

    def __init__(self, driver: "ResidencyDriver", page_size: int) -> None:
        self.driver = driver
        self.page_size = page_size
        self._memo: tuple = ()  # () or (the tuple or list, a list's items as a tuple, its packing)
        # () or (an integer array's dtype, a copy of its bytes, their packing, the array.array's typecode or None,
        # its _array_key or None)
        self._array_memo: tuple = ()
        self._memo_used = self._array_memo_used = False  # whether an insert read the last packing of its kind
        self._earlier = EarlierPackings()  # _items_key -> its memo, for tuples and lists packed before the last
        self._earlier_arrays = EarlierPackings()  # _array_key -> its memo, for arrays packed before the last

    def keep_earlier(self, count: int, max_bytes: int = EARLIER_BYTES) -> None:
        """Keep at most ``count`` packings no insert used yet, and ``max_bytes`` of them (0: none; a match of a
        request packed before the last then packs it afresh). Forgets those kept so far."""
        self._earlier = EarlierPackings(count, max_bytes)
        self._earlier_arrays = EarlierPackings(count, max_bytes)

    def packed(self, tokens: object, used: bool = True) -> TokenIds:
        """``tokens`` checked and packed once (``BadTokenIds`` names the first bad one); see ``_packed``.

        ``used``: whether an insert reads this packing (``insert``: True).
        ``match_prefix`` passes False: its packing is kept for the insert to
        come, among the earlier ones if another request is packed first. One
        an insert used is not kept once the next request replaces it.
        """
        kind = type(tokens)
        if kind is array:  # SGLang's form: the last array's ids compared without a numpy view of this one
            seen = self._array_memo
            if seen and seen[3] == tokens.typecode and seen[1].startswith(tokens):
                if used:
                    self._array_memo_used = True
                n = len(tokens)
                return seen[2] if n << 2 == len(seen[2].raw) else seen[2][:n]
        packed = self._packed(tokens)
        if used:
            if kind is tuple or kind is list:
                self._memo_used = True
            elif kind is not TokenIds:
                self._array_memo_used = True
        return packed

    def _packed(self, tokens: object) -> TokenIds:
        """``tokens`` checked and packed once (``BadTokenIds`` names the first bad one).

        The last tuple or list packed is remembered, so ``insert`` after
        ``match_prefix`` of the same ids packs nothing again: the same tuple
        by identity (it is immutable); a list, or another tuple, by comparing
        its items with a snapshot of the last one's (``_from_last``): a
        tuple, compared as a list again where a list is handed (a list's
        ``==`` looks at item pointers before values: about 7 us with that
        copy, against 15-40 us to pack 4,096 ids). The snapshot costs the
        packing nothing: ``struct`` takes a tuple's items as they are, where
        a list handed to it is first copied into a tuple. The same ids (the
        same list unchanged, or one built anew for each call), the first of
        them, or them and more (grown by decoding) reuse the packing; an
        item equal to the packed id (``True`` for 1) counts as that id. A ``TokenIds`` is already packed. An integer
        ``array.array``, numpy array or tensor is compared by its bytes with
        the last one packed whole (``packed_ids``), so any array of the same
        ids reuses that packing, changes made through a view included.
        Tuples, lists and arrays packed before the last and not used by an
        insert yet are looked up among the earlier ones (``EarlierPackings``):
        by length and last id, then their items or bytes compared.
        """
        memo = self._memo
        if memo and tokens is memo[0] and memo[1] is None:  # the same tuple: it cannot have changed
            return memo[2]
        kind = type(tokens)
        if kind is not tuple and kind is not list and kind is not TokenIds:
            ids = id_array(tokens)
            if ids is not None:
                return self.packed_ids(ids, tokens.typecode if kind is array else None)
        if kind is tuple or kind is list:
            if memo:  # the last one's ids, the first of them, or them and more, in another (or a changed) object?
                packed = self._from_last(tokens, memo)
                if packed is not None:
                    return packed
            if self._earlier:  # one packed before the last, holding the same ids?
                key = _items_key(tokens)
                earlier = self._earlier.take(key) if key is not None else None
                if earlier is not None and _same_items(tokens, _snapshot(earlier)):
                    self._remember((tokens, None if kind is tuple else _snapshot(earlier), earlier[2]))
                    return earlier[2]
        if kind is list:
            snapshot = tuple(tokens)  # compared at the next call
            ids = pack_token_ids(snapshot)
            self._remember((tokens, snapshot, ids))
            return ids
        ids = pack_token_ids(tokens)
        if kind is tuple:
            self._remember((tokens, None, ids))
        return ids

    def _remember(self, memo: tuple) -> None:
        """Make ``memo`` (a tuple's or list's) the last one; the one it replaces joins the earlier ones unless an
        insert used it."""
        last = self._memo
        if last and last[0] is not memo[0] and not self._memo_used:
            key = _items_key(_snapshot(last))
            if key is not None:  # no ids: nothing to keep
                # held: the ids' pointers (the engine's object, kept alive), a list's snapshot, the packing
                self._earlier.keep(key, last, (5 if last[1] is not None else 3) * len(last[2].raw))
        self._memo, self._memo_used = memo, False

    def _from_last(self, tokens: list | tuple, memo: tuple) -> TokenIds | None:
        """The packing of a tuple or list holding the ids of the last one packed (``memo``), the first of them, or
        them and more (only the new ids checked and packed, then remembered whole); None when they differ.

        An engine that builds a request's ids anew for each call (the
        prompt's list plus the output's) hands ``insert`` an equal list, not
        the one ``match_prefix`` packed, and a finished request's list holds
        the decoded ids besides. Comparing its items with the last one's
        (pointers first: about 7 us for 4,096 ids) replaces packing them
        (about 25 us). Items are compared only when the first and the last
        ids both hold are equal, so another request costs two item reads.
        """
        snapshot = _snapshot(memo)
        known, n = len(snapshot), len(tokens)
        shared = min(known, n)
        try:
            if not shared or tokens[shared - 1] != snapshot[shared - 1] or tokens[0] != snapshot[0]:
                return None
        except Exception:  # an item whose comparison raises: packing names it
            return None
        if not _same_items(tokens if n <= known else tokens[:known], snapshot if n >= known else snapshot[:n]):
            return None
        packed = memo[2]
        if n <= known:
            return packed if n == known else packed[:n]
        packed = packed.extended(tokens[known:])  # a bad new id is named by its place in the whole
        self._memo_used = True  # the shorter ids begin these: not kept apart
        self._remember((tokens, None if type(tokens) is tuple else snapshot + tuple(tokens[known:]), packed))
        return packed

    def _remember_array(self, memo: tuple) -> None:
        """Make ``memo`` (an array's) the last one; the one it replaces joins the earlier ones unless an insert
        used it."""
        last = self._array_memo
        if last and last[4] is not None and last[4] != memo[4] and not self._array_memo_used:
            self._earlier_arrays.keep(last[4], last, len(last[1]) + len(last[2].raw))
        self._array_memo, self._array_memo_used = memo, False

    def match_walk(self, tokens: object, namespace: Hashable) -> tuple[list["TreeNode"], int]:
        """``match_prefix``'s walk (splitting a node matched in part) and the number of ids in ``tokens``.

        A miss is known from the first page (no cached prefix begins with it):
        that page is checked and packed, and nothing after it is read.
        Otherwise every id is checked and packed before the walk: a tuple or
        a list has its first page packed twice (about 1 us); an integer
        ``array.array`` (SGLang's scheduler form) has its first page checked
        and packed by C calls (``array_head_bytes``: 8-byte ids as words);
        another integer array or tensor has it checked on its raw bytes where
        its dtype allows (``id_array_head_bytes``: 4- and 8-byte native ids),
        else by ``check_id_array``; then every id is checked as it is packed
        (``checked_id_bytes``; none, when the array holds the ids last packed:
        ``packed_ids``).
        """
        driver = self.driver
        kind = type(tokens)
        if kind is TokenIds:
            return driver.walk_splitting(tokens, namespace)[0], len(tokens.raw) >> 2
        if kind is tuple or kind is list:
            memo = self._memo
            if not (memo and tokens is memo[0]) and not driver.may_match(
                namespace, pack_token_ids(tokens[: self.page_size]).raw
            ):
                return [], len(tokens)
        else:
            head = array_head_bytes(tokens, self.page_size) if kind is array else None  # SGLang's form
            if head is not None and not driver.may_match(namespace, head):
                return [], len(tokens)
            ids = id_array(tokens)
            if ids is not None:  # an integer array or tensor: checked and packed by vectorised passes
                if head is None and not driver.may_match(namespace, self._first_page(ids)):
                    return [], len(ids)
                code = tokens.typecode if kind is array else None
                return driver.walk_splitting(self.packed_ids(ids, code), namespace)[0], len(ids)
        packed = self.packed(tokens, used=False)
        return driver.walk_splitting(packed, namespace)[0], len(packed.raw) >> 2  # a bad namespace fails first

    def packed_ids(self, ids: "np.ndarray", typecode: str | None = None) -> TokenIds:
        """An array from ``id_array``, checked and packed, or the packing of the last array packed whole when its
        bytes hold the same ids or begin with them (a page-aligned slice); ids that extend it (a request grown by
        decoding) have only the new ones checked and packed, and are remembered in its place.

        ``insert`` after ``match_prefix`` of the same ids (the same array or
        an equal one, as SGLang's scheduler hands a slice of the ids it
        matched) then packs nothing again. The comparison is one ``memcmp``
        of the array's own memory with a copy of the last one's, taken when
        it was packed: under 0.5 us each for 4,096 int64 ids, where checking
        and packing them takes about 5 us warm and 9 us in ``bench insert``'s
        cold conditions. The same bytes of another dtype, a non-contiguous
        view, or any changed id is packed anew; what is compared is the
        memory as it is now, so no change can go unseen. ``typecode``: that
        of the ``array.array`` ``ids`` views (``packed`` then compares the
        next array of that code with no view made), None for another form.
        """
        memo = self._array_memo
        # a strided view has no one run of bytes to compare or copy (an array.array's view is one run)
        contiguous = typecode is not None or ids.flags.c_contiguous
        if memo and contiguous and ids.dtype == memo[0]:
            seen, packed = memo[1], memo[2]
            if seen.startswith(ids):  # the same ids, or the first of them
                n = ids.size
                return packed if n << 2 == len(packed.raw) else packed[:n]
            known = len(seen) // ids.itemsize
            if ids.size > known and seen.startswith(ids[:known]):  # the same ids, then more
                packed = packed.extended(ids[known:])  # a bad new id is named by its place in the whole
                self._remember_array((ids.dtype, ids.tobytes(), packed, typecode, _array_key(ids)))
                return packed
        key = _array_key(ids) if contiguous and ids.size else None
        if key is not None and self._earlier_arrays:  # one packed before the last: the same length, last id, bytes
            earlier = self._earlier_arrays.take(key)
            if earlier is not None and earlier[0] == ids.dtype and earlier[1].startswith(ids):
                self._remember_array(earlier[:3] + (typecode, key))
                return earlier[2]
        packed = TokenIds(checked_id_bytes(ids))
        if contiguous:
            self._remember_array((ids.dtype, ids.tobytes(), packed, typecode, key))
        return packed

    def _first_page(self, ids: "np.ndarray") -> bytes:
        """The first page of an array from ``id_array``, checked and packed: on its raw bytes where its dtype
        allows, else by the vectorised check, which names a bad id."""
        head = id_array_head_bytes(ids, self.page_size)
        if head is None:  # another dtype, or a bad id in the first page
            first_page = ids[: self.page_size]
            check_id_array(first_page)
            head = pack_id_array(first_page).raw
        return head


def _snapshot(memo: tuple) -> tuple:
    """The ids a remembered tuple or list was packed from, as a tuple (a tuple is its own)."""
    return memo[0] if memo[1] is None else memo[1]


def _same_items(tokens: list | tuple, snapshot: tuple) -> bool:
    """Whether ``tokens`` holds ``snapshot``'s ids: equal items, compared pointer first (a list's ``==`` takes
    a list). False when an item's comparison raises: packing then names it."""
    try:
        return tokens == snapshot if type(tokens) is tuple else tokens == list(snapshot)
    except Exception:
        return False


def _items_key(tokens: list | tuple) -> tuple[int, int] | None:
    """How a tuple's or list's packing is found among the earlier ones: its length and last id (None when it has
    no hashable last item)."""
    try:
        return len(tokens), hash(tokens[-1])
    except Exception:  # empty, or an unhashable last item: packing names it
        return None


def _array_key(ids: "np.ndarray") -> tuple[int, int]:
    """How a non-empty array's packing is found among the earlier ones: its length in bytes and its last id."""
    return ids.nbytes, ids.item(-1)
