"""The L3 storage interface every backend implements, plus what backends share.

Keys given to a backend are page-level keys (normally the chained page hashes of
:mod:`hicache_fsm.storage.keys`); the backend stores each one under its
:class:`~hicache_fsm.storage.keys.KeyNamespace`, so a backend opened for one
model/tenant/rank never sees another's pages.

Contract of every backend:

* ``batch_exists(keys)`` -> how many keys in a row, from the first, are stored.
* ``batch_get(keys)`` -> one ``bytes`` or ``None`` (miss) per key.
* ``batch_set(keys, values)`` -> one bool per key: True when the page is stored
  afterwards (written now, or already present and skipped), False when it could
  not be stored (e.g. larger than a size cap).
* ``batch_get_into(keys, host_pool, page_ids)`` / ``batch_set_from(...)``: the
  same, reading into / writing from host-pool pages without an intermediate
  page-sized buffer wherever the medium allows. On a False result the
  destination page's contents are unspecified.
* ``add_eviction_listener(fn)``: a backend that drops pages on its own (a size
  cap's LRU eviction) calls ``fn(page_keys)`` with the page keys it dropped, from
  whichever thread evicted them (``reports_evictions`` says whether it can). The
  storage tier uses it to move the nodes holding those pages back to "not
  stored" (publishing ``removed:storage``). Pages lost where the backend cannot
  see it (a server's own eviction, a file deleted by hand) are found by
  ``data_epoch`` and ``StorageTier.verify_stored`` instead.
* An I/O failure raises :class:`~hicache_fsm.errors.StorageError` (or a subclass:
  ``StorageUnavailable``, ``StorageTimeout``, ``StorageFull``); a backend never
  returns bytes it has not verified. A stored page that is corrupt or short is
  a miss (None / False), counted as ``corrupt`` in ``stats()`` and logged on the
  ``hicache_fsm.storage`` logger; where it can without racing a writer, the backend
  removes it (``corrupt_removed``) so that the next backup stores the page again.

Every stored value carries a small header (:mod:`hicache_fsm.storage.blob`): magic,
format version, checksum algorithm, key length, payload length, payload
checksum, the writer's page format (:mod:`hicache_fsm.storage.page_format`)
and a CRC-32 of the header itself, followed by the full storage key and then
the payload. The key copy catches a value that landed under the wrong name; the
page format catches a reader whose host layout, KV shape, dtype or page size
differs from the writer's (a miss counted ``format_mismatch``, never the bytes).
The payload checksum is ``wsum64`` by default (position-weighted 64-bit
sums that catch every flip of one or two bits) or ``crc32``
(``checksum="crc32"`` on any backend), or ``none`` where the medium guards the
payload itself (the Mooncake backend's default: RAM reached over TCP/RDMA; the
header, key, format and size are still verified); readers accept each.

The host pool is duck-typed (:class:`HostPoolLike`): ``page_nbytes``,
``page_size``, ``read_page(page_id)``, ``write_page(page_id, data)`` and
``page_views(page_id)`` (contiguous CPU uint8 tensors that together are the page).
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any, Callable, Hashable, Iterable, Protocol, Sequence, runtime_checkable

import torch

from hicache_fsm.errors import StorageError, StorageKeyError, StorageUnavailable
from hicache_fsm.sole_user import SoleUser
from hicache_fsm.storage.blob import CorruptPage, FormatMismatch, checksum_id, encode_header
from hicache_fsm.storage.keys import KeyNamespace
from hicache_fsm.storage.page_format import PageFormat, format_bytes, page_format_of

logger = logging.getLogger("hicache_fsm.storage")

__all__ = [
    "DEFAULT_NAMESPACE",
    "STAT_FIELDS",
    "SharedStore",
    "HostPoolLike",
    "LRUIndex",
    "StorageBackend",
    "StorageStats",
    "as_byte_view",
    "check_host_pool",
]

DEFAULT_NAMESPACE = KeyNamespace("default")

STAT_FIELDS = (
    "exists_queries",  # keys probed by batch_exists
    "gets",  # keys asked for by batch_get / batch_get_into
    "hits",
    "misses",  # includes corrupt pages
    "corrupt",  # stored pages rejected by the header/checksum check
    "format_mismatch",  # stored pages written with another page format (layout, shape, dtype, page size)
    "corrupt_removed",  # of the corrupt pages, removed from the store so that the next backup writes them again
    "sets",  # keys offered to batch_set / batch_set_from
    "skipped_existing",  # of those, already stored (not rewritten)
    "set_failures",  # of those, refused without an error (e.g. over the size cap)
    "errors",  # calls that raised StorageError
    "evictions",  # pages dropped by a size cap
    "orphans_removed",  # temporary files of crashed writers removed when the store opened (file)
    "bytes_read",  # payload bytes returned on hits
    "bytes_written",  # payload bytes actually written
)

# Outcome of storing one page (backend-internal).
WRITTEN = "written"
EXISTS = "exists"
FAILED = "failed"


@runtime_checkable
class HostPoolLike(Protocol):
    page_nbytes: int
    page_size: int

    def read_page(self, page_id: int) -> torch.Tensor: ...

    def write_page(self, page_id: int, data: Any) -> None: ...

    def page_views(self, page_id: int) -> list[torch.Tensor]: ...


# ---------------------------------------------------------------- buffers


def as_byte_view(value: Any, *, writable: bool = False) -> memoryview:
    """A flat ``memoryview`` of unsigned bytes over ``value`` without copying.

    Accepts bytes-like objects and CPU torch tensors (any dtype, must be contiguous).
    """
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise StorageKeyError(f"page buffers must be CPU tensors, got device {value.device}")
        if not value.is_contiguous():
            raise StorageKeyError("page buffers must be contiguous tensors")
        flat = value.detach().reshape(-1)
        if flat.dtype != torch.uint8:
            flat = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
        view = memoryview(flat.numpy())
    else:
        try:
            view = memoryview(value)
        except TypeError:
            raise StorageKeyError(f"page values must be bytes-like or tensors, got {type(value).__name__}") from None
        if not view.c_contiguous:
            raise StorageKeyError("page buffers must be contiguous")
        if "O" in view.format:  # object pointers: their bytes are addresses in this process, not KV
            raise StorageKeyError("page values must hold bytes, not Python objects (an object array)")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    if writable and view.readonly:
        raise StorageKeyError("destination buffer is read-only")
    return view


# ---------------------------------------------------------------- stats / LRU


class StorageStats:
    """Thread-safe counters; ``snapshot()`` returns a plain dict."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(STAT_FIELDS, 0)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def fork(self) -> "StorageStats":
        """An independent copy of the counters (the explorer forks whole caches)."""
        new = StorageStats()
        new._counts = self.snapshot()
        return new


