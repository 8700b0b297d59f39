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

Keys are kept per namespace, as the page keys the caller passed (checked, not
prefixed): a trace replay reads and writes millions of them, and the caller's
own key strings (whose hash Python caches) then serve every lookup.
"""

from __future__ import annotations

import threading
from itertools import takewhile
from typing import Any, Sequence

from hicache_fsm.errors import StorageKeyError
from hicache_fsm.storage.base import (EXISTS, FAILED, WRITTEN, LRUIndex, SharedStore, StorageBackend,
                                      check_host_pool)
from hicache_fsm.storage.keys import KeyNamespace, validate_page_keys
from hicache_fsm.storage.page_format import PageFormat

__all__ = ["KeysOnlyBackend"]


class _KeyStore(SharedStore):
    def __init__(self) -> None:
        super().__init__()
        self.spaces: dict[str, dict[str, bytes]] = {}  # namespace prefix -> page key -> page format written in


_SHARED: dict[str, _KeyStore] = {}
_SHARED_LOCK = threading.Lock()


class KeysOnlyBackend(StorageBackend):
    """Stored keys and their page format only (see the module docstring); ``max_bytes`` caps with LRU eviction.

    Its hooks take this namespace's page keys (``_enter`` checks them and
    leaves them unprefixed); only eviction reports name storage keys.
    """

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
            self._formats = self._keys.spaces.setdefault(self._prefix, {})  # cleared in place, never replaced
            self._keys.backends.add(self)

    @staticmethod
    def drop_shared(name: str) -> None:
        """Forget a named shared key set."""
        with _SHARED_LOCK:
            _SHARED.pop(name, None)

    def stored_keys(self) -> list[str]:
        """Storage keys of every page this backend's key set holds, sorted."""
        with self._keys.lock:
            return sorted(prefix + key for prefix, keys in self._keys.spaces.items() for key in keys)

    def _enter(self, keys: Sequence[str]) -> list[str]:
        """This namespace's page keys, checked (the base class would prefix them into storage keys)."""
        return validate_page_keys(self._open_keys(keys))

    def _forget_recency(self, skeys: Sequence[str]) -> None:
        if self._lru is not None:
            prefix, cut = self._prefix, len(self._prefix)
            for skey in skeys:
                if skey.startswith(prefix):
                    self._lru.discard(skey[cut:])

    def data_epoch(self) -> int:
        """Goes up whenever stored keys were dropped wholesale (``clear``)."""
        self._check_open()
        return self._keys.epoch

    # ------------------------------------------------------------------ host-pool calls, bytes untouched

    def batch_get_into(self, keys: Sequence[str], host_pool: Any, page_ids: Sequence[int]) -> list[bool]:
        check_host_pool(host_pool)
        pkeys = self._enter(keys)
        if len(page_ids) != len(pkeys):
            raise StorageKeyError(f"{len(pkeys)} keys but {len(page_ids)} page ids")
        if not pkeys:
            return []
        fmt = self._pool_format(host_pool)
        lru = self._lru
        with self._keys.lock:
            stored = list(map(self._formats.get, pkeys))
            if lru is not None:
                for key, got in zip(pkeys, stored):
                    if got is None:
                        lru.discard(key)
                    elif got == fmt:
                        lru.touch(key)
        out = [got == fmt for got in stored]
        hits = out.count(True)
        mismatched = len(stored) - hits - stored.count(None)
        self._stats.add(gets=len(pkeys), hits=hits, misses=len(pkeys) - hits, format_mismatch=mismatched,
                        bytes_read=hits * int(host_pool.page_nbytes))
        return out

    def batch_set_from(self, keys: Sequence[str], host_pool: Any, page_ids: Sequence[int]) -> list[bool]:
        check_host_pool(host_pool)
        pkeys = self._enter(keys)
        if len(page_ids) != len(pkeys):
            raise StorageKeyError(f"{len(pkeys)} keys but {len(page_ids)} page ids")
        if not pkeys:
            return []
        fmt, nbytes = self._pool_format(host_pool), int(host_pool.page_nbytes)
        outcomes = self._guard(self._record, pkeys, nbytes, fmt)
        written = outcomes.count(WRITTEN)
        self._stats.add(sets=len(pkeys), skipped_existing=outcomes.count(EXISTS),
                        set_failures=outcomes.count(FAILED), bytes_written=written * nbytes)
        return [o != FAILED for o in outcomes]

    def _record(self, pkeys: list[str], nbytes: int, fmt: bytes) -> list[str]:
        lru = self._lru
        with self._keys.lock:
            formats = self._formats
            if lru is None:
                return self._record_uncapped(formats, pkeys, fmt)
            outcomes = []
            fits = lru.fits(nbytes)
            for key in pkeys:
                if key in formats:
                    outcomes.append(EXISTS)
                elif not fits:
                    outcomes.append(FAILED)
                else:
                    formats[key] = fmt
                    lru.add(key, nbytes)
                    outcomes.append(WRITTEN)
            victims = lru.over_budget()
            for victim in victims:
                formats.pop(victim, None)
        if victims:
            self._stats.add(evictions=len(victims))
            self._keys.evicted([self._prefix + key for key in victims])
        return outcomes

    @staticmethod
    def _record_uncapped(formats: dict[str, bytes], pkeys: list[str], fmt: bytes) -> list[str]:
        """Without a cap every new key is written: one dict pass for the whole batch."""
        before = len(formats)
        present = list(map(formats.__contains__, pkeys))
        formats.update(dict.fromkeys(pkeys, fmt) if not any(present) else
                       {key: fmt for key, there in zip(pkeys, present) if not there})
        if len(formats) - before == present.count(False):
            return [EXISTS if there else WRITTEN for there in present]
        # a key repeated within the batch: the first copy is written, the others exist by then
        seen: set[str] = set()
        outcomes = []
        for key, there in zip(pkeys, present):
            outcomes.append(EXISTS if there or key in seen else WRITTEN)
            seen.add(key)
        return outcomes

    # ------------------------------------------------------------------ hooks (on this namespace's page keys)

    def _exists(self, pkeys: list[str]) -> int:
        with self._keys.lock:
            return len(list(takewhile(self._formats.__contains__, pkeys)))

    def _get(self, pkeys: list[str], fmt: bytes) -> list[bytes | None]:
        raise StorageKeyError("a keys-only backend keeps no page bytes: read pages with batch_get_into")

    def _set(self, pkeys: list[str], payloads: list, fmt: bytes) -> list[str]:
        raise StorageKeyError("a keys-only backend keeps no page bytes: store pages with batch_set_from")

    def _clear(self) -> None:
        with self._keys.lock:
            self._formats.clear()
            self._keys.renew_epoch()
            if self._lru is not None:
                self._lru.clear()

    def _close(self) -> None:
        with self._keys.lock:
            self._keys.backends.discard(self)
        if not self.store_name:
            self._formats.clear()
