"""What a reader must agree on to read a stored page right: its page format.

A page's bytes are K then V, each in the host layout's element order (see
:mod:`hicache_fsm.pools`). Two host layouts give the same bytes:
``layer_first`` and ``page_first_direct`` both go layer by layer, each layer's
``page_size`` tokens (*layer-major*); ``page_first`` goes token by token, all
layers of each token (*token-major*). Add the KV shape (layers, heads, head
dim), the dtype and the page size, and the bytes are fully described; the
model (and tenant, rank) is already part of the storage key.

Every stored value records its writer's format in its header
(:data:`FORMAT_FIELD` bytes, ASCII, zero-padded, e.g.
``kv1 layer_major L32 H8 D128 bfloat16 P64``). A reader whose format differs
gets a miss (counted ``format_mismatch``, logged once per foreign format),
never the bytes. Pages written through the raw bytes API without a format
carry an all-zero field and are read back only by such readers.
"""

from __future__ import annotations

from typing import Any

import attrs

from hicache_fsm.errors import StorageKeyError

__all__ = ["FORMAT_FIELD", "UNTYPED", "PageFormat", "describe", "format_bytes", "page_format_of"]

FORMAT_FIELD = 64  # bytes the header reserves for the format descriptor
UNTYPED = bytes(FORMAT_FIELD)
ORDERS = ("layer_major", "token_major")
_ORDER_OF_LAYOUT = {"layer_first": "layer_major", "page_first_direct": "layer_major", "page_first": "token_major"}


@attrs.frozen
class PageFormat:
    """Element order, KV shape, dtype and page size of stored pages."""

    order: str
    layers: int
    heads: int
    head_dim: int
    dtype: str
    page_size: int

    def __attrs_post_init__(self) -> None:
        if self.order not in ORDERS:
            raise StorageKeyError(f"page order must be one of {ORDERS}, got {self.order!r}")
        for name in ("layers", "heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise StorageKeyError(f"page format {name} must be a positive int, got {value!r}")
        if not self.dtype.isidentifier():
            raise StorageKeyError(f"page format dtype must be a plain name, got {self.dtype!r}")
        if len(self.text()) > FORMAT_FIELD:
            raise StorageKeyError(f"page format {self.text()!r} is longer than {FORMAT_FIELD} bytes")

    @classmethod
    def of(cls, layout: str, shape: Any, page_size: int) -> PageFormat:
        """The format a host pool with ``layout``, ``shape`` (a KVShape) and ``page_size`` reads and writes."""
        try:
            order = _ORDER_OF_LAYOUT[layout]
        except KeyError:
            raise StorageKeyError(f"unknown host layout {layout!r}") from None
        dtype = str(shape.dtype).removeprefix("torch.")
        return cls(order, int(shape.layers), int(shape.heads), int(shape.head_dim), dtype, int(page_size))

    def text(self) -> str:
        return f"kv1 {self.order} L{self.layers} H{self.heads} D{self.head_dim} {self.dtype} P{self.page_size}"

    def encode(self) -> bytes:
        """The header field: the descriptor text, zero-padded to FORMAT_FIELD bytes."""
        return self.text().encode().ljust(FORMAT_FIELD, b"\0")


def format_bytes(fmt: PageFormat | None) -> bytes:
    """Header field of ``fmt`` (None: untyped bytes)."""
    return UNTYPED if fmt is None else fmt.encode()


def page_format_of(host_pool: Any, default: PageFormat | None = None) -> PageFormat | None:
    """The format of a host pool's pages: its ``page_format``, else derived from ``layout``/``shape``."""
    fmt = getattr(host_pool, "page_format", None)
    if isinstance(fmt, PageFormat):
        return fmt
    layout, shape = getattr(host_pool, "layout", None), getattr(host_pool, "shape", None)
    if isinstance(layout, str) and shape is not None and hasattr(shape, "dtype"):
        return PageFormat.of(layout, shape, int(host_pool.page_size))
    return default


def describe(field: bytes) -> str:
    """Human text of a stored header field."""
    if field == UNTYPED:
        return "untyped bytes"
    return field.rstrip(b"\0").decode("ascii", "replace")
