"""A backend that records which pages are stored, not their bytes: storage for metadata mode.

Trace replay runs without a model and its KV bytes mean nothing (see
``hicache_fsm.trace_replay``), yet an ordinary backend spends most of the
replay serialising them: page views, a checksum, a header and a copy per
stored page. This backend keeps, per storage key, only the page format it was
written in, so every call the storage tier makes (existence queries, backups,
prefetch reads) has the same outcome as on ``memory://`` while no page byte
is read or written:

* ``batch_set_from`` records the keys (skipping stored ones) and counts
  ``bytes_written`` as the payload bytes a real backend would have written;
* ``batch_get_into`` answers a hit for every stored key in the reader's page
  format and leaves the destination page as it was (its contents are
  unspecified, which is all metadata mode needs); a key stored in another
  format is a ``format_mismatch`` miss, as on a real backend;
* the bytes calls (``batch_get`` / ``batch_set``) are refused with a
  ``StorageKeyError``: there are no bytes to give back.

``store=NAME`` shares one key set between every backend opened with that name
in this process (a cluster's shared L3), like ``memory://NAME``; a key evicted
by ``max_bytes`` is reported to every backend's eviction listeners, as there.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

from hicache_fsm.errors import StorageKeyError
from hicache_fsm.storage.base import EXISTS, FAILED, WRITTEN, LRUIndex, SharedStore, StorageBackend
from hicache_fsm.storage.keys import KeyNamespace
from hicache_fsm.storage.page_format import PageFormat

__all__ = ["KeysOnlyBackend"]


class _KeyStore(SharedStore):
    def __init__(self) -> None:
        super().__init__()
        self.formats: dict[str, bytes] = {}  # storage key -> page format it was written in


_SHARED: dict[str, _KeyStore] = {}
_SHARED_LOCK = threading.Lock()


class KeysOnlyBackend(StorageBackend):
    """Stored keys and their page format only (see the module docstring); ``max_bytes`` caps with LRU eviction."""

    scheme = "keys"

    @property
    def reports_evictions(self) -> bool:  # type: ignore[override]
        """Only a cap evicts: this backend's own, or another's on the same shared key set and namespace."""
        return self._lru is not None or bool(self.store_name)

    def __init__(self, namespace: KeyNamespace | None = None, *, store: str | None = None,
                 max_bytes: int | None = None, page_format: PageFormat | None = None) -> None:
        super().__init__(namespace, checksum="none", page_format=page_format)
        if store:
            with _SHARED_LOCK:
                self._keys = _SHARED.setdefault(store, _KeyStore())
        else:
            self._keys = _KeyStore()
        self.store_name = store
        self._lru = LRUIndex(max_bytes) if max_bytes is not None else None  # recency matters only under a cap
        self._prefix = self.namespace.prefix
        with self._keys.lock:
            self._keys.backends.add(self)

    @staticmethod
    def drop_shared(name: str) -> None:
        """Forget a named shared key set."""
        with _SHARED_LOCK:
            _SHARED.pop(name, None)

    def stored_keys(self) -> list[str]:
        """Storage keys of every page this backend's key set holds, sorted."""
        with self._keys.lock:
            return sorted(self._keys.formats)

    def _forget_recency(self, skeys: Sequence[str]) -> None:
        if self._lru is not None:
            for skey in skeys:
                self._lru.discard(skey)

    def data_epoch(self) -> int:
        """Goes up whenever stored keys were dropped wholesale (``clear``)."""
        return self._keys.epoch

    # ------------------------------------------------------------------ host-pool calls, bytes untouched

    def batch_get_into(self, keys: Sequence[str], host_pool: Any, page_ids: Sequence[int]) -> list[bool]:
        skeys = self._enter(keys)
        if len(page_ids) != len(skeys):
            raise StorageKeyError(f"{len(skeys)} keys but {len(page_ids)} page ids")
        if not skeys:
            return []
        fmt = self._pool_format(host_pool)
        out: list[bool] = []
        mismatched = 0
        lru = self._lru
        with self._keys.lock:
            formats = self._keys.formats
            for skey in skeys:
                stored = formats.get(skey)
                if stored is None:
                    if lru is not None:
                        lru.discard(skey)
                    out.append(False)
                elif stored != fmt:
                    mismatched += 1
                    out.append(False)
                else:
                    if lru is not None:
                        lru.touch(skey)
                    out.append(True)
        hits = out.count(True)
        self._stats.add(gets=len(skeys), hits=hits, misses=len(skeys) - hits, format_mismatch=mismatched,
                        bytes_read=hits * int(host_pool.page_nbytes))
        return out

    def batch_set_from(self, keys: Sequence[str], host_pool: Any, page_ids: Sequence[int]) -> list[bool]:
        skeys = self._enter(keys)
        if len(page_ids) != len(skeys):
            raise StorageKeyError(f"{len(skeys)} keys but {len(page_ids)} page ids")
        if not skeys:
            return []
        fmt, nbytes = self._pool_format(host_pool), int(host_pool.page_nbytes)
        outcomes = self._guard(self._record, skeys, nbytes, fmt)
        written = outcomes.count(WRITTEN)
        self._stats.add(sets=len(skeys), skipped_existing=outcomes.count(EXISTS),
                        set_failures=outcomes.count(FAILED), bytes_written=written * nbytes)
        return [o != FAILED for o in outcomes]

    def _record(self, skeys: list[str], nbytes: int, fmt: bytes) -> list[str]:
        outcomes = []
        lru = self._lru
        with self._keys.lock:
            formats = self._keys.formats
            fits = lru is None or lru.fits(nbytes)
            for skey in skeys:
                if skey in formats:
                    outcomes.append(EXISTS)
                elif not fits:
                    outcomes.append(FAILED)
                else:
                    formats[skey] = fmt
                    if lru is not None:
                        lru.add(skey, nbytes)
                    outcomes.append(WRITTEN)
            victims = lru.over_budget() if lru is not None else []
            for victim in victims:
                formats.pop(victim, None)
        if victims:
            self._stats.add(evictions=len(victims))
            self._keys.evicted(victims)
        return outcomes

    # ------------------------------------------------------------------ hooks

    def _exists(self, skeys: list[str]) -> int:
        formats = self._keys.formats
        with self._keys.lock:
            n = 0
            for skey in skeys:
                if skey not in formats:
                    break
                n += 1
            return n

    def _get(self, skeys: list[str], fmt: bytes) -> list[bytes | None]:
        raise StorageKeyError("a keys-only backend keeps no page bytes: read pages with batch_get_into")

    def _set(self, skeys: list[str], payloads: list, fmt: bytes) -> list[str]:
        raise StorageKeyError("a keys-only backend keeps no page bytes: store pages with batch_set_from")

    def _clear(self) -> None:
        with self._keys.lock:
            for skey in [k for k in self._keys.formats if k.startswith(self._prefix)]:
                del self._keys.formats[skey]
            self._keys.renew_epoch()
            if self._lru is not None:
                self._lru.clear()

    def _close(self) -> None:
        with self._keys.lock:
            self._keys.backends.discard(self)
        if not self.store_name:
            self._keys.formats.clear()
