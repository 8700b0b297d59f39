"""KV memory pools: the device (L1) pool and the host (L2) pool (page allocators: ``hicache_fsm.allocator``).

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

import math
import operator
import warnings

import attrs
import torch

from hicache_fsm.adoption import check_adoption
from hicache_fsm.allocator import PageAllocator, as_index_tensor, pages_of, physical_memory_bytes
from hicache_fsm.errors import BadIndices, ConfigError

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
# Bound of each KVShape dimension. Real models have at most a few hundred layers, 128 KV heads and head dims
# of 576 (an MLA latent): a million is past any of them, so a larger value is a mix-up (tokens or bytes given
# as a dimension) refused here, not when a product of such numbers overflows a size later.
MAX_KV_DIM = 1 << 20


def _positive(instance, attribute, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{attribute.name} must be a positive int, got {value!r}")


def _dimension(instance, attribute, value) -> None:
    _positive(instance, attribute, value)
    if value > MAX_KV_DIM:
        raise ConfigError(f"{attribute.name} must be at most {MAX_KV_DIM} (no model is that large), got {value}")


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

    layers: int = attrs.field(validator=_dimension)
    heads: int = attrs.field(validator=_dimension)
    head_dim: int = attrs.field(validator=_dimension)
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


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def indexed_device(device: torch.device) -> torch.device:
    """``device`` with its GPU index: a bare ``cuda`` is the device current now, where torch puts the memory.

    The executors record and wait on the streams of the pool's own GPU
    (``torch.cuda.current_stream(pool.device)``), so the pool must name it,
    whichever device is current when they run.
    """
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def check_pin_memory(pin_memory: object) -> bool:
    """Whether a host pool is pinned: as asked, or (None) when CUDA is present; "no" would read as True."""
    if pin_memory is None:
        return torch.cuda.is_available()
    if not isinstance(pin_memory, bool):
        raise ConfigError(f"pin_memory must be True, False or None (pinned when CUDA is present), got {pin_memory!r}")
    if pin_memory and not torch.cuda.is_available():
        raise ConfigError("pin_memory=True needs CUDA (page-locked memory speeds host-device copies only)")
    return pin_memory


def check_shape(shape: object) -> KVShape:
    """``shape`` itself when it is a KVShape; else ConfigError (a pool reads its fields before anything else)."""
    if not isinstance(shape, KVShape):
        raise ConfigError(f"shape must be a KVShape (layers, heads, head_dim, dtype), got {type(shape).__name__}")
    return shape


def device_memory_bytes(device: torch.device) -> int | None:
    """Memory of ``device``: the GPU's own, or the machine's RAM (None where the OS does not say)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return physical_memory_bytes()


def check_pool_fits(shape: KVShape, size_tokens: object, device: torch.device) -> None:
    """Refuse, before allocating, KV larger than the memory of its device (torch would fail late, untyped).

    The bound is the whole memory, not what is free now: it never refuses a
    pool the device could hold. A size that is not a positive int is left to
    the allocator, which names that fault.
    """
    if not isinstance(size_tokens, int) or isinstance(size_tokens, bool):
        return
    need, have = size_tokens * shape.token_bytes, device_memory_bytes(device)
    if have is not None and need > have:
        raise ConfigError(f"not enough memory: a pool of {size_tokens} tokens needs {need / (1 << 30):.3g} GiB, "
                          f"more than the {have / (1 << 30):.3g} GiB of memory on {device}")