class LRUIndex:
    """Recency order and sizes of stored pages, for a ``max_bytes`` cap.

    Not thread-safe on its own; backends call it under their lock.
    """

    def __init__(self, max_bytes: int | None) -> None:
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
            raise StorageKeyError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._order: OrderedDict[Hashable, int] = OrderedDict()
        self.total = 0

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, item: Hashable) -> bool:
        return item in self._order

    def add(self, item: Hashable, nbytes: int) -> None:
        old = self._order.pop(item, None)
        if old is not None:
            self.total -= old
        self._order[item] = nbytes
        self.total += nbytes

    def touch(self, item: Hashable) -> None:
        if item in self._order:
            self._order.move_to_end(item)

    def discard(self, item: Hashable) -> None:
        nbytes = self._order.pop(item, None)
        if nbytes is not None:
            self.total -= nbytes

    def clear(self) -> None:
        self._order.clear()
        self.total = 0

    def fork(self) -> "LRUIndex":
        """An independent copy: same cap, same items in the same recency order."""
        new = LRUIndex(self.max_bytes)
        new._order = OrderedDict(self._order)
        new.total = self.total
        return new

    def fits(self, nbytes: int) -> bool:
        return self.max_bytes is None or nbytes <= self.max_bytes

    def over_budget(self) -> list[Hashable]:
        """Pops and returns the least recently used items until the total fits the cap."""
        victims: list[Hashable] = []
        if self.max_bytes is None:
            return victims
        while self.total > self.max_bytes and self._order:
            item, nbytes = self._order.popitem(last=False)
            self.total -= nbytes
            victims.append(item)
        return victims


