"""Page allocators: token slots handed out and taken back in whole pages.

A slot index names one token of a pool; a page ``p`` owns slots
``p * page_size .. (p + 1) * page_size - 1``. Index tensors are always int64
on the CPU. ``PageAllocator`` is what every pool (``hicache_fsm.pools``) and
the cache's slot checks use; ``pages_of`` turns slot indices into page ids.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from hicache_fsm.errors import AllocationError, BadIndices, ConfigError
from hicache_fsm.sole_user import SoleUser

PAGE_ID_DTYPE = np.dtype(np.int64)  # page ids as this allocator hands them out and tree nodes keep them, packed

# What the allocator itself keeps: the slot-id table (one int64 a token), and per page an ownership flag and a
# free-list entry (a bool and an int64).
TABLE_BYTES_PER_TOKEN = 8
TABLE_BYTES_PER_PAGE = 9


def as_index_tensor(indices, what: str = "indices") -> torch.Tensor:
    if not isinstance(indices, torch.Tensor):
        try:
            items = list(indices)
            # the items' own type decides: a float or bool is refused below, never truncated to an index
            indices = torch.as_tensor(items) if items else torch.empty(0, dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError) as exc:  # RuntimeError: an int past 64 bits
            raise BadIndices(f"{what}: cannot be read as int64 indices: {exc}") from None
    if indices.dtype != torch.int64:
        if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
            raise BadIndices(f"{what}: expected an integer tensor, got {indices.dtype}")
        indices = indices.to(torch.int64)
    if indices.dim() != 1:
        raise BadIndices(f"{what}: expected a 1-D tensor, got shape {tuple(indices.shape)}")
    if indices.device.type != "cpu":
        indices = indices.cpu()
    return indices


def page_ids_array(indices, page_size: int, limit_tokens: int | None = None, what: str = "indices") -> np.ndarray:
    """Page ids of page-aligned token indices as an int64 numpy array (raises BadIndices otherwise).

    Checks that the length is a page multiple and that each group of
    ``page_size`` indices is one whole page in order; with ``limit_tokens``,
    also that every index is in ``[0, limit_tokens)``. The checks run in
    numpy (a view of the tensor's memory): each costs a microsecond or two
    where a torch op costs several, and executors check every batch.
    """
    idx = as_index_tensor(indices, what).numpy()
    n = idx.size
    if n % page_size:
        raise BadIndices(f"{what}: length {n} is not a multiple of page_size {page_size}")
    if n == 0:
        return idx[:0].copy()
    rows = idx.reshape(-1, page_size)
    first = rows[:, 0]
    if (first % page_size).any() or first.min() < 0:
        raise BadIndices(f"{what}: a page does not start on a page boundary")
    if page_size > 1 and not np.array_equal(rows[:, 1:], first[:, None] + np.arange(1, page_size)):
        raise BadIndices(f"{what}: a page's token indices are not one whole page in order")
    top = int(first.max())
    if limit_tokens is not None and top + page_size > limit_tokens:
        raise BadIndices(f"{what}: index {top + page_size - 1} is out of range (pool has {limit_tokens} slots)")
    return first // page_size


def pages_of(indices, page_size: int, limit_tokens: int | None = None, what: str = "indices") -> torch.Tensor:
    """``page_ids_array`` as an int64 tensor."""
    return torch.from_numpy(page_ids_array(indices, page_size, limit_tokens, what))


def physical_memory_bytes() -> int | None:
    """The machine's RAM (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_table_fits(size_tokens: int, page_size: int) -> None:
    """Refuse, before numpy tries, an allocator whose tables are larger than this machine's RAM.

    The bound is the physical memory, not what is free now: it never refuses a
    size the machine could hold (ten million slots take 80 MB), while a size past
    it would fail inside numpy with an untyped error, or be killed for memory.
    """
    need = size_tokens * TABLE_BYTES_PER_TOKEN + size_tokens // page_size * TABLE_BYTES_PER_PAGE
    have = physical_memory_bytes()
    if have is not None and need > have:
        raise ConfigError(f"not enough memory: a pool of {size_tokens} token slots needs {need / (1 << 30):.3g} GiB "
                          f"of slot tables, more than the {have / (1 << 30):.3g} GiB of memory this machine has")


class _CheckScratch:
    """Reused buffers of ``PageAllocator.whole_pages``, viewed for the last page count.

    Requests of one size repeat, so the views are made once per size change,
    and the buffers only grow. The expected slots live in ``memory`` (a
    bytearray the views share), so a contiguous tensor is compared with them
    by one ``memcmp`` (``bytearray.startswith``) instead of two ufunc passes.
    """

    __slots__ = ("pages", "expected", "expected_flat", "matches", "memory", "_rows", "_bools")

    def __init__(self, page_size: int) -> None:
        self.memory = bytearray()
        self._rows = np.empty((0, page_size), dtype=np.int64)
        self._bools = np.empty(0, dtype=bool)
        self.view(0)

    def view(self, pages: int) -> None:
        if pages > self._rows.shape[0]:
            page_size = self._rows.shape[1]
            self.memory = bytearray(pages * page_size * 8)  # a new one: the old is exported to its views
            self._rows = np.frombuffer(self.memory, dtype=np.int64).reshape(pages, page_size)
            self._bools = np.empty(self._rows.size, dtype=bool)
        self.pages = pages
        self.expected = self._rows[:pages]
        self.expected_flat = self.expected.reshape(-1)
        self.matches = self._bools[: self.expected.size]


class PageAllocator:
    """Page-granular allocator of token-slot indices.

    Free pages are an array (initially sorted) plus a list of released
    batches. Allocation takes from the front of the free array; only when it
    runs short are the released pages sorted and appended after what is left.
    So fresh pools hand out low page ids in order, while after churn a request
    can get e.g. the tail of one sorted segment then low ids of the next: not
    always contiguous, as in a real serving engine. A bool array tracks
    ownership for validation. The bookkeeping is numpy (a few microseconds
    per call, against tens for the same torch ops on tiny tensors); callers
    get torch tensors sharing that memory.

    With ``views=True`` an allocation that is one run of consecutive pages
    is returned as a view of the allocator's slot-id table instead of a
    copy: no table read, no fresh tensor. The caller must then never write
    to the returned tensor. The host pool uses it, since host indices stay
    inside the cache; engine-facing device slots are always copies.
    """

    def __init__(self, size_tokens: int, page_size: int, *, views: bool = False, reserved_pages: int = 0) -> None:
        for name, value in (("size_tokens", size_tokens), ("page_size", page_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if size_tokens % page_size:
            raise ConfigError(f"size_tokens {size_tokens} is not a multiple of page_size {page_size}")
        if not isinstance(reserved_pages, int) or isinstance(reserved_pages, bool) \
                or not 0 <= reserved_pages < size_tokens // page_size:
            raise ConfigError(f"reserved_pages must be an int from 0 to {size_tokens // page_size - 1} (at least "
                              f"one page must be left to hand out), got {reserved_pages!r}")
        check_table_fits(size_tokens, page_size)
        self.size_tokens = size_tokens
        self.page_size = page_size
        self._total_pages = size_tokens // page_size
        # The first pages, never handed out, freed or counted as used: an engine's own (SGLang writes the
        # padding of its CUDA graphs to page 0), so that slot t stays row t of the engine's buffers.
        self.reserved_pages = reserved_pages
        self.views = views
        self.serving = SoleUser()  # the one open cache whose slots these are (bind_cache)
        # Slot ids of every page, a row each (8 bytes a token): gathering rows
        # builds and checks index tensors ~3x faster than broadcasting arithmetic.
        # The numpy table and the torch one (sliced by ``views``) share memory;
        # numpy allocates it, asking for huge pages (a gather here misses the TLB less).
        table = np.arange(size_tokens, dtype=np.int64)
        self._slot_ids = torch.from_numpy(table)
        table.flags.writeable = False
        self._page_slots = table.reshape(-1, page_size)
        self._scratch = _CheckScratch(page_size)  # whole_pages buffers
        # a page size that is a power of two divides slot ids by a shift (a negative id floors alike: -1 >> 6 = -1);
        # each operand is a 0-d int64 array: numpy 2 resolves a Python int operand's type on every call (0.5 us more)
        power_of_two = page_size & (page_size - 1) == 0
        self._page_shift = np.array(page_size.bit_length() - 1, dtype=np.int64) if power_of_two else None
        self._page_divisor = None if power_of_two else np.array(page_size, dtype=np.int64)
        self.reset()

    def reset(self) -> None:
        """Free every page (but the reserved ones, which are never handed out)."""
        self._allocated = np.zeros(self._total_pages, dtype=bool)
        self._free = np.arange(self.reserved_pages, self._total_pages, dtype=np.int64)
        self._free_ascending = True  # kept by every claim: the rest of an ascending array is ascending
        self._released: list[np.ndarray] = []
        self._num_free = self._total_pages - self.reserved_pages

    @property
    def total_pages(self) -> int:
        return self._total_pages

    @property
    def free_pages(self) -> int:
        return self._num_free

    @property
    def used_pages(self) -> int:
        return self._total_pages - self.reserved_pages - self._num_free

    @property
    def available_tokens(self) -> int:
        return self._num_free * self.page_size

    @property
    def capacity_tokens(self) -> int:
        """The most tokens this allocator can ever hand out at once (its pages less the reserved ones)."""
        return (self._total_pages - self.reserved_pages) * self.page_size

    def fork(self) -> "PageAllocator":
        """An independent copy in the same state (the explorer forks caches): same free order, own arrays."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new._allocated = self._allocated.copy()
        new._released = list(self._released)
        new.serving = SoleUser()  # the fork's slots are its own: no cache serves them yet
        return new

    def bind_cache(self, cache: object) -> None:
        """Make ``cache`` the one cache these slots serve; ConfigError while another (not closed) does.

        Two open caches over one allocator would each free the other's slots
        (``reset`` frees them all) and hand them out again: KV served from a
        slot another request is writing. Slots an earlier cache held (closed,
        or dropped) are free again for the next: it starts with every page.
        """
        if self.serving.take(cache, ConfigError(
                "these pools already serve another HiCache (an open one, or a closed one whose storage thread "
                "is still inside a backend call): close it first, or give each cache pools of its own")):
            self.reset()

    def unbind_cache(self, cache: object) -> None:
        """``cache`` closed: the slots may serve another cache (another cache's binding is left as it is)."""
        self.serving.give_up(cache)

    def is_allocated(self, page: int) -> bool:
        if not 0 <= int(page) < self._total_pages:
            raise BadIndices(f"page {page} is out of range [0, {self._total_pages})")
        return bool(self._allocated[int(page)])

    def owned_pages(self) -> set[int]:
        """Ids of the allocated pages (for invariant checks)."""
        return set(np.flatnonzero(self._allocated).tolist())

    def owned_page_array(self) -> np.ndarray:
        """``owned_pages`` as an ascending int64 array (invariant checks of a million pages)."""
        return np.flatnonzero(self._allocated).astype(np.int64, copy=False)

    def hand_out_order(self) -> tuple[int, ...]:
        """The free pages in the order ``alloc`` will hand them out (read only: nothing is merged).

        Model checkers key states on it: two allocators with the same free set but another
        order give later requests other slots.
        """
        free = [int(p) for p in self._free]
        if self._released:
            free += sorted(int(p) for p in np.concatenate(self._released))
        return tuple(free)

    def _free_array(self) -> np.ndarray:
        """Every free page id, in allocation order (released pages merged in)."""
        if self._released:
            batches = self._released
            released = batches[0] if len(batches) == 1 else np.concatenate(batches)
            released.sort()  # in place: a batch is a copy ``free_page_ids`` made (a fork may share it: order is moot)
            left = self._free
            self._free_ascending = self._free_ascending and (not left.size or left[-1] < released[0])
            self._free = np.concatenate([left, released]) if left.size else released
            self._released = []
        return self._free

    def _claim(self, pages: np.ndarray, remaining_free: np.ndarray, run: bool = False) -> None:
        """Mark ``pages`` allocated and keep ``remaining_free`` as the free list (in the order it had).

        ``run``: the caller knows ``pages`` are consecutive and ascending (a slice instead of a gather).
        """
        self._free = remaining_free
        self._num_free -= pages.size
        if run:
            first = int(pages[0])
            self._allocated[first : first + pages.size] = True
        else:
            self._allocated[pages] = True

    def _slots_of_claimed(self, pages: np.ndarray, run: bool) -> torch.Tensor:
        """Token indices of just-claimed ``pages``: with ``views``, a run is a view of the slot ids, not a copy."""
        if run and self.views:
            first, ps = int(pages[0]), self.page_size
            return self._slot_ids[first * ps : (first + pages.size) * ps]
        return torch.from_numpy(self._page_slots.take(pages, 0).ravel())

    def whole_pages(self, slots: np.ndarray) -> np.ndarray | None:
        """Page ids of int64 ``slots`` if they are whole pages of this allocator, else None.

        Whole pages means: each group of ``page_size`` slots is one page's slots
        in order, and every page is in range. This runs on every engine index
        tensor, so it allocates nothing large: fresh temporaries of tens of KB
        per call cost more in page faults than the comparison itself. Not
        thread-safe (the cache calls it from the engine thread only).
        """
        ps = self.page_size
        if slots.size % ps:
            return None
        shift = self._page_shift
        pages = slots[::ps] >> shift if shift is not None else slots[::ps] // self._page_divisor
        n = pages.size
        scratch = self._scratch
        if scratch.pages != n:
            scratch.view(n)
        # "clip": an out-of-range id fetches an edge page's row, which cannot match (arguments positional: a
        # keyword costs numpy more than the gather of a few pages)
        self._page_slots.take(pages, 0, scratch.expected, "clip")
        try:  # native int64 both: equal bytes are equal slots (the expected ones are the prefix of ``memory``)
            return pages if scratch.memory.startswith(slots) else None
        except ValueError:  # not C-contiguous: no one run of bytes to compare
            pass
        np.equal(slots, scratch.expected_flat, out=scratch.matches)
        return pages if np.count_nonzero(scratch.matches) == slots.size else None  # measured faster than ``all()``

    def not_whole_pages_reason(self, slots: np.ndarray) -> str:
        """Why page-multiple ``slots`` failed ``whole_pages`` (the slow path of an error message)."""
        first = slots[:: self.page_size]
        if int(first.min()) < 0 or int(first.max()) + self.page_size > self.size_tokens:
            return f"are out of range: they must be whole pages within [0, {self.size_tokens})"
        return "are not whole pages: each page aligned, in order and contiguous"

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Token indices (int64, CPU) of ``num_tokens / page_size`` free pages, or None if too few."""
        taken = self.alloc_with_page_ids(num_tokens)
        return None if taken is None else taken[0]

    def alloc_with_page_ids(self, num_tokens: int) -> tuple[torch.Tensor, np.ndarray] | None:
        """``alloc``, and the page ids it claimed (int64): for holders that track the pages of the slots they hand
        out (the page ids of the slots, computed again, would cost a numpy view and a division)."""
        taken = self._take_pages(num_tokens)
        if taken is None:
            return None
        pages, run = taken
        return self._slots_of_claimed(pages, run), pages

    def alloc_page_ids(self, num_tokens: int) -> np.ndarray | None:
        """``alloc``, as the page ids claimed (int64) instead of slot indices: for holders that keep page ids."""
        taken = self._take_pages(num_tokens)
        return None if taken is None else taken[0]

    def _take_pages(self, num_tokens: int) -> tuple[np.ndarray, bool] | None:
        """Claim the first ``num_tokens / page_size`` free pages (None if too few); whether they are one run."""
        if type(num_tokens) is not int and (not isinstance(num_tokens, int) or isinstance(num_tokens, bool)) \
                or num_tokens < 0:
            raise BadIndices(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        need, rest = divmod(num_tokens, self.page_size)
        if rest:
            raise BadIndices(f"num_tokens {num_tokens} is not a multiple of page_size {self.page_size}")
        if need > self._num_free:
            return None
        free = self._free
        short = need > free.size
        if short:
            free = self._free_array()  # the rest, then the sorted released pages
        pages = free[:need]
        # from an ascending free array, ``need`` pages spanning ``need`` ids are one run
        run = bool(need) and self._free_ascending and int(free[need - 1]) - int(free[0]) == need - 1
        self._claim(pages, free[need:], run)
        if short:
            self._free_ascending = True  # the claim took all the old rest: a tail of the sorted released pages is left
        return pages, run

    def slot_tensor(self, pages: np.ndarray) -> torch.Tensor:
        """The token indices (a fresh int64 tensor) of page ids of this allocator, page by page."""
        return torch.from_numpy(self._page_slots.take(pages, 0).ravel())  # positional: a keyword costs ~0.3 us

    def free_packed_pages(self, pages: bytes) -> None:
        """``free_page_ids`` of page ids packed as native int64 ``bytes`` (what a tree node keeps)."""
        self.free_page_ids(np.frombuffer(pages, PAGE_ID_DTYPE))

    def free_page_ids(self, pages: np.ndarray) -> None:
        """Return pages by id (int64 ids of this allocator, each named once: what ``alloc_page_ids`` gave).

        For holders that keep page ids (tree nodes): no slot checks, only that
        every page is held, so a double free still raises and frees nothing.
        """
        if pages.size == 0:
            return
        held = self._allocated[pages]
        if np.count_nonzero(held) != pages.size:  # measured faster than ``all()``
            bad = pages[~held][:8].tolist()
            raise AllocationError(f"free: page(s) {bad} are not allocated (double free?)")
        self._allocated[pages] = False
        self._released.append(pages.copy())
        self._num_free += pages.size

    def _pages_to_free(self, indices) -> np.ndarray:
        if isinstance(indices, torch.Tensor) and indices.dtype == torch.int64 and indices.dim() == 1 and indices.device.type == "cpu":
            arr = indices.numpy()
        else:
            try:
                arr = as_index_tensor(indices, "free").numpy()
            except BadIndices as exc:
                raise AllocationError(str(exc)) from None
        ps = self.page_size
        if arr.size % ps:
            raise AllocationError(f"free: length {arr.size} is not a multiple of page_size {ps}")
        pages = self.whole_pages(arr)
        if pages is None:
            raise AllocationError(f"free: indices {self.not_whole_pages_reason(arr)}")
        return pages

    def free(self, indices) -> None:
        """Return whole pages; validates everything first, so a bad call frees nothing."""
        pages = self._pages_to_free(indices)
        if pages.size == 0:
            return
        # strictly ascending (the common case: pages handed out from sorted free runs) has no repeat
        if pages.size > 1 and not (pages[1:] > pages[:-1]).all() and np.unique(pages).size != pages.size:
            raise AllocationError("free: the same page appears twice in one call")
        self.free_page_ids(pages)


__all__ = [
    "PAGE_ID_DTYPE", "PageAllocator", "as_index_tensor", "check_table_fits", "page_ids_array", "pages_of",
    "physical_memory_bytes",
]
