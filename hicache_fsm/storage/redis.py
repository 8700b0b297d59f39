"""Redis backend (``redis://HOST:PORT/DB``) on redis-py.

* One blocking connection pool per backend; ``socket_timeout`` bounds every
  command, ``connect_timeout`` every connect. A dropped connection is retried
  ``retries`` times at once (so the first call after a server restart works);
  timeouts are not retried.
* Batches are pipelined (no MULTI): EXISTS per key for ``batch_exists``; GET per
  key for gets; EXISTS then ``SET NX`` (optionally ``EX ttl``) for sets, so pages
  already stored are neither re-sent nor overwritten. Pipelines are cut every
  ``chunk_pages`` pages to bound client memory. SETs are framed by hand so the
  header and the host page's views go to the socket without a joined copy.
* Values are raw bytes: the shared header (magic, version, lengths, checksums),
  the key, then the payload; never pickle. A value that fails verification is
  a miss counted ``corrupt`` and is deleted if it still holds the bytes read (a
  compare-and-delete script: a good page written since stays), so that the next
  backup stores the page again (``corrupt_removed``); a page of another page
  format is left alone. A key of another type (WRONGTYPE) is a miss counted
  ``corrupt`` for that key only, and is not ours to delete.
* redis-py errors map to StorageTimeout (timeouts), StorageUnavailable
  (connection trouble, read-only replica, server loading), StorageFull (OOM)
  and StorageError (anything else).
* ``clear()`` SCANs this namespace's prefix and UNLINKs what it finds; it never
  flushes the database.
* ``data_epoch()`` is a random token under ``{prefix}/data-epoch`` (no page key
  holds a '/'), written with ``SET NX`` (never a TTL) when missing, so clients
  racing agree on it. A server restarted on empty memory, a ``FLUSHALL`` /
  ``FLUSHDB`` or a ``clear()`` drops it with the pages: the epoch changes and
  the tier stores its nodes again.
* Keys the server drops by itself (``maxmemory`` eviction, a ``ttl`` expiring)
  are not reported to eviction listeners (``reports_evictions`` is False: the
  client is never told); ``StorageTier.verify_stored`` finds those pages.

``batch_get_into`` still costs one copy from the reply buffer into the host
page (redis-py materialises replies as ``bytes``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import secrets
from typing import Iterator

import redis as redis_py
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MasterDownError, OutOfMemoryError, ReadOnlyError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from hicache_fsm.errors import (
    StorageError,
    StorageFull,
    StorageTimeout,
    StorageUnavailable,
    StorageURLError,
)
from hicache_fsm.storage.backend_checks import check_count, check_flag, check_seconds
from hicache_fsm.storage.base import (
    EXISTS,
    WRITTEN,
    StorageBackend,
)
from hicache_fsm.storage.blob import CorruptPage, decode_blob
from hicache_fsm.storage.keys import KeyNamespace
from hicache_fsm.storage.page_format import PageFormat
from hicache_fsm.storage.urls import check_url

__all__ = ["RedisBackend"]

logger = logging.getLogger("hicache_fsm.storage")

_EXISTS_CHUNK = 1024  # keys per EXISTS pipeline (replies are tiny)
_GLOB_CHARS = re.compile(r"([*?\[\]\\^])")
_EPOCH_SUFFIX = "/data-epoch"  # after the namespace prefix: no page key holds a '/', so none can be this key
# DEL KEYS[1] only while it still holds the value whose SHA-1 is ARGV[1] (a page rewritten since stays)
_DELETE_IF_SAME = (
    "local v = redis.call('GET', KEYS[1]) "
    "if v and redis.sha1hex(v) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
)


@contextlib.contextmanager
def _mapped(what: str) -> Iterator[None]:
    try:
        yield
    except RedisTimeoutError as exc:
        raise StorageTimeout(f"redis {what} timed out: {exc}") from exc
    except RedisConnectionError as exc:
        raise StorageUnavailable(f"redis {what}: server unreachable: {exc}") from exc
    except OutOfMemoryError as exc:
        raise StorageFull(f"redis {what}: out of memory: {exc}") from exc
    except (ReadOnlyError, MasterDownError) as exc:
        raise StorageUnavailable(f"redis {what}: {exc}") from exc
    except ResponseError as exc:
        text = str(exc)
        if text.startswith("OOM"):
            raise StorageFull(f"redis {what}: {text}") from exc
        raise StorageError(f"redis {what}: {text}") from exc
    except RedisError as exc:
        raise StorageError(f"redis {what}: {exc}") from exc


def _connection_pool(url: str, **options: object) -> redis_py.BlockingConnectionPool:
    """redis-py's pool for ``url``, with what redis-py would take silently or refuse only at the first connect
    refused now: a database that is not a number (redis-py falls back to 0), a port 0 (its default port) and an
    unknown URL parameter."""
    check_url(url)
    try:
        pool = redis_py.BlockingConnectionPool.from_url(url, **options)
        pool.connection_class(**pool.connection_kwargs)  # no I/O: the parameters' names and types
    except (TypeError, ValueError) as exc:
        raise StorageURLError(f"bad redis URL {url!r}: {exc}") from exc
    return pool


class RedisBackend(StorageBackend):
    """Pages as Redis string values under ``namespace.prefix + key``."""

    scheme = "redis"

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        namespace: KeyNamespace | None = None,
        *,
        socket_timeout: float = 5.0,
        connect_timeout: float = 1.0,
        max_connections: int = 16,
        retries: int = 1,
        ttl: int | None = None,
        chunk_pages: int = 32,
        check: bool = True,
        checksum: str = "wsum64",
        page_format: PageFormat | None = None,
    ) -> None:
        super().__init__(namespace, checksum=checksum, page_format=page_format)
        if ttl is not None:
            check_count("ttl (seconds)", ttl)  # an int: Redis's EX takes whole seconds
        socket_timeout = check_seconds("socket_timeout", socket_timeout)
        connect_timeout = check_seconds("connect_timeout", connect_timeout)
        self.url = url
        self.ttl = ttl
        self.chunk_pages = check_count("chunk_pages", chunk_pages)
        retry = Retry(NoBackoff(), check_count("retries", retries, minimum=0), supported_errors=(RedisConnectionError,))
        self._pool = _connection_pool(
            url,
            max_connections=check_count("max_connections", max_connections),
            timeout=connect_timeout + socket_timeout,
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
            retry=retry,
            health_check_interval=0,
        )
        self._client = redis_py.Redis(connection_pool=self._pool)
        if check_flag("check", check):
            try:
                with _mapped(f"PING {self._safe_url()}"):
                    self._client.ping()
            except StorageError:
                self._pool.disconnect()
                raise

    def _safe_url(self) -> str:
        return re.sub(r"//[^@/]*@", "//***@", self.url)

    def _chunks(self, items: list, size: int | None = None) -> Iterator[tuple[int, list]]:
        size = size or self.chunk_pages
        for start in range(0, len(items), size):
            yield start, items[start : start + size]

    # -- hooks ------------------------------------------------------------

    def _exists(self, skeys: list[str]) -> int:
        n = 0
        with _mapped("EXISTS"):
            for _, chunk in self._chunks(skeys, _EXISTS_CHUNK):
                pipe = self._client.pipeline(transaction=False)
                for skey in chunk:
                    pipe.exists(skey)
                for found in pipe.execute():
                    if not found:
                        return n
                    n += 1
        return n

    def _fetch(self, skeys: list[str]) -> Iterator[tuple[str, bytes | None]]:
        """Each key's value; a key of another type is a miss counted corrupt (one bad key is no outage)."""
        with _mapped("GET"):
            for _, chunk in self._chunks(skeys):
                pipe = self._client.pipeline(transaction=False)
                for skey in chunk:
                    pipe.get(skey)
                for skey, reply in zip(chunk, pipe.execute(raise_on_error=False)):
                    if isinstance(reply, ResponseError) and str(reply).startswith("WRONGTYPE"):
                        self._report_corrupt(skey, f"the key holds another type than a string: {reply}")
                        reply = None
                    elif isinstance(reply, Exception):
                        raise reply
                    yield skey, reply

    def _verified(self, skey: str, blob: bytes | None, fmt: bytes) -> memoryview | None:
        if blob is None:
            return None
        try:
            return decode_blob(blob, skey.encode(), fmt)
        except CorruptPage as exc:
            self._report_corrupt(skey, exc, lambda: self._remove_corrupt(skey, blob))
            return None

    def _remove_corrupt(self, skey: str, blob: bytes) -> bool:
        """Delete ``skey`` if it still holds the corrupt ``blob`` read, so that the next backup stores it again."""
        with _mapped("removing a corrupt page"):
            try:
                return bool(self._client.eval(_DELETE_IF_SAME, 1, skey, hashlib.sha1(blob).hexdigest()))
            except ResponseError as exc:  # scripting refused (ACL, a proxy): the page stays a miss
                logger.debug("RedisBackend: cannot remove corrupt page %s: %s", skey, exc)
                return False

    def _get(self, skeys: list[str], fmt: bytes) -> list[bytes | None]:
        out: list[bytes | None] = []
        for skey, blob in self._fetch(skeys):
            payload = self._verified(skey, blob, fmt)
            out.append(None if payload is None else bytes(payload))
        return out

    def _get_into(self, skeys: list[str], dests: list[list[memoryview]], fmt: bytes) -> list[bool]:
        out = []
        for (skey, blob), parts in zip(self._fetch(skeys), dests):
            payload = self._verified(skey, blob, fmt)
            out.append(payload is not None and self._scatter(skey, payload, parts))
        return out

    def _set(self, skeys: list[str], payloads: list[list[memoryview]], fmt: bytes) -> list[str]:
        outcomes: list[str] = []
        for start, chunk in self._chunks(skeys):
            with _mapped("EXISTS"):
                pipe = self._client.pipeline(transaction=False)
                for skey in chunk:
                    pipe.exists(skey)
                present = pipe.execute()
            todo = [i for i, found in enumerate(present) if not found]
            results: dict[int, object] = {}
            if todo:
                items = [(chunk[i], payloads[start + i]) for i in todo]
                with _mapped("SET"):
                    results = dict(zip(todo, self._send_sets(items, fmt)))
            outcomes.extend(WRITTEN if results.get(i) else EXISTS for i in range(len(chunk)))
        return outcomes

    def _send_sets(self, items: list[tuple[str, list[memoryview]]], fmt: bytes) -> list[object]:
        """Pipelined ``SET key value NX [EX ttl]`` sending header and payload parts without joining them.

        The RESP frames are written by hand so each host-page view goes to the
        socket as is (redis-py would need the value as one bytes object, i.e. a
        page-sized copy). One connection is taken from the pool; any error drops
        it, so no reply is ever read out of turn. SET NX is idempotent, so a
        dropped connection is retried like redis-py retries its own pipelines.
        """
        nargs = 4 if self.ttl is None else 6
        tail = b"$2\r\nNX\r\n" if self.ttl is None else b"$2\r\nNX\r\n$2\r\nEX\r\n$%d\r\n%d\r\n" % (
            len(str(self.ttl)), self.ttl)
        chunks: list[bytes | memoryview] = []
        pending = b""
        for skey, parts in items:
            key = skey.encode()
            head = self._encode_header(skey, parts, fmt)
            vlen = len(head) + sum(len(p) for p in parts)
            pending += b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s" % (nargs, len(key), key, vlen, head)
            for part in parts:
                if len(part) < 65536:
                    pending += bytes(part)
                else:
                    chunks.append(pending)
                    chunks.append(part)
                    pending = b""
            pending += b"\r\n" + tail
        chunks.append(pending)

        conn = self._pool.get_connection()
        try:
            def attempt() -> list[object]:
                conn.send_packed_command(chunks, check_health=False)
                return [conn.read_response() for _ in items]

            return conn.retry.call_with_retry(attempt, lambda error: conn.disconnect())
        except BaseException:
            conn.disconnect()
            raise
        finally:
            self._pool.release(conn)

    def data_epoch(self) -> int:
        """A random token under this namespace; a restart on empty memory, a flush or ``clear()`` drops it.

        When it is missing a new one is written with SET NX (no TTL: only losing the data may drop it) and the
        value the key then holds is returned, so clients racing to write it agree.
        """
        self._check_open()
        key = self.namespace.prefix + _EPOCH_SUFFIX
        with _mapped("data epoch"):
            stored = self._client.get(key)
            if stored is None:
                token = str(secrets.randbits(62)).encode()  # random: no other store's or clear's epoch is the same
                self._client.set(key, token, nx=True)
                stored = self._client.get(key) or token
        try:
            return int(stored)
        except ValueError:
            raise StorageError(f"redis data epoch key {key!r} holds {stored[:40]!r}, not a number") from None

    def _clear(self) -> None:
        pattern = _GLOB_CHARS.sub(r"\\\1", self.namespace.prefix) + "*"
        with _mapped("SCAN/UNLINK"):
            batch: list[bytes] = []
            for key in self._client.scan_iter(match=pattern, count=1000):
                batch.append(key)
                if len(batch) >= 500:
                    self._client.unlink(*batch)
                    batch.clear()
            if batch:
                self._client.unlink(*batch)

    def _close(self) -> None:
        self._pool.disconnect()

    def debug_corrupt(self, key: str) -> bool:
        skey = self.namespace.storage_key(key)
        with _mapped("corrupt"):
            length = self._client.strlen(skey)
            if not length:
                return False
            last = self._client.getrange(skey, length - 1, length - 1)
            self._client.setrange(skey, length - 1, bytes([last[0] ^ 0xFF]))
            return True