# ---------------------------------------------------------------- the interface


def _check_keys(keys: Sequence[str]) -> list[str]:
    if isinstance(keys, (str, bytes)):
        raise StorageKeyError("keys must be a sequence of str, not a single str")
    return list(keys)


def _check_page_ids(page_ids: Sequence[int], n: int) -> list[int]:
    if hasattr(page_ids, "tolist"):
        page_ids = page_ids.tolist()
    ids = list(page_ids)
    if len(ids) != n:
        raise StorageKeyError(f"{n} keys but {len(ids)} page ids")
    for p in ids:
        if isinstance(p, bool) or not isinstance(p, int) or p < 0:
            raise StorageKeyError(f"page ids must be non-negative ints, got {p!r}")
    return ids


def check_host_pool(host_pool: Any) -> None:
    """``StorageKeyError`` unless ``host_pool`` is a host pool zero-copy calls can read and write pages of."""
    nbytes = getattr(host_pool, "page_nbytes", None)
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not all(
            callable(getattr(host_pool, m, None)) for m in ("read_page", "write_page")):
        raise StorageKeyError(f"host_pool must be a HostKVPool (page_nbytes, read_page, write_page), "
                              f"got {type(host_pool).__name__}")


def _pool_views(host_pool: Any, page_id: int, *, writable: bool) -> list[memoryview] | None:
    """Contiguous byte views of one host page, or None if the pool offers none usable."""
    get_views = getattr(host_pool, "page_views", None)
    if get_views is None:
        return None
    try:
        views = [as_byte_view(v, writable=writable) for v in get_views(page_id)]
    except StorageKeyError:
        return None
    if sum(len(v) for v in views) != host_pool.page_nbytes:
        raise StorageKeyError(
            f"page_views({page_id}) cover {sum(len(v) for v in views)} bytes, page_nbytes is {host_pool.page_nbytes}"
        )
    return views


EvictionListener = Callable[[list[str]], None]