def check_device(name: object) -> torch.device:
    """``name`` as a device this machine has (cpu, cuda, cuda:N: the executors' two kinds); else ConfigError."""
    try:
        dev = torch.device(name)  # type: ignore[arg-type]
    except (RuntimeError, TypeError):  # a bad string; an int index with no accelerator
        raise ConfigError(f"device must be cpu, cuda or cuda:N, got {name!r}") from None
    if dev.type not in ("cpu", "cuda") or (dev.type == "cpu" and dev.index not in (None, 0)):
        raise ConfigError(f"device must be cpu, cuda or cuda:N, got {name!r}")  # cpu:99 would be cpu anyway
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name!r} requested but CUDA is not available (this torch has no usable GPU)")
        visible = torch.cuda.device_count()
        if dev.index is not None and dev.index >= visible:  # one wording whether or not a GPU is present
            raise ConfigError(f"device must be cpu, cuda or cuda:N with N below {visible} "
                              f"(the GPUs visible here), got {name!r}")
    return dev


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
        check_shape(shape)
        device = indexed_device(check_device(device) if device is not None else default_device())
        check_pool_fits(shape, size_tokens, device)
        self._setup(shape, size_tokens, page_size, device, allocator)
        kv = torch.zeros((shape.parts, shape.layers, size_tokens, shape.heads, shape.head_dim),
                         dtype=shape.dtype, device=device)
        self._engine_pages = self._engine_buffers = None
        self.kv = kv
        self.k = kv[0]
        self.v = kv[1] if shape.parts == 2 else None

    @classmethod
    def adopt(cls, layer_pages: list[tuple[torch.Tensor, ...]], *, mla: bool = False,
              buffers: tuple[torch.Tensor, ...] = (), allocator: PageAllocator | None = None,
              reserved_pages: int = 0) -> DeviceKVPool:
        """A pool over memory an engine owns: no allocation, no copy.

        ``layer_pages[layer]`` holds, per part (K and V, or the MLA latent),
        a (pages, page_size, heads, head_dim) view of the engine's buffer, in
        any strides; ``buffers`` are the engine's tensors themselves (kept
        alive by the pool). ``hicache_fsm.engine_kv`` builds these for each
        engine layout. Raises ConfigError unless every view has the same
        shape, dtype and device. The first ``reserved_pages`` pages stay the
        engine's: never handed out (see ``PageAllocator``).
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
        pool._setup(shape, pages * page_size, page_size, first.device, allocator, reserved_pages)
        pool._engine_pages = [tuple(views) for views in layer_pages]
        pool._engine_buffers = tuple(buffers)
        pool.kv = pool.k = pool.v = None
        return pool

    def _setup(self, shape: KVShape, size_tokens: int, page_size: int, device: torch.device,
               allocator: PageAllocator | None, reserved_pages: int = 0) -> None:
        if allocator is None:
            allocator = PageAllocator(size_tokens, page_size, reserved_pages=reserved_pages)
        elif allocator.size_tokens != size_tokens or allocator.page_size != page_size \
                or allocator.reserved_pages != reserved_pages:
            raise ConfigError("a shared allocator must have the pool's size_tokens, page_size and reserved pages")
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
        layer = check_index(layer, self.shape.layers, "layer")
        if self.kv is None:
            return self._engine_pages[layer]
        pages = self.size_tokens // self.page_size
        return tuple(part[layer].unflatten(0, (pages, self.page_size)) for part in self.kv)

    def _index(self, indices) -> torch.Tensor:
        idx = as_index_tensor(indices)
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
            layer = check_index(layer, self.shape.layers, "layer")
            want = (idx.numel(), *hd)
        values = (k,) if self.shape.mla else (k, v)
        if (v is not None) == self.shape.mla:
            raise BadIndices("an MLA pool takes one latent tensor" if self.shape.mla else "k and v are both needed")
        check_kv_tensors(values, want)
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


def layer_of(part: torch.Tensor, layout: str, layer: int, page_size: int) -> torch.Tensor:
    """One layer of one part of a host buffer in ``layout`` as (pages, page_size, heads, head_dim).

    ``part`` is a whole part (``HostKVPool.kv[i]``), a GPU view of one, or any run of its rows in the page_first
    layouts (a staged block of them).
    """
    if layout == "layer_first":
        return part[layer].unflatten(0, (-1, page_size))
    if layout == "page_first":
        return part[:, layer].unflatten(0, (-1, page_size))
    return part[:, layer]


class HostKVPool:
    """The L2 pool in host memory, in one of three layouts (see module docstring)."""

    def __init__(self, shape: KVShape, size_tokens: int, page_size: int,
                 layout: str = "layer_first", pin_memory: bool | None = None) -> None:
        check_shape(shape)
        if layout not in LAYOUTS:
            raise ConfigError(f"unknown host layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
        check_pool_fits(shape, size_tokens, torch.device("cpu"))
        self.shape = shape
        self.page_size = page_size
        self.size_tokens = size_tokens
        self.layout = layout
        self.allocator = PageAllocator(size_tokens, page_size, views=True)  # host slots never leave the cache
        self.pinned = check_pin_memory(pin_memory)
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
        if not isinstance(device_pool, DeviceKVPool):
            raise ConfigError(f"matching takes the DeviceKVPool to back, got {type(device_pool).__name__}")
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
        idx = as_index_tensor(indices)
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
        layer = check_index(layer, self.shape.layers, "layer")
        return tuple(layer_of(part, self.layout, layer, self.page_size) for part in self._parts)

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
        check_kv_tensors(values, want)
        for half, src in zip(self._parts, values):
            src = src.to("cpu", self.shape.dtype)
            if self.layout == "layer_first":
                half[:, idx] = src
            elif self.layout == "page_first":
                half[idx] = src.transpose(0, 1)
            else:
                half[idx // self.page_size, :, idx % self.page_size] = src.transpose(0, 1)

    def _check_page(self, page_id: int) -> int:
        return check_index(page_id, self.total_pages, "page id")

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


def check_index(value: object, size: int, what: str) -> int:
    """``value`` as an index in ``0..size-1`` (numpy / torch integers too), else ``BadIndices`` naming ``what``:
    not a bool, a float or a str (``int()`` took 1.7 as 1, "3" as 3), nor -1 (which read the last layer)."""
    index = value
    if type(value) is not int:
        try:
            index = -1 if isinstance(value, bool) else operator.index(value)
        except TypeError:
            index = -1
    if not 0 <= index < size:
        raise BadIndices(f"{what} must be an int in [0, {size}), got {value!r}")
    return index


def check_kv_tensors(values: tuple, want: tuple[int, ...]) -> None:
    """The K / V a pool write takes: tensors of shape ``want`` whose values can be read (``BadIndices`` if not)."""
    for t in values:
        if not isinstance(t, torch.Tensor):
            raise BadIndices(f"k/v must be torch tensors, got {type(t).__name__}")
        if t.is_meta:
            raise BadIndices("k/v on the meta device hold no values to write")
    if any(tuple(t.shape) != want for t in values):
        raise BadIndices(f"k/v must have shape {want}, got {[tuple(t.shape) for t in values]}")


def _opt_number(instance, attribute, value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{attribute.name} must be a number, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):  # inf overflows the sizes computed from it
        raise ConfigError(f"{attribute.name} must be a finite number, got {value!r}")
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
        dev = check_device(self.device) if self.device is not None else default_device()
        check_pin_memory(self.pin_memory)
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
    "LAYOUTS", "MAX_KV_DIM", "KVShape", "PageAllocator", "DeviceKVPool", "HostKVPool", "PoolConfig", "KVPools",
    "build_pools", "pages_of", "physical_memory_bytes",
]
