"""The embedded default backend: one file per page under a directory (``file:///DIR``).

Layout::

    DIR/ns-<16 hex>/NAMESPACE          the namespace prefix, for humans
    DIR/ns-<16 hex>/<2 hex>/<32 hex>.kv one page

The namespace directory name is a BLAKE2b digest of the namespace prefix and a
page's file name a BLAKE2b digest of its full storage key, so no user-supplied
string ever becomes part of a path. Each file holds the shared header (magic,
version, lengths, payload checksum, header CRC-32), the storage key, then
the payload.

* Writes go to a temporary file in the same directory and are renamed into place
  (``os.replace``), so a reader sees a whole page or nothing; a failed write
  removes its temporary file. ``fsync=True`` also flushes before the rename.
  Opening a store removes temporary files a crashed writer left: those whose
  writer process (named in the file name) is gone from this host, and any older
  than 10 minutes (counted ``orphans_removed``).
* A key whose file exists is not rewritten (counted ``skipped_existing``).
* A missing file is a miss; a short, oversized or checksum-failing file is a miss
  counted ``corrupt`` and is deleted (if it is still the file read: same device,
  inode and mtime), so that the next backup writes the page again
  (``corrupt_removed``); a page of another page format is left alone. Something
  other than a regular file where a page should be (a directory, a FIFO) is a
  miss counted ``corrupt`` too, and is not ours to delete. Any other OS error
  raises StorageError; a write refused for space (ENOSPC/EDQUOT/EFBIG) or
  permission (EROFS/EACCES/EPERM: a read-only store) raises StorageFull, so
  backups back off per node while reads go on.
* ``max_bytes`` caps the bytes of this namespace's files: least recently used
  pages are deleted first, and reported to the eviction listeners (each file's
  storage key is read from its header before it is deleted). Recency is tracked in memory, seeded from file mtimes
  when the backend opens (hits refresh the mtime), so it survives restarts but
  does not see pages other processes write meanwhile.
* ``batch_get_into`` reads header, key and payload with one ``readv`` straight
  into the host pool's page views; ``batch_set_from`` writes them with ``writev``.
* ``io_threads > 1`` spreads a batch's pages over a thread pool (file I/O and
  the checksum release the GIL).
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import logging
import os
import stat
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence, TypeVar

from hicache_fsm.errors import StorageError, StorageFull, StorageTimeout, StorageUnavailable
from hicache_fsm.storage.backend_checks import check_count, check_flag
from hicache_fsm.storage.base import (
    EXISTS,
    FAILED,
    WRITTEN,
    LRUIndex,
    StorageBackend,
)
from hicache_fsm.storage.blob import HEADER, CorruptPage, parse_header, verify_payload
from hicache_fsm.storage.keys import KeyNamespace
from hicache_fsm.storage.page_format import PageFormat

__all__ = ["FileBackend"]

logger = logging.getLogger("hicache_fsm.storage")

_SUFFIX = ".kv"
_TMP_SUFFIX = ".tmp"
_STALE_TMP_SECONDS = 600.0
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_FULL_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EFBIG}
_REFUSED_WRITE_ERRNOS = {errno.EROFS, errno.EACCES, errno.EPERM}  # a read-only store: reads still work
# what one page's path can raise when something else took its place (a symlink loop, a file where its shard
# directory was): that page is a miss, not the store down
_NOT_A_PAGE_ERRNOS = {errno.ELOOP, errno.ENOTDIR}
_UNAVAILABLE_ERRNOS = {
    getattr(errno, name) for name in ("ENOTCONN", "ESTALE", "EHOSTDOWN", "EHOSTUNREACH", "ENODEV") if hasattr(errno, name)
}
_T = TypeVar("_T")


def _digest(text: str, size: int) -> str:
    return hashlib.blake2b(text.encode(), digest_size=size).hexdigest()


def _os_error(exc: OSError, what: str, *, write: bool = False) -> StorageError:
    """The StorageError for ``exc``; a ``write`` the store refuses (full, read-only) is StorageFull: not an outage."""
    message = f"{what}: {exc.strerror or exc}"
    if exc.errno in _FULL_ERRNOS or (write and exc.errno in _REFUSED_WRITE_ERRNOS):
        return StorageFull(message)
    if exc.errno == errno.ETIMEDOUT:
        return StorageTimeout(message)
    if exc.errno in _UNAVAILABLE_ERRNOS:
        return StorageUnavailable(message)
    return StorageError(message)


def _writer_alive(tmp_name: str) -> bool:
    """Whether the process that named temporary file ``tmp_name`` (``.NAME.PID.TID.N.tmp``) still runs here."""
    fields = tmp_name.split(".")
    try:
        pid = int(fields[-4])
    except (IndexError, ValueError):
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _writev_all(fd: int, parts: list) -> None:
    views = [memoryview(p) for p in parts if len(p)]
    while views:
        written = os.writev(fd, views)
        if written <= 0:
            raise OSError(errno.EIO, "writev wrote nothing")
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if written:
            views[0] = views[0][written:]


class FileBackend(StorageBackend):
    """Pages as files under ``root``; see the module docstring for the guarantees."""

    scheme = "file"

    @property
    def reports_evictions(self) -> bool:  # type: ignore[override]
        """Only ``max_bytes`` evicts (files deleted by others are found by ``verify_stored``)."""
        return self._lru.max_bytes is not None

    def __init__(
        self,
        root: str | os.PathLike[str],
        namespace: KeyNamespace | None = None,
        *,
        max_bytes: int | None = None,
        fsync: bool = False,
        io_threads: int = 1,
        checksum: str = "wsum64",
        page_format: PageFormat | None = None,
    ) -> None:
        super().__init__(namespace, checksum=checksum, page_format=page_format)
        check_count("io_threads", io_threads)
        self.root = os.path.abspath(os.fspath(root))
        self.fsync = check_flag("fsync", fsync)
        self._lru = LRUIndex(max_bytes)
        self._lock = threading.Lock()
        self._tmp_counter = itertools.count()
        self._made_dirs: set[str] = set()
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="hicache-file") if io_threads > 1 else None
        self.ns_dir = os.path.join(self.root, "ns-" + _digest(self.namespace.prefix, 8))
        try:
            os.makedirs(self.ns_dir, exist_ok=True)
            label = os.path.join(self.ns_dir, "NAMESPACE")
            if not os.path.exists(label):
                self._write_atomic(label, [self.namespace.prefix.encode() + b"\n"])
            if not os.path.exists(self._epoch_path()):
                self._new_epoch()
        except OSError as exc:
            raise _os_error(exc, f"cannot open storage directory {self.root}") from exc
        if not os.access(self.ns_dir, os.W_OK | os.X_OK):
            raise StorageUnavailable(f"storage directory {self.ns_dir} is not writable")
        self._stats.add(orphans_removed=self._remove_orphans())
        if max_bytes is not None:
            self._seed_lru()

    @property
    def max_bytes(self) -> int | None:
        return self._lru.max_bytes

    def path_for(self, key: str) -> str:
        """The file that holds page key ``key`` (whether or not it exists)."""
        return self._path(self.namespace.storage_key(key))

    # -- layout -----------------------------------------------------------

    def _path(self, skey: str) -> str:
        name = _digest(skey, 16)
        return os.path.join(self.ns_dir, name[:2], name + _SUFFIX)

    def _shards(self) -> list[str]:
        try:
            with os.scandir(self.ns_dir) as it:
                return [e.path for e in it if e.is_dir(follow_symlinks=False) and len(e.name) == 2]
        except FileNotFoundError:
            return []

    def _remove_orphans(self) -> int:
        """Delete temporary files left by writers that died (see the module docstring); how many."""
        removed = 0
        now = time.time()
        for shard in self._shards():
            try:
                with os.scandir(shard) as it:
                    tmps = [e for e in it if e.name.endswith(_TMP_SUFFIX)]
            except OSError:
                continue
            for entry in tmps:
                try:
                    age = now - entry.stat(follow_symlinks=False).st_mtime
                except FileNotFoundError:
                    continue
                if age > _STALE_TMP_SECONDS or not _writer_alive(entry.name):
                    self._unlink(entry.path)
                    removed += 1
        if removed:
            logger.warning("FileBackend: removed %d temporary files left by crashed writers in %s", removed, self.ns_dir)
        return removed

    def _seed_lru(self) -> None:
        found = []
        for shard in self._shards():
            with os.scandir(shard) as it:
                for entry in it:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if entry.name.endswith(_SUFFIX):
                        found.append((st.st_mtime_ns, entry.path, st.st_size))
        found.sort()
        for _, path, size in found:
            self._lru.add(path, size)
        self._evict(self._lru.over_budget())

    def _evict(self, victims: list) -> None:
        """Delete the evicted pages' files and tell the eviction listeners their keys."""
        keys = []
        for victim in victims:
            if self._eviction_listeners:
                skey = self._stored_key(victim)
                if skey is not None:
                    keys.append(skey)
            self._unlink(victim)
        if victims:
            self._stats.add(evictions=len(victims))
        if keys:
            self._report_evicted(keys)

    @staticmethod
    def _stored_key(path: str) -> str | None:
        """The storage key a page file's header names; None if it cannot be read (gone, short)."""
        try:
            fd = os.open(path, os.O_RDONLY | _O_CLOEXEC)
        except OSError:
            return None
        try:
            head = os.pread(fd, HEADER.size, 0)
            if len(head) < HEADER.size:
                return None
            key_len = HEADER.unpack_from(head, 0)[3]
            key = os.pread(fd, key_len, HEADER.size)
            return key.decode("utf-8") if len(key) == key_len else None
        except (OSError, UnicodeDecodeError):
            return None
        finally:
            os.close(fd)

    @staticmethod
    def _unlink(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def _map(self, fn: Callable[..., _T], *iterables: Sequence) -> list[_T]:
        if self._pool is None or len(iterables[0]) < 2:
            return [fn(*args) for args in zip(*iterables)]
        futures = [self._pool.submit(fn, *args) for args in zip(*iterables)]
        results, first_error = [], None
        for fut in futures:  # wait for all, so nothing still runs when we raise
            try:
                results.append(fut.result())
            except StorageError as exc:
                first_error = first_error or exc
                results.append(None)
        if first_error is not None:
            raise first_error
        return results

    # -- hooks ------------------------------------------------------------

    def _exists(self, skeys: list[str]) -> int:
        n = 0
        for skey in skeys:
            try:
                st = os.stat(self._path(skey))
            except FileNotFoundError:
                break
            except OSError as exc:
                if exc.errno in _NOT_A_PAGE_ERRNOS:  # this page's path alone is broken (a symlink loop): a miss
                    break
                raise _os_error(exc, f"stat of page {skey}") from exc
            if not stat.S_ISREG(st.st_mode):  # a directory or FIFO is no stored page, and not ours to delete
                self._report_corrupt(skey, f"not a regular file (mode {st.st_mode:o})")
                break
            if st.st_size < HEADER.size:
                self._drop_short(skey, st.st_size)
                break
            n += 1
        return n

    def _drop_short(self, skey: str, size: int) -> None:
        """A page file shorter than a header (a copy cut short): a miss counted corrupt, removed so a backup rewrites it."""
        path, fd = self._open_page(skey)
        if fd is None:
            return
        try:
            self._report_corrupt(skey, f"file is {size} bytes, shorter than a page header",
                                 lambda: self._remove_corrupt(path, fd))
        finally:
            os.close(fd)

    def _get(self, skeys: list[str], fmt: bytes) -> list[bytes | None]:
        return self._map(self._read_one, skeys, [fmt] * len(skeys))

    def _get_into(self, skeys: list[str], dests: list[list[memoryview]], fmt: bytes) -> list[bool]:
        return self._map(self._read_into_one, skeys, dests, [fmt] * len(skeys))

    def _set(self, skeys: list[str], payloads: list[list[memoryview]], fmt: bytes) -> list[str]:
        outcomes = self._map(self._write_one, skeys, payloads, [fmt] * len(skeys))
        if self._lru.max_bytes is not None:
            with self._lock:
                victims = self._lru.over_budget()
            self._evict(victims)
        return outcomes

    def _epoch_path(self) -> str:
        return os.path.join(self.ns_dir, "EPOCH")

    def _new_epoch(self) -> int:
        epoch = uuid.uuid4().int >> 66  # a fresh 62-bit token: another store's or clear's is never the same
        self._write_atomic(self._epoch_path(), [str(epoch).encode()])
        return epoch

    def data_epoch(self) -> int:
        """A token written when the store is created or cleared; a wiped directory gets a new one here.

        When it changes, every stored page may be gone and the tier stores its nodes again.
        """
        self._check_open()
        try:
            with open(self._epoch_path(), "rb") as f:
                return int(f.read(32))
        except (OSError, ValueError):  # wiped (or damaged): the pages under it cannot be trusted either
            try:
                os.makedirs(self.ns_dir, exist_ok=True)
                return self._new_epoch()
            except OSError as exc:
                raise _os_error(exc, f"writing the data epoch in {self.ns_dir}", write=True) from exc

    def _clear(self) -> None:
        try:
            for shard in self._shards():
                with os.scandir(shard) as it:
                    for entry in it:
                        if entry.name.endswith(_SUFFIX) or entry.name.endswith(_TMP_SUFFIX):
                            self._unlink(entry.path)
            self._new_epoch()
        except OSError as exc:
            raise _os_error(exc, f"clearing {self.ns_dir}") from exc
        with self._lock:
            self._lru.clear()

    def _close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def debug_corrupt(self, key: str) -> bool:
        path = self.path_for(key)
        try:
            with open(path, "r+b") as f:
                f.seek(-1, os.SEEK_END)
                last = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last[0] ^ 0xFF]))
            return True
        except FileNotFoundError:
            return False

    # -- one page -----------------------------------------------------------

    def _hit(self, path: str) -> None:
        if self._lru.max_bytes is None:
            return
        with self._lock:
            self._lru.touch(path)
        try:
            os.utime(path)
        except OSError:
            pass

    def _gone(self, path: str) -> None:
        if self._lru.max_bytes is not None:
            with self._lock:
                self._lru.discard(path)

    def _open_page(self, skey: str) -> tuple[str, int | None]:
        """The page's path and an open fd, or None for a missing file or a directory in its place (a miss).

        O_NONBLOCK: a FIFO in a page's place must not block the open (it changes nothing for a regular file).
        """
        path = self._path(skey)
        try:
            return path, os.open(path, os.O_RDONLY | os.O_NONBLOCK | _O_CLOEXEC)
        except FileNotFoundError:
            self._gone(path)
            return path, None
        except IsADirectoryError:
            self._report_corrupt(skey, "a directory where its file should be")
            return path, None
        except OSError as exc:
            if exc.errno in _NOT_A_PAGE_ERRNOS:  # this page's path alone is broken: a miss, the store stays healthy
                self._report_corrupt(skey, f"its path cannot be opened ({exc.strerror})")
                return path, None
            raise _os_error(exc, f"opening page {skey}") from exc

    @staticmethod
    def _page_size(fd: int) -> int:
        """The size of the open page file; CorruptPage when it is not a regular file (a directory, a FIFO)."""
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptPage(f"not a regular file (mode {st.st_mode:o})")
        return st.st_size

    def _remove_corrupt(self, path: str, fd: int) -> bool:
        """Delete the corrupt page file open as ``fd`` if ``path`` still names it, so that the next backup writes it.

        A file a writer renamed into place since the read (another inode or mtime) is left alone, and so is anything
        but a regular file (not ours).
        """
        try:
            held, now = os.fstat(fd), os.stat(path)
            if not stat.S_ISREG(held.st_mode) or (held.st_dev, held.st_ino, held.st_mtime_ns) != (
                    now.st_dev, now.st_ino, now.st_mtime_ns):
                return False
            os.unlink(path)
        except OSError:  # gone already, or a read-only store: it stays a miss
            return False
        self._gone(path)
        return True

    def _read_one(self, skey: str, fmt: bytes) -> bytes | None:
        path, fd = self._open_page(skey)
        if fd is None:
            return None
        key = skey.encode()
        try:
            size = self._page_size(fd)
            head = os.read(fd, HEADER.size + len(key))
            payload_len, algo, check = parse_header(head, key, fmt)
            if size != len(head) + payload_len:
                raise CorruptPage(f"file is {size} bytes, header says {len(head) + payload_len}")
            chunks = []
            remaining = payload_len
            while remaining:
                chunk = os.read(fd, remaining)
                if not chunk:
                    raise CorruptPage("file ended early")
                chunks.append(chunk)
                remaining -= len(chunk)
            data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            verify_payload([data], algo, check)
        except CorruptPage as exc:
            self._report_corrupt(skey, exc, lambda: self._remove_corrupt(path, fd))
            return None
        except OSError as exc:
            raise _os_error(exc, f"reading page {skey}") from exc
        finally:
            os.close(fd)
        self._hit(path)
        return data

    def _read_into_one(self, skey: str, parts: list[memoryview], fmt: bytes) -> bool:
        path, fd = self._open_page(skey)
        if fd is None:
            return False
        key = skey.encode()
        head = bytearray(HEADER.size + len(key))
        expected = len(head) + sum(len(p) for p in parts)
        try:
            size = self._page_size(fd)
            if size != expected:  # another format (its header says so), damaged, or intact but of another size
                payload_len = parse_header(os.read(fd, len(head)), key, fmt)[0]
                if size != len(head) + payload_len:
                    raise CorruptPage(f"file is {size} bytes, header says {len(head) + payload_len}")
                self._report_corrupt(skey, f"stored page is {size} bytes, a page here is {expected}")  # kept: intact
                return False
            got = os.readv(fd, [head, *parts])
            while got < expected:  # rare: a short readv on a regular file
                more = self._readv_rest(fd, [head, *parts], got)
                if more == 0:
                    raise CorruptPage("file ended early")
                got += more
            payload_len, algo, check = parse_header(head, key, fmt)
            if payload_len != expected - len(head):
                raise CorruptPage("payload length mismatch")
            verify_payload(parts, algo, check)
        except CorruptPage as exc:
            self._report_corrupt(skey, exc, lambda: self._remove_corrupt(path, fd))
            return False
        except OSError as exc:
            raise _os_error(exc, f"reading page {skey}") from exc
        finally:
            os.close(fd)
        self._hit(path)
        return True

    @staticmethod
    def _readv_rest(fd: int, buffers: list, done: int) -> int:
        views = []
        for buf in buffers:
            view = memoryview(buf)
            if done >= len(view):
                done -= len(view)
                continue
            views.append(view[done:])
            done = 0
        return os.readv(fd, views) if views else 0

    def _write_one(self, skey: str, parts: list[memoryview], fmt: bytes) -> str:
        path = self._path(skey)
        try:
            st = os.stat(path)
        except OSError:  # missing (or unreadable: the write below names the fault)
            st = None
        if st is not None and (st.st_size >= HEADER.size or not stat.S_ISREG(st.st_mode)):
            return EXISTS  # a page, or something that is not ours to replace; a shorter file is written over
        total = HEADER.size + len(skey.encode()) + sum(len(p) for p in parts)
        if not self._lru.fits(total):
            logger.warning(
                "FileBackend: page %s (%d bytes) exceeds max_bytes=%d; not stored", skey, total, self._lru.max_bytes
            )
            return FAILED
        header = self._encode_header(skey, parts, fmt)
        shard = os.path.dirname(path)
        try:
            if shard not in self._made_dirs:
                os.makedirs(shard, exist_ok=True)
                self._made_dirs.add(shard)
            try:
                self._write_atomic(path, [header, *parts])
            except FileNotFoundError:  # the directory was removed under us: recreate it once
                os.makedirs(shard, exist_ok=True)
                self._write_atomic(path, [header, *parts])
        except OSError as exc:
            self._made_dirs.discard(shard)
            raise _os_error(exc, f"writing page {skey}", write=True) from exc
        if self._lru.max_bytes is not None:
            with self._lock:
                self._lru.add(path, total)
        return WRITTEN

    def _write_atomic(self, path: str, parts: list) -> None:
        directory, name = os.path.split(path)
        tmp = os.path.join(directory, f".{name}.{os.getpid()}.{threading.get_ident()}.{next(self._tmp_counter)}{_TMP_SUFFIX}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o644)
        try:
            try:
                _writev_all(fd, parts)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            self._unlink(tmp)
            raise
