"""A dict-backed backend for tests and simulations (``memory://`` or ``memory://NAME``).

``memory://`` gives a private store; ``memory://NAME`` a store shared by every
backend opened with the same name in this process (so two tenants or two ranks
can be shown to stay apart). Values are kept in the same header + checksum
format as the other backends, so corruption behaves the same way. For injected
failures wrap a backend in :class:`hicache_fsm.storage.faults.FaultyBackend`.

With ``max_bytes`` the backend evicts least recently used pages and tells its
eviction listeners (``reports_evictions``). A page evicted from a shared store
is gone for every backend on it, so each of them forgets it and tells its own
listeners (a cluster of caches on one ``memory://NAME`` L3 all hear it).

A page that fails verification is removed from the store (``corrupt_removed``),
so that the next backup of its node stores it again; a page of another page
format is left alone.
"""

from __future__ import annotations

import threading
from typing import Sequence

from hicache_fsm.storage.base import (
    EXISTS,
    FAILED,
    WRITTEN,
    LRUIndex,
    SharedStore,
    StorageBackend,
)
from hicache_fsm.storage.blob import CorruptPage, decode_blob
from hicache_fsm.storage.keys import KeyNamespace
from hicache_fsm.storage.page_format import PageFormat

__all__ = ["MemoryBackend"]


class _Store(SharedStore):
    def __init__(self) -> None:
        super().__init__()
        self.data: dict[str, bytes] = {}


_SHARED: dict[str, _Store] = {}
_SHARED_LOCK = threading.Lock()