class StorageBackend(ABC):
    """Abstract L3 backend. Subclasses implement the ``_``-prefixed hooks on storage keys.

    Public methods validate arguments, map page keys through the namespace,
    keep ``stats()`` and count raised errors. All public methods are thread-safe.
    """

    scheme: str = ""
    reports_evictions = False  # True where the backend evicts pages itself and tells its eviction listeners

    def __init__(self, namespace: KeyNamespace | None = None, *, checksum: str = "wsum64",
                 page_format: PageFormat | None = None) -> None:
        if page_format is not None and not isinstance(page_format, PageFormat):
            raise StorageKeyError(f"page_format must be a PageFormat or None, got {type(page_format).__name__}")
        self.page_format = page_format  # of the bytes API; host-pool calls use the pool's own format
        self._foreign_formats: set[bytes] = set()
        self.checksum = checksum
        self._algo = checksum_id(checksum)
        if namespace is not None and not isinstance(namespace, KeyNamespace):
            raise StorageKeyError(f"namespace must be a KeyNamespace, got {type(namespace).__name__}")
        self._namespace = namespace if namespace is not None else DEFAULT_NAMESPACE
        self._stats = StorageStats()
        self._closed = False
        self.attached_to = SoleUser()  # the one storage link that owns this object (attach_storage of a backend)
        self._eviction_listeners: tuple[EvictionListener, ...] = ()  # replaced, never mutated: read lock-free
        self._last_pool_format: tuple[Any, bytes] | None = None  # (host pool, its format field), replaced whole

    # -- public API ------------------------------------------------------

    @property
    def namespace(self) -> KeyNamespace:
        return self._namespace

    @property
    def closed(self) -> bool:
        return self._closed

    def batch_exists(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, in order from the first, are stored."""
        skeys = self._enter(keys)
        self._stats.add(exists_queries=len(skeys))
        if not skeys:
            return 0
        return self._guard(self._exists, skeys)

    def batch_get(self, keys: Sequence[str], page_format: PageFormat | None = None) -> list[bytes | None]:
        """The payload of each key, or None where it is missing, corrupt or in another page format.

        ``page_format``: the format the caller reads (default: the backend's ``page_format``).
        """
        skeys = self._enter(keys)
        fmt = format_bytes(page_format or self.page_format)
        results = self._guard(self._get, skeys, fmt) if skeys else []
        hits = [r for r in results if r is not None]
        self._stats.add(
            gets=len(skeys), hits=len(hits), misses=len(skeys) - len(hits), bytes_read=sum(len(r) for r in hits)
        )
        return results

    def batch_set(self, keys: Sequence[str], values: Sequence[Any], page_format: PageFormat | None = None) -> list[bool]:
        """Store each value under its key, skipping keys already stored; True where stored.

        ``page_format``: the format of ``values`` (default: the backend's ``page_format``).
        """
        skeys = self._enter(keys)
        values = list(values)
        if len(values) != len(skeys):
            raise StorageKeyError(f"{len(skeys)} keys but {len(values)} values")
        payloads = [[as_byte_view(v)] for v in values]
        return self._store(skeys, payloads, format_bytes(page_format or self.page_format))

    def batch_get_into(self, keys: Sequence[str], host_pool: Any, page_ids: Sequence[int]) -> list[bool]:
        """Read each key's page straight into ``host_pool`` page ``page_ids[i]``; True on a hit."""
        check_host_pool(host_pool)
        skeys = self._enter(keys)
        ids = _check_page_ids(page_ids, len(skeys))
        if not skeys:
            return []
        nbytes = int(host_pool.page_nbytes)
        dests: list[list[memoryview]] = []
        staged: dict[int, bytearray] = {}
        for i, pid in enumerate(ids):
            views = _pool_views(host_pool, pid, writable=True)
            if views is None:  # no usable views: stage, then write_page
                staged[i] = bytearray(nbytes)
                views = [memoryview(staged[i])]
            dests.append(views)
        results = self._guard(self._get_into, skeys, dests, self._pool_format(host_pool))
        for i, buf in staged.items():
            if results[i]:
                host_pool.write_page(ids[i], torch.frombuffer(buf, dtype=torch.uint8))
        hits = sum(1 for r in results if r)
        self._stats.add(gets=len(skeys), hits=hits, misses=len(skeys) - hits, bytes_read=hits * nbytes)
        return results

    def batch_set_from(self, keys: Sequence[str], host_pool: Any, page_ids: Sequence[int]) -> list[bool]:
        """Store host-pool pages ``page_ids`` under ``keys`` (skipping stored keys); True where stored."""
        check_host_pool(host_pool)
        skeys = self._enter(keys)
        ids = _check_page_ids(page_ids, len(skeys))
        payloads = []
        for pid in ids:
            views = _pool_views(host_pool, pid, writable=False)
            if views is None:
                views = [as_byte_view(host_pool.read_page(pid))]
            payloads.append(views)
        return self._store(skeys, payloads, self._pool_format(host_pool))

    def clear(self) -> None:
        """Delete every page of this backend's namespace (nothing else)."""
        self._enter(())
        self._guard(self._clear)

    def stats(self) -> dict[str, int]:
        return self._stats.snapshot()

    def data_epoch(self) -> int:
        """Goes up whenever the backend finds it may have lost pages it stored (a server restart lost its keys).

        Whoever marked pages stored must then check them again (``batch_exists``)
        and store the missing ones. 0 for backends that never lose what they stored.
        StorageUnavailable once closed, as every other call.
        """
        self._check_open()
        return 0

    def add_eviction_listener(self, listener: EvictionListener) -> None:
        """Call ``listener(page_keys)`` whenever this backend drops stored pages on its own.

        It runs on the thread that evicted (a storage I/O thread), so it must be
        quick and thread-safe (appending to a deque is). Nothing is reported by
        a backend whose ``reports_evictions`` is False.
        """
        if not callable(listener):
            raise StorageKeyError(f"an eviction listener must be callable, got {type(listener).__name__}")
        self._eviction_listeners = (*self._eviction_listeners, listener)

    def remove_eviction_listener(self, listener: EvictionListener) -> None:
        """Stop calling ``listener`` (an equal one: a bound method made again matches; no-op if absent)."""
        self._eviction_listeners = tuple(fn for fn in self._eviction_listeners if fn != listener)

    def close(self) -> None:
        """Release connections/handles; idempotent. Later calls raise StorageUnavailable."""
        if self._closed:
            return
        self._closed = True
        self._last_pool_format = None  # a closed backend keeps no host pool alive
        self._close()

    # single-key conveniences
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str) -> bytes | None:
        return self.batch_get([key])[0]

    def set(self, key: str, value: Any) -> bool:
        return self.batch_set([key], [value])[0]

    def fork(self, memo: dict) -> "StorageBackend":
        """An independent copy, stored pages included (the explorer forks caches with their storage).

        ``memo`` maps ``id(original)`` to its copy, so a backend shared by two
        holders is copied once. Only backends whose whole state lives in this
        process can be forked; the others raise ``NotImplementedError``.
        """
        raise NotImplementedError(f"cannot fork a {type(self).__name__} (only private memory:// backends)")

    def __enter__(self) -> "StorageBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(namespace={self._namespace.prefix!r})"

    # -- helpers for subclasses -------------------------------------------

    def _enter(self, keys: Sequence[str]) -> list[str]:
        """The storage keys of page ``keys`` (checked), once the backend is known open."""
        return self._namespace.storage_keys(self._open_keys(keys))

    def _open_keys(self, keys: Sequence[str]) -> list[str]:
        """``keys`` as a list (a single str refused), once the backend is known open."""
        self._check_open()
        return _check_keys(keys)

    def _check_open(self) -> None:
        """StorageUnavailable once ``close`` ran: a closed backend answers nothing and writes nothing."""
        if self._closed:
            raise StorageUnavailable(f"{type(self).__name__} is closed")

    def _pool_format(self, host_pool: Any) -> bytes:
        """The header field of ``host_pool``'s page format (kept for the last pool asked about: a tier has one)."""
        last = self._last_pool_format
        if last is not None and last[0] is host_pool:
            return last[1]
        fmt = format_bytes(page_format_of(host_pool, self.page_format))
        self._last_pool_format = (host_pool, fmt)
        return fmt

    def _guard(self, fn, *args):
        try:
            return fn(*args)
        except StorageError:
            self._stats.add(errors=1)
            raise

    def _store(self, skeys: list[str], payloads: list[list[memoryview]], fmt: bytes) -> list[bool]:
        if not skeys:
            return []
        outcomes = self._guard(self._set, skeys, payloads, fmt)
        written = [i for i, o in enumerate(outcomes) if o == WRITTEN]
        self._stats.add(
            sets=len(skeys),
            skipped_existing=sum(1 for o in outcomes if o == EXISTS),
            set_failures=sum(1 for o in outcomes if o == FAILED),
            bytes_written=sum(sum(len(p) for p in payloads[i]) for i in written),
        )
        return [o != FAILED for o in outcomes]

    def _encode_header(self, skey: str, parts: Sequence[memoryview | bytes], fmt: bytes) -> bytes:
        return encode_header(skey.encode(), parts, self._algo, fmt)

    def _report_evicted(self, skeys: Iterable[str]) -> None:
        """Tell the eviction listeners which of this namespace's pages were dropped (storage keys in)."""
        listeners = self._eviction_listeners
        if not listeners:
            return
        prefix = self._namespace.prefix
        keys = [skey[len(prefix):] for skey in skeys if skey.startswith(prefix)]
        if not keys:
            return
        for listener in listeners:
            try:
                listener(keys)
            except Exception:  # noqa: BLE001 - a listener's bug must not fail the write that evicted
                logger.exception("%s: an eviction listener failed", type(self).__name__)

    def _forget_recency(self, skeys: Sequence[str]) -> None:
        """Drop ``skeys`` from this backend's recency order (a store it shares evicted them); none kept by default."""

    def _report_corrupt(self, skey: str, reason: str | CorruptPage, remove: Callable[[], bool] | None = None) -> None:
        """Count a stored page read as a miss: corrupt (``remove()`` deletes it if still the value read) or foreign."""
        if isinstance(reason, FormatMismatch):
            self._stats.add(format_mismatch=1)
            if reason.stored not in self._foreign_formats:
                self._foreign_formats.add(reason.stored)
                logger.warning(
                    "%s: stored page %s was %s; treating it and every page of that format as a miss "
                    "(counted in the backend's stats()['format_mismatch'], a cache's "
                    "stats()['storage']['backend_stats']['format_mismatch'])", type(self).__name__, skey, reason)
            return
        removed = remove is not None and remove()
        self._stats.add(corrupt=1, corrupt_removed=int(removed))
        logger.warning("%s: stored page %s is corrupt (%s); treating it as a miss%s", type(self).__name__, skey,
                       reason, " and removed it, so that the next backup stores it again" if removed else "")

    # -- hooks -------------------------------------------------------------

    @abstractmethod
    def _exists(self, skeys: list[str]) -> int: ...

    @abstractmethod
    def _get(self, skeys: list[str], fmt: bytes) -> list[bytes | None]:
        """Each verified payload stored in page format ``fmt`` (a header field), or None."""

    @abstractmethod
    def _set(self, skeys: list[str], payloads: list[list[memoryview]], fmt: bytes) -> list[str]:
        """Store each payload (given as byte parts, in format ``fmt``) unless present; WRITTEN/EXISTS/FAILED each."""

    def _get_into(self, skeys: list[str], dests: list[list[memoryview]], fmt: bytes) -> list[bool]:
        """Default: fetch whole payloads, then copy them into the destination parts."""
        out = []
        for skey, data, parts in zip(skeys, self._get(skeys, fmt), dests):
            out.append(data is not None and self._scatter(skey, memoryview(data), parts))
        return out

    def _scatter(self, skey: str, payload: memoryview, parts: list[memoryview]) -> bool:
        """Copy a fetched payload into a page's destination parts; a size mismatch is a corrupt page (False)."""
        total = sum(len(p) for p in parts)
        if len(payload) != total:
            self._report_corrupt(skey, f"payload is {len(payload)} bytes, destination page is {total}")
            return False
        offset = 0
        for part in parts:
            part[:] = payload[offset : offset + len(part)]
            offset += len(part)
        return True

    @abstractmethod
    def _clear(self) -> None: ...

    def _close(self) -> None:
        pass

    def debug_corrupt(self, key: str) -> bool:
        """Test hook: damage the stored copy of page key ``key``; False if it is not stored."""
        raise NotImplementedError(f"{type(self).__name__} cannot corrupt pages for tests")


_STORE_EPOCHS = itertools.count(1)  # every store, and every clear of one, gets an epoch no other had


class SharedStore:
    """What the backends opened on one in-process store share: a lock, a data epoch and who is open on it.

    A size cap evicts from the store, so every backend on it must forget the
    pages (their recency order) and tell its own eviction listeners.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.epoch = next(_STORE_EPOCHS)
        self.backends: weakref.WeakSet[StorageBackend] = weakref.WeakSet()

    def renew_epoch(self) -> None:
        """The store's pages were dropped wholesale (a clear): holders must store their nodes again."""
        self.epoch = next(_STORE_EPOCHS)

    def forget(self, skeys: list[str]) -> list[StorageBackend]:
        """``skeys`` left the store: every backend on it drops them from its recency order; those backends."""
        with self.lock:
            backends = list(self.backends)
            for backend in backends:
                backend._forget_recency(skeys)
        return backends

    def evicted(self, skeys: list[str]) -> None:
        """``skeys`` were dropped from the store: every backend on it forgets them and tells its listeners."""
        for backend in self.forget(skeys):
            backend._report_evicted(skeys)
