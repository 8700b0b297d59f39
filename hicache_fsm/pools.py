"""KV memory pools: page allocators, the device (L1) pool and the host (L2) pool.

Token slots are handed out in whole pages. A slot index names one token of the
pool; a page ``p`` owns slots ``p * page_size .. (p + 1) * page_size - 1``.
Index tensors are always int64 on the CPU.

A token's KV has ``parts`` parts per layer: K and V (2), or for MLA models one
latent vector (1; ``KVShape.mla``). Below, ``P`` is the number of parts.

Device pool memory, either allocated by the pool (one tensor ``kv`` of shape
(P, layers, tokens, heads, head_dim); ``k`` and ``v`` are its halves) or adopted
from an engine without a copy (``hicache_fsm.engine_kv``: per-layer buffers in
the engine's own layout and strides; ``kv`` is then None). Either way
``layer_pages(layer)`` gives, per part, a (pages, page_size, heads, head_dim)
view of the memory, which is what copies use.

Host pool layouts (``HostKVPool.kv``):

* ``layer_first``        (P, layers, tokens, heads, head_dim)
* ``page_first``         (P, tokens, layers, heads, head_dim)
* ``page_first_direct``  (P, pages, layers, page_size, heads, head_dim)

Page byte format (``read_page`` / ``write_page`` / ``page_views``): the K bytes
of the page, then the V bytes (MLA: the latent bytes), each in the host layout's own element order
(layer_first: layer by layer, each layer's ``page_size`` tokens; page_first:
token by token, all layers of each token; page_first_direct: layer by layer).
The format therefore depends on the layout, as it does upstream; stored pages
record it (:mod:`hicache_fsm.storage.page_format`), so a reader in another
format gets a miss, never these bytes.
"""

from __future__ import annotations

import os
import warnings
import attrs
import numpy as np
import torch

from hicache_fsm.adoption import check_adoption
from hicache_fsm.errors import AllocationError, BadIndices, ConfigError

LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def _positive(instance, attribute, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{attribute.name} must be a positive int, got {value!r}")


def _is_dtype(instance, attribute, value) -> None:
    if not isinstance(value, torch.dtype):
        raise ConfigError(f"{attribute.name} must be a torch.dtype, got {value!r}")


def _is_bool(instance, attribute, value) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{attribute.name} must be a bool, got {value!r}")


@attrs.frozen
class KVShape:
    """Shape of one model's KV cache: per token, K and V of every layer.

    ``mla``: a multi-head latent attention model, which caches one latent
    vector per token and layer instead of K and V (``heads`` is then 1 and
    ``head_dim`` is kv_lora_rank + qk_rope_head_dim).
    """

    layers: int = attrs.field(validator=_positive)
    heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    dtype: torch.dtype = attrs.field(default=torch.float32, validator=_is_dtype)
    mla: bool = attrs.field(default=False, validator=_is_bool, kw_only=True)

    @property
    def parts(self) -> int:
        """Tensors per token and layer: 2 (K and V), or 1 (the MLA latent)."""
        return 1 if self.mla else 2

    @property
    def elem_bytes(self) -> int:
        return self.dtype.itemsize

    @property
    def token_bytes(self) -> int:
        """Bytes of K plus V (MLA: the latent) for one token over all layers."""
        return self.parts * self.layers * self.heads * self.head_dim * self.elem_bytes


def _as_index_tensor(indices, what: str = "indices") -> torch.Tensor:
    if not isinstance(indices, torch.Tensor):
        try:
            indices = torch.as_tensor(list(indices), dtype=torch.int64)
        except (TypeError, ValueError) as exc:
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


def pages_of(indices, page_size: int, limit_tokens: int | None = None, what: str = "indices") -> torch.Tensor:
    """Page ids of page-aligned token indices (raises BadIndices otherwise).

    Checks that the length is a page multiple and that each group of
    ``page_size`` indices is one whole page in order; with ``limit_tokens``,
    also that every index is in ``[0, limit_tokens)``.
    """
    idx = _as_index_tensor(indices, what)
    n = idx.numel()
    if n % page_size:
        raise BadIndices(f"{what}: length {n} is not a multiple of page_size {page_size}")
    if n == 0:
        return idx.new_empty(0)
    rows = idx.view(-1, page_size)
    first = rows[:, 0]
    if bool((first % page_size != 0).any()) or bool((first < 0).any()):
        raise BadIndices(f"{what}: a page does not start on a page boundary")
    if page_size > 1 and not torch.equal(rows, first[:, None] + torch.arange(page_size)):
        raise BadIndices(f"{what}: a page's token indices are not one whole page in order")
    if limit_tokens is not None and int(first.max()) + page_size > limit_tokens:
        raise BadIndices(f"{what}: index {int(first.max()) + page_size - 1} is out of range (pool has {limit_tokens} slots)")
    return first // page_size


class _CheckScratch:
    """Reused buffers of ``PageAllocator.whole_pages``, viewed for the last page count.

    Requests of one size repeat, so the views are made once per size change,
    and the buffers only grow.
    """

    __slots__ = ("pages", "expected", "expected_flat", "matches", "_rows", "_bools")

    def __init__(self, page_size: int) -> None:
        self._rows = np.empty((0, page_size), dtype=np.int64)
        self._bools = np.empty(0, dtype=bool)
        self.view(0)

    def view(self, pages: int) -> None:
        if pages > self._rows.shape[0]:
            self._rows = np.empty((pages, self._rows.shape[1]), dtype=np.int64)
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

    def __init__(self, size_tokens: int, page_size: int, *, views: bool = False) -> None:
        for name, value in (("size_tokens", size_tokens), ("page_size", page_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if size_tokens % page_size:
            raise ConfigError(f"size_tokens {size_tokens} is not a multiple of page_size {page_size}")
        self.size_tokens = size_tokens
        self.page_size = page_size
        self._total_pages = size_tokens // page_size
        self.views = views
        # Slot ids of every page, a row each (8 bytes a token): gathering rows
        # builds and checks index tensors ~3x faster than broadcasting arithmetic.
        # The numpy table and the torch one (sliced by ``views``) share memory;
        # numpy allocates it, asking for huge pages (a gather here misses the TLB less).
        table = np.arange(size_tokens, dtype=np.int64)
        self._slot_ids = torch.from_numpy(table)
        table.flags.writeable = False
        self._page_slots = table.reshape(-1, page_size)
        self._scratch = _CheckScratch(page_size)  # whole_pages buffers
        self.reset()

    def reset(self) -> None:
        """Free every page."""
        self._allocated = np.zeros(self._total_pages, dtype=bool)
        self._free = np.arange(self._total_pages, dtype=np.int64)
        self._free_ascending = True  # kept by every claim: the rest of an ascending array is ascending
        self._released: list[np.ndarray] = []
        self._num_free = self._total_pages

    @property
    def total_pages(self) -> int:
        return self._total_pages

    @property
    def free_pages(self) -> int:
        return self._num_free

    @property
    def used_pages(self) -> int:
        return self._total_pages - self._num_free

    @property
    def available_tokens(self) -> int:
        return self._num_free * self.page_size

    def fork(self) -> "PageAllocator":
        """An independent copy in the same state (the explorer forks caches): same free order, own arrays."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new._allocated = self._allocated.copy()
        new._released = list(self._released)
        return new

    def is_allocated(self, page: int) -> bool:
        if not 0 <= int(page) < self._total_pages:
            raise BadIndices(f"page {page} is out of range [0, {self._total_pages})")
        return bool(self._allocated[int(page)])

    def owned_pages(self) -> set[int]:
        """Ids of the allocated pages (for invariant checks)."""
        return set(np.flatnonzero(self._allocated).tolist())

    def _free_array(self) -> np.ndarray:
        """Every free page id, in allocation order (released pages merged in)."""
        if self._released:
            released = np.sort(np.concatenate(self._released))
            left = self._free
            self._free_ascending = self._free_ascending and (not left.size or left[-1] < released[0])
            self._free = np.concatenate([left, released]) if left.size else released
            self._released = []
        return self._free

    def _claim(self, pages: np.ndarray, remaining_free: np.ndarray, run: bool = False) -> torch.Tensor:
        """Mark ``pages`` allocated, keep ``remaining_free`` as the free list; token indices of ``pages``.

        ``remaining_free`` must keep the order it had in the free array.
        ``run``: the caller knows ``pages`` are consecutive and ascending.
        """
        self._free = remaining_free
        self._num_free -= pages.size
        if run:  # a slice instead of a gather, and (``views``) a view instead of a copy
            first = int(pages[0])
            self._allocated[first : first + pages.size] = True
            if self.views:
                ps = self.page_size
                return self._slot_ids[first * ps : (first + pages.size) * ps]
        else:
            self._allocated[pages] = True
        return torch.from_numpy(self._page_slots.take(pages, axis=0).reshape(-1))

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
        pages = slots[::ps] // ps
        n = pages.size
        scratch = self._scratch
        if scratch.pages != n:
            scratch.view(n)
        # "clip": an out-of-range id fetches an edge page's row, which cannot match
        self._page_slots.take(pages, axis=0, out=scratch.expected, mode="clip")
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
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
            raise BadIndices(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        if num_tokens % self.page_size:
            raise BadIndices(f"num_tokens {num_tokens} is not a multiple of page_size {self.page_size}")
        need = num_tokens // self.page_size
        if need > self._num_free:
            return None
        free = self._free
        short = need > free.size
        if short:
            free = self._free_array()  # the rest, then the sorted released pages
        # from an ascending free array, ``need`` pages spanning ``need`` ids are one run
        run = self._free_ascending and need > 0 and free[need - 1] - free[0] == need - 1
        indices = self._claim(free[:need], free[need:], run)
        if short:
            self._free_ascending = True  # the claim took all the old rest: a tail of the sorted released pages is left
        return indices

    def _pages_to_free(self, indices) -> np.ndarray:
        if isinstance(indices, torch.Tensor) and indices.dtype == torch.int64 and indices.dim() == 1 and indices.device.type == "cpu":
            arr = indices.numpy()
        else:
            try:
                arr = _as_index_tensor(indices, "free").numpy()
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
        if pages.size > 1 and np.unique(pages).size != pages.size:
            raise AllocationError("free: the same page appears twice in one call")
        held = self._allocated[pages]
        if not held.all():
            bad = pages[~held][:8].tolist()
            raise AllocationError(f"free: page(s) {bad} are not allocated (double free?)")
        self._allocated[pages] = False
        self._released.append(pages.copy())
        self._num_free += pages.size


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class DeviceKVPool:
    """The L1 pool: K and V (MLA: the latent) of every layer for ``size_tokens`` token slots.

    Built with the constructor, the pool allocates one buffer ``kv`` of shape
    (parts, layers, tokens, heads, head_dim); ``k = kv[0]`` and ``v = kv[1]``
    are each (layers, tokens, heads, head_dim) (``v`` is None for MLA). Built
    with ``adopt`` (through ``hicache_fsm.engine_kv``), it uses an engine's
    existing per-layer buffers as they are, and ``kv``, ``k`` and ``v`` are
    None. A draft pool may share the target pool's allocator (same slot
    indices), as upstream.
    """

    def __init__(self, shape: KVShape, size_tokens: int, page_size: int,
                 device: torch.device | str | None = None,
                 allocator: PageAllocator | None = None) -> None:
        device = torch.device(device) if device is not None else default_device()
        self._setup(shape, size_tokens, page_size, device, allocator)
        kv = torch.zeros((shape.parts, shape.layers, size_tokens, shape.heads, shape.head_dim),
                         dtype=shape.dtype, device=device)
        self._engine_pages = self._engine_buffers = None
        self.kv = kv
        self.k = kv[0]
        self.v = kv[1] if shape.parts == 2 else None

    @classmethod
    def adopt(cls, layer_pages: list[tuple[torch.Tensor, ...]], *, mla: bool = False,
              buffers: tuple[torch.Tensor, ...] = (), allocator: PageAllocator | None = None) -> DeviceKVPool:
        """A pool over memory an engine owns: no allocation, no copy.

        ``layer_pages[layer]`` holds, per part (K and V, or the MLA latent),
        a (pages, page_size, heads, head_dim) view of the engine's buffer, in
        any strides; ``buffers`` are the engine's tensors themselves (kept
        alive by the pool). ``hicache_fsm.engine_kv`` builds these for each
        engine layout. Raises ConfigError unless every view has the same
        shape, dtype and device.
        """
        check_adoption(layer_pages, mla=mla, buffers=buffers, allocator=allocator)
        parts = 1 if mla else 2
        if not layer_pages:
            raise ConfigError("adopt needs the views of at least one layer")
        first = layer_pages[0][0] if layer_pages[0] else None
        if not isinstance(first, torch.Tensor) or first.dim() != 4:
            raise ConfigError("each layer's views must be (pages, page_size, heads, head_dim) tensors")
        for layer, views in enumerate(layer_pages):
            if len(views) != parts:
                raise ConfigError(f"layer {layer}: expected {parts} view(s) (mla={mla}), got {len(views)}")
            for view in views:
                if not isinstance(view, torch.Tensor) or view.shape != first.shape or view.dtype != first.dtype \
                        or view.device != first.device:
                    raise ConfigError(
                        f"layer {layer}: every view must be a {tuple(first.shape)} {first.dtype} tensor on "
                        f"{first.device}, got {_describe(view)}")
        pages, page_size, heads, head_dim = first.shape
        if pages == 0:
            raise ConfigError("adopted buffers hold no page")
        shape = KVShape(len(layer_pages), heads, head_dim, first.dtype, mla=mla)
        pool = cls.__new__(cls)
        pool._setup(shape, pages * page_size, page_size, first.device, allocator)
        pool._engine_pages = [tuple(views) for views in layer_pages]
        pool._engine_buffers = tuple(buffers)
        pool.kv = pool.k = pool.v = None
        return pool

    def _setup(self, shape: KVShape, size_tokens: int, page_size: int, device: torch.device,
               allocator: PageAllocator | None) -> None:
        if allocator is None:
            allocator = PageAllocator(size_tokens, page_size)
        elif allocator.size_tokens != size_tokens or allocator.page_size != page_size:
            raise ConfigError("a shared allocator must have the pool's size_tokens and page_size")
        self.shape = shape
        self.page_size = page_size
        self.size_tokens = size_tokens
        self.allocator = allocator
        self.device = device

    @property
    def layers(self) -> int:
        return self.shape.layers

    @property
    def nbytes(self) -> int:
        return self.size_tokens * self.shape.token_bytes

    @property
    def adopted(self) -> bool:
        """True when the memory is an engine's (``adopt``), not one buffer of the pool's own."""
        return self.kv is None

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The tensors holding the KV: the pool's own ``kv``, or the engine's adopted buffers."""
        return (self.kv,) if self.kv is not None else self._engine_buffers

    def layer_pages(self, layer: int) -> tuple[torch.Tensor, ...]:
        """Per part, the (pages, page_size, heads, head_dim) view of one layer's memory."""
        if self.kv is None:
            return self._engine_pages[layer]
        pages = self.size_tokens // self.page_size
        return tuple(part[layer].unflatten(0, (pages, self.page_size)) for part in self.kv)

    def _index(self, indices) -> torch.Tensor:
        idx = _as_index_tensor(indices)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.size_tokens):
            raise BadIndices(f"indices out of range [0, {self.size_tokens})")
        return idx

    def write(self, indices, layer: int | None, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
        """Engine-side write of computed KV into token slots.

        With ``layer`` an int, ``k``/``v`` are (n, heads, head_dim); with
        ``layer=None`` they are (layers, n, heads, head_dim) for all layers.
        MLA pools take the latent as ``k`` and no ``v``.
        """
        idx = self._index(indices).to(self.device)
        hd = (self.shape.heads, self.shape.head_dim)
        if layer is None:
            want = (self.shape.layers, idx.numel(), *hd)
        else:
            if not 0 <= layer < self.shape.layers:
                raise BadIndices(f"layer {layer} out of range [0, {self.shape.layers})")
            want = (idx.numel(), *hd)
        values = (k,) if self.shape.mla else (k, v)
        if (v is not None) == self.shape.mla:
            raise BadIndices("an MLA pool takes one latent tensor" if self.shape.mla else "k and v are both needed")
        if any(tuple(t.shape) != want for t in values):
            raise BadIndices(f"k/v must have shape {want}, got {[tuple(t.shape) for t in values]}")
        if self.kv is not None:
            dst = self.kv if layer is None else self.kv[:, layer]
            for part, src in enumerate(values):
                if layer is None:
                    dst[part][:, idx] = src.to(dst.device, dst.dtype)
                else:
                    dst[part][idx] = src.to(dst.device, dst.dtype)
            return
        page, offset = idx // self.page_size, idx % self.page_size
        for li in range(self.layers) if layer is None else (layer,):
            for view, src in zip(self.layer_pages(li), values):
                view[page, offset] = (src[li] if layer is None else src).to(view.device, view.dtype)

    def read(self, indices) -> tuple[torch.Tensor, ...]:
        """K and V (MLA: the latent) of the slots, each (layers, n, heads, head_dim) on the CPU."""
        idx = self._index(indices).to(self.device)
        if self.kv is not None:
            return tuple(self.kv[part][:, idx].cpu() for part in range(self.shape.parts))
        page, offset = idx // self.page_size, idx % self.page_size
        return tuple(
            torch.stack([self.layer_pages(li)[part][page, offset] for li in range(self.layers)]).cpu()
            for part in range(self.shape.parts)
        )


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {tuple(value.shape)} {value.dtype} tensor on {value.device}"
    return type(value).__name__


def _as_uint8(data, nbytes: int) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        if data.dtype != torch.uint8:
            raise BadIndices(f"page data tensor must be uint8, got {data.dtype}")
        flat = data.reshape(-1)
    elif isinstance(data, (bytes, bytearray, memoryview)):
        mv = memoryview(data)
        if mv.nbytes == 0:
            flat = torch.empty(0, dtype=torch.uint8)
        else:
            mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # read-only buffers: we only read from them
                flat = torch.frombuffer(mv, dtype=torch.uint8)
    else:
        raise BadIndices(f"page data must be bytes-like or a uint8 tensor, got {type(data).__name__}")
    if flat.numel() != nbytes:
        raise BadIndices(f"page data has {flat.numel()} bytes, expected exactly {nbytes}")
    return flat


class HostKVPool:
    """The L2 pool in host memory, in one of three layouts (see module docstring)."""

    def __init__(self, shape: KVShape, size_tokens: int, page_size: int,
                 layout: str = "layer_first", pin_memory: bool | None = None) -> None:
        if layout not in LAYOUTS:
            raise ConfigError(f"unknown host layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
        self.shape = shape
        self.page_size = page_size
        self.size_tokens = size_tokens
        self.layout = layout
        self.allocator = PageAllocator(size_tokens, page_size, views=True)  # host slots never leave the cache
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.pinned = bool(pin_memory)
        P, L, H, D = shape.parts, shape.layers, shape.heads, shape.head_dim
        if layout == "layer_first":
            dims = (P, L, size_tokens, H, D)
        elif layout == "page_first":
            dims = (P, size_tokens, L, H, D)
        else:
            dims = (P, size_tokens // page_size, L, page_size, H, D)
        self.kv = torch.zeros(dims, dtype=shape.dtype, pin_memory=self.pinned)
        self.k = self.kv[0]
        self.v = self.kv[1] if P == 2 else None

    @classmethod
    def matching(cls, device_pool: DeviceKVPool, size_tokens: int, layout: str = "layer_first",
                 pin_memory: bool | None = None) -> HostKVPool:
        """A host pool for ``device_pool``'s KV (shape, dtype, page size), owned or adopted."""
        return cls(device_pool.shape, size_tokens, device_pool.page_size, layout, pin_memory)

    @property
    def layers(self) -> int:
        return self.shape.layers

    @property
    def total_pages(self) -> int:
        return self.size_tokens // self.page_size

    @property
    def nbytes(self) -> int:
        return self.size_tokens * self.shape.token_bytes

    @property
    def page_nbytes(self) -> int:
        return self.page_size * self.shape.token_bytes

    def _index(self, indices) -> torch.Tensor:
        idx = _as_index_tensor(indices)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.size_tokens):
            raise BadIndices(f"indices out of range [0, {self.size_tokens})")
        return idx

    def _gather(self, half: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        if self.layout == "layer_first":
            return half[:, idx]
        if self.layout == "page_first":
            return half[idx].transpose(0, 1)
        return half[idx // self.page_size, :, idx % self.page_size].transpose(0, 1)

    @property
    def _parts(self) -> tuple[torch.Tensor, ...]:
        """K and V, or the MLA latent (derived from ``k``/``v`` each time, so a copy of the pool stays whole)."""
        return (self.k,) if self.v is None else (self.k, self.v)

    def layer_pages(self, layer: int) -> tuple[torch.Tensor, ...]:
        """Per part, the (pages, page_size, heads, head_dim) view of one layer (strided but for layer_first)."""
        pages, ps = self.total_pages, self.page_size
        if self.layout == "layer_first":
            return tuple(part[layer].unflatten(0, (pages, ps)) for part in self._parts)
        if self.layout == "page_first":
            return tuple(part[:, layer].unflatten(0, (pages, ps)) for part in self._parts)
        return tuple(part[:, layer] for part in self._parts)

    def read(self, indices) -> tuple[torch.Tensor, ...]:
        """K and V (MLA: the latent) of the slots, each (layers, n, heads, head_dim), as new tensors."""
        idx = self._index(indices)
        return tuple(self._gather(part, idx).contiguous() for part in self._parts)

    def write(self, indices, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
        """Write (layers, n, heads, head_dim) K and V (MLA: the latent as ``k``) into host slots (tests, tools)."""
        idx = self._index(indices)
        want = (self.shape.layers, idx.numel(), self.shape.heads, self.shape.head_dim)
        values = (k,) if self.shape.mla else (k, v)
        if (v is not None) == self.shape.mla:
            raise BadIndices("an MLA pool takes one latent tensor" if self.shape.mla else "k and v are both needed")
        if any(tuple(t.shape) != want for t in values):
            raise BadIndices(f"k/v must have shape {want}, got {[tuple(t.shape) for t in values]}")
        for half, src in zip(self._parts, values):
            src = src.to("cpu", self.shape.dtype)
            if self.layout == "layer_first":
                half[:, idx] = src
            elif self.layout == "page_first":
                half[idx] = src.transpose(0, 1)
            else:
                half[idx // self.page_size, :, idx % self.page_size] = src.transpose(0, 1)

    def _check_page(self, page_id: int) -> int:
        if isinstance(page_id, bool) or not isinstance(page_id, int):
            try:
                page_id = int(page_id)
            except (TypeError, ValueError):
                raise BadIndices(f"page id must be an int, got {page_id!r}") from None
        if not 0 <= page_id < self.total_pages:
            raise BadIndices(f"page {page_id} is out of range [0, {self.total_pages})")
        return page_id

    def page_views(self, page_id: int) -> list[torch.Tensor]:
        """The contiguous uint8 views that make up one page, in page byte order.

        page_first and page_first_direct: one view per part (K, V; MLA: the
        latent). layer_first: ``parts * layers`` views (K of each layer, then V
        of each layer). Writing into them writes the pool (zero-copy ``readinto``).
        """
        p = self._check_page(page_id)
        ps = self.page_size
        if self.layout == "layer_first":
            parts = [half[layer, p * ps:(p + 1) * ps] for half in self._parts for layer in range(self.layers)]
        elif self.layout == "page_first":
            parts = [half[p * ps:(p + 1) * ps] for half in self._parts]
        else:
            parts = [half[p] for half in self._parts]
        return [t.reshape(-1).view(torch.uint8) for t in parts]

    def read_page(self, page_id: int) -> torch.Tensor:
        """The page's bytes (K then V) as a new contiguous uint8 tensor of ``page_nbytes``."""
        return torch.cat(self.page_views(page_id))

    def write_page(self, page_id: int, data) -> None:
        """Overwrite one page from ``page_nbytes`` bytes (bytes-like or uint8 tensor)."""
        views = self.page_views(page_id)
        flat = _as_uint8(data, self.page_nbytes)
        offset = 0
        for view in views:
            n = view.numel()
            view.copy_(flat[offset:offset + n])
            offset += n


def physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _opt_number(instance, attribute, value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{attribute.name} must be a number, got {value!r}")
    if not value > 0:
        raise ConfigError(f"{attribute.name} must be positive, got {value!r}")


def _opt_shape(instance, attribute, value) -> None:
    if value is not None and not isinstance(value, KVShape):
        raise ConfigError(f"{attribute.name} must be a KVShape or None, got {value!r}")


@attrs.frozen
class PoolConfig:
    """Sizes of the device and host pools.

    The host pool size is given by at most one of ``host_tokens``,
    ``host_bytes``, ``host_gb`` (like upstream's hicache_size) or
    ``host_ratio`` (host tokens = ratio * device tokens, like hicache_ratio);
    none given means ``host_ratio=2.0``. ``host_tokens`` must be page aligned;
    sizes derived from bytes or a ratio are rounded down to whole pages.
    ``draft_shape`` adds draft pools of the same token sizes and layout (the
    draft device pool shares the target's allocator); a byte budget then
    covers target and draft host pools together.
    """

    shape: KVShape = attrs.field(validator=_opt_shape)
    device_tokens: int = attrs.field()
    page_size: int = 1
    host_layout: str = "layer_first"
    host_tokens: int | None = attrs.field(default=None, validator=_opt_number)
    host_bytes: int | None = attrs.field(default=None, validator=_opt_number)
    host_gb: float | None = attrs.field(default=None, validator=_opt_number)
    host_ratio: float | None = attrs.field(default=None, validator=_opt_number)
    device: str | None = None
    pin_memory: bool | None = None
    draft_shape: KVShape | None = attrs.field(default=None, validator=_opt_shape)

    def resolved_host_tokens(self) -> int:
        """Host pool size in tokens (raises ConfigError if impossible)."""
        ps = self.page_size
        given = [n for n in ("host_tokens", "host_bytes", "host_gb", "host_ratio") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ConfigError(f"give at most one host size, got {', '.join(given)}")
        if self.host_tokens is not None:
            if not isinstance(self.host_tokens, int):
                raise ConfigError(f"host_tokens must be an int, got {self.host_tokens!r}")
            tokens = self.host_tokens
            if tokens % ps:
                raise ConfigError(f"host_tokens {tokens} is not a multiple of page_size {ps}")
        else:
            per_token = self.shape.token_bytes + (self.draft_shape.token_bytes if self.draft_shape else 0)
            if self.host_bytes is not None:
                tokens = int(self.host_bytes) // per_token
                source = f"host_bytes={self.host_bytes}"
            elif self.host_gb is not None:
                tokens = int(self.host_gb * (1 << 30)) // per_token
                source = f"host_gb={self.host_gb}"
            else:
                ratio = 2.0 if self.host_ratio is None else self.host_ratio
                tokens = int(self.device_tokens * ratio)
                source = f"host_ratio={ratio}"
            tokens -= tokens % ps
            if tokens < ps:
                raise ConfigError(
                    f"{source} gives a host pool smaller than one page "
                    f"({ps} tokens of {per_token} bytes each)")
        return tokens

    def validate(self, backed_device_tokens: int | None = None) -> int:
        """Check everything; returns the host size in tokens.

        The host pool must be larger than the device pool it backs
        (``backed_device_tokens``, default ``device_tokens``; a CP rank passes
        its own share): every device node is backed up on the host, so a host
        pool no larger than the device pool cannot hold the device's backups
        and the host tier loses hits instead of adding them. SGLang's host
        pool asserts the same.
        """
        if not isinstance(self.page_size, int) or isinstance(self.page_size, bool) or self.page_size <= 0:
            raise ConfigError(f"page_size must be a positive int, got {self.page_size!r}")
        if not isinstance(self.device_tokens, int) or isinstance(self.device_tokens, bool) or self.device_tokens <= 0:
            raise ConfigError(f"device_tokens must be a positive int, got {self.device_tokens!r}")
        if self.device_tokens % self.page_size:
            raise ConfigError(f"device_tokens {self.device_tokens} is not a multiple of page_size {self.page_size}")
        if self.host_layout not in LAYOUTS:
            raise ConfigError(f"unknown host layout {self.host_layout!r}; choose one of {', '.join(LAYOUTS)}")
        host_tokens = self.resolved_host_tokens()
        backed = self.device_tokens if backed_device_tokens is None else backed_device_tokens
        if host_tokens <= backed:
            raise ConfigError(
                f"the host pool ({host_tokens} tokens) must be larger than the device pool it backs "
                f"({backed} tokens): the host tier keeps a copy of everything on the device, so a smaller "
                "one loses hits instead of adding them")
        shapes = [self.shape] + ([self.draft_shape] if self.draft_shape else [])
        host_bytes = sum(host_tokens * s.token_bytes for s in shapes)
        dev = torch.device(self.device) if self.device is not None else default_device()
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device 'cuda' requested but CUDA is not available")
        need = host_bytes + (sum(self.device_tokens * s.token_bytes for s in shapes) if dev.type == "cpu" else 0)
        phys = physical_memory_bytes()
        if phys is not None and need > phys:
            raise ConfigError(
                f"pools need {need / (1 << 30):.2f} GiB of host memory but the machine has "
                f"{phys / (1 << 30):.2f} GiB; lower host_tokens/host_gb/host_ratio")
        return host_tokens


@attrs.frozen
class KVPools:
    """The pools ``build_pools`` made; the draft ones are None without ``draft_shape``."""

    config: PoolConfig
    device: DeviceKVPool
    host: HostKVPool
    draft_device: DeviceKVPool | None = None
    draft_host: HostKVPool | None = None


def build_pools(config: PoolConfig) -> KVPools:
    """Validate ``config`` and allocate the pools (ConfigError if impossible)."""
    host_tokens = config.validate()
    device = DeviceKVPool(config.shape, config.device_tokens, config.page_size, config.device)
    host = HostKVPool(config.shape, host_tokens, config.page_size, config.host_layout, config.pin_memory)
    draft_device = draft_host = None
    if config.draft_shape is not None:
        draft_device = DeviceKVPool(config.draft_shape, config.device_tokens, config.page_size,
                                    config.device, allocator=device.allocator)
        draft_host = HostKVPool(config.draft_shape, host_tokens, config.page_size,
                                config.host_layout, config.pin_memory)
    return KVPools(config, device, host, draft_device, draft_host)


__all__ = [
    "LAYOUTS", "KVShape", "PageAllocator", "DeviceKVPool", "HostKVPool", "PoolConfig", "KVPools",
    "build_pools", "pages_of", "physical_memory_bytes",
]