class MemoryBackend(StorageBackend):
    """In-process storage; ``max_bytes`` caps this namespace's payload bytes with LRU eviction."""

    scheme = "memory"

    @property
    def reports_evictions(self) -> bool:  # type: ignore[override]
        """Only a cap evicts: this backend's own, or another's on the same shared store and namespace."""
        return self._lru.max_bytes is not None or bool(self.store_name)

    def __init__(
        self,
        namespace: KeyNamespace | None = None,
        *,
        store: str | None = None,
        max_bytes: int | None = None,
        checksum: str = "wsum64",
        page_format: PageFormat | None = None,
    ) -> None:
        super().__init__(namespace, checksum=checksum, page_format=page_format)
        if store:
            with _SHARED_LOCK:
                self._mem = _SHARED.setdefault(store, _Store())
        else:
            self._mem = _Store()
        self.store_name = store
        self._sibling = False  # a view of another backend's store (``sibling``): closing it keeps the pages
        self._lru = LRUIndex(max_bytes)
        with self._mem.lock:  # adopt pages already in a shared store
            self._mem.backends.add(self)
            prefix = self.namespace.prefix
            for skey, blob in self._mem.data.items():
                if skey.startswith(prefix):
                    self._lru.add(skey, len(blob))

    def fork(self, memo: dict) -> "MemoryBackend":
        """A copy with its own store (a private ``memory://`` backend only: a shared store is not ours to copy)."""
        if id(self) in memo:
            return memo[id(self)]
        if self.store_name:
            raise NotImplementedError(f"cannot fork memory://{self.store_name}: its store is shared")
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new._stats = self._stats.fork()
        with self._mem.lock:
            store = _Store()
            store.data = dict(self._mem.data)
            store.epoch = self._mem.epoch  # the same pages: nothing was lost (a new epoch tells holders it was)
            new._lru = self._lru.fork()
        new._mem = store
        new._eviction_listeners = ()  # the copy's evictions are its own holder's business
        store.backends.add(new)
        memo[id(self)] = new
        return new

    def sibling(self, namespace: KeyNamespace) -> "MemoryBackend":
        """A backend over this one's store under ``namespace``: another model or tenant writing beside this one
        (what isolation tests need of a private store). Closing it leaves the store as it is."""
        new = MemoryBackend(namespace, checksum=self.checksum, page_format=self.page_format)
        with self._mem.lock:  # its own empty store is dropped unused
            new._mem, new.store_name, new._sibling = self._mem, self.store_name, True
            self._mem.backends.add(new)
            prefix = new.namespace.prefix
            for skey, blob in self._mem.data.items():
                if skey.startswith(prefix):
                    new._lru.add(skey, len(blob))
        return new

    def stored_blob(self, skey: str) -> bytes:
        """The bytes stored under ``skey`` as written (header and checksums included); b"" if absent."""
        with self._mem.lock:
            return bytes(self._mem.data.get(skey, b""))

    def stored_keys(self) -> list[str]:
        """Storage keys of every page this backend holds, sorted (tests and the explorer's state)."""
        with self._mem.lock:
            return sorted(self._mem.data)

    @staticmethod
    def drop_shared(name: str) -> None:
        """Forget a named shared store (test teardown)."""
        with _SHARED_LOCK:
            _SHARED.pop(name, None)

    def _exists(self, skeys: list[str]) -> int:
        data = self._mem.data
        with self._mem.lock:
            n = 0
            for skey in skeys:
                if skey not in data:
                    break
                n += 1
            return n

    def _get(self, skeys: list[str], fmt: bytes) -> list[bytes | None]:
        out: list[bytes | None] = []
        with self._mem.lock:
            for skey in skeys:
                blob = self._mem.data.get(skey)
                if blob is None:
                    self._lru.discard(skey)
                    out.append(None)
                    continue
                try:
                    out.append(bytes(decode_blob(blob, skey.encode(), fmt)))
                except CorruptPage as exc:
                    self._report_corrupt(skey, exc, lambda: self._remove_corrupt(skey, blob))
                    out.append(None)
                    continue
                self._lru.touch(skey)
        return out

    def _remove_corrupt(self, skey: str, blob: bytes) -> bool:
        """Drop ``skey`` if it still holds the corrupt ``blob`` read, so that the next backup stores it again."""
        with self._mem.lock:
            if self._mem.data.get(skey) is not blob:
                return False
            del self._mem.data[skey]
            self._mem.forget([skey])  # every backend on the store stops counting its bytes toward a cap
        return True

    def _set(self, skeys: list[str], payloads: list[list[memoryview]], fmt: bytes) -> list[str]:
        outcomes = []
        with self._mem.lock:
            for skey, parts in zip(skeys, payloads):
                if skey in self._mem.data:
                    outcomes.append(EXISTS)
                    continue
                nbytes = sum(len(p) for p in parts)
                if not self._lru.fits(nbytes):
                    outcomes.append(FAILED)
                    continue
                self._mem.data[skey] = b"".join([self._encode_header(skey, parts, fmt), *parts])
                self._lru.add(skey, nbytes)
                outcomes.append(WRITTEN)
            victims = self._lru.over_budget()
            for victim in victims:
                self._mem.data.pop(victim, None)
        if victims:
            self._stats.add(evictions=len(victims))
            self._mem.evicted(victims)
        return outcomes

    def _clear(self) -> None:
        prefix = self.namespace.prefix
        with self._mem.lock:
            for skey in [k for k in self._mem.data if k.startswith(prefix)]:
                del self._mem.data[skey]
            self._mem.renew_epoch()
            self._lru.clear()

    def _forget_recency(self, skeys: Sequence[str]) -> None:
        for skey in skeys:
            self._lru.discard(skey)

    def data_epoch(self) -> int:
        """Goes up whenever stored pages were dropped wholesale (``clear``): the tier stores its nodes again."""
        self._check_open()
        return self._mem.epoch

    def _close(self) -> None:
        with self._mem.lock:
            self._mem.backends.discard(self)
        if not self.store_name and not self._sibling:
            self._mem.data.clear()

    def debug_corrupt(self, key: str) -> bool:
        skey = self.namespace.storage_key(key)
        with self._mem.lock:
            blob = self._mem.data.get(skey)
            if blob is None:
                return False
            damaged = bytearray(blob)
            damaged[-1] ^= 0xFF
            self._mem.data[skey] = bytes(damaged)
            return True
