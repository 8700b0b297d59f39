"""L3 storage: chained page keys, namespaces and pluggable backends.

``open_backend(url, **options)`` picks a backend by URL scheme:

* ``file:///DIR``            -> :class:`~hicache_fsm.storage.file.FileBackend` (the default)
* ``redis://HOST:PORT/DB``   -> :class:`~hicache_fsm.storage.redis.RedisBackend`
* ``memory://`` / ``memory://NAME`` -> :class:`~hicache_fsm.storage.memory.MemoryBackend`
* ``mooncake://HOST:PORT[?metadata=...&segment_mb=...&buffer_mb=...]`` ->
  :class:`~hicache_fsm.storage.mooncake.MooncakeBackend` (the ``[mooncake]`` extra)

``options`` go to the backend's constructor (``namespace=KeyNamespace(...)`` for
all of them; ``max_bytes``, ``fsync``, ``io_threads`` for files;
``socket_timeout``, ``connect_timeout``, ``max_connections``, ``retries``,
``ttl`` for Redis; ``connect_timeout`` for Mooncake). An unknown scheme, an
option the backend does not take or a value it cannot use raises
:class:`~hicache_fsm.errors.StorageURLError`.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import SplitResult, unquote, urlsplit

from hicache_fsm.errors import MissingExtra, StorageURLError
from hicache_fsm.storage.backend_checks import check_option_names
from hicache_fsm.storage.base import HostPoolLike, StorageBackend
from hicache_fsm.storage.keys import KeyNamespace, page_hash, page_keys

__all__ = [
    "SCHEMES",
    "HostPoolLike",
    "KeyNamespace",
    "StorageBackend",
    "check_url",
    "open_backend",
    "page_hash",
    "page_keys",
]

SCHEMES = ("file", "redis", "memory", "mooncake")


def check_url(url: object) -> SplitResult:
    """``url`` split, when its form can name a backend; else ``StorageURLError``. Opens nothing.

    What a command checks before any work (a mistyped URL is a usage error,
    not a failure minutes into a run), and the first step of ``open_backend``.
    Nothing is dropped or rewritten without a word: a fragment, a port 0
    (redis-py would take it for its default port) or a port out of range
    is refused; a server that does not answer is found only by opening.
    """
    if not isinstance(url, str) or "://" not in url:
        raise StorageURLError(f"storage URL must look like SCHEME://..., got {url!r}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:  # brackets read as a malformed IPv6 host, a port that is not a number or too large
        raise StorageURLError(f"malformed storage URL {url!r}: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES and scheme not in ("rediss", "unix"):
        raise StorageURLError(f"unknown storage scheme {parts.scheme!r} in {url!r}; known: {', '.join(SCHEMES)}")
    if parts.fragment or url.endswith("#"):
        raise StorageURLError(f"a storage URL has no #fragment, got {url!r}")
    if port == 0:
        raise StorageURLError(f"port 0 names no server, got {url!r}")
    if scheme == "file" and (parts.netloc not in ("", "localhost") or unquote(parts.path).rstrip("/") == ""
                             or parts.query or "\x00" in unquote(parts.path)):
        raise StorageURLError(f"file URLs look like file:///absolute/dir (not the root itself), got {url!r}")
    if scheme in ("redis", "rediss") and not re.fullmatch(r"/?([0-9]+)?", parts.path):
        raise StorageURLError(f"bad redis URL {url!r}: the path names a database by its number, "
                              f"got {parts.path[:40]!r}")  # redis-py would fall back to database 0
    if scheme == "mooncake" and (not parts.hostname or port is None):
        raise StorageURLError(f"mooncake URLs need HOST:PORT (the master's RPC port), got {url!r}")
    if scheme == "memory" and (parts.path not in ("", "/") or parts.query or port is not None or "@" in parts.netloc):
        raise StorageURLError(f"memory URLs look like memory:// or memory://NAME, got {url!r}")
    return parts


def open_backend(url: str, **options: Any) -> StorageBackend:
    """Open the backend that ``url`` names (checked by ``check_url``); ``options`` go to its constructor."""
    parts = check_url(url)
    scheme = parts.scheme.lower()
    if scheme == "file":
        from hicache_fsm.storage.file import FileBackend

        check_option_names(FileBackend, scheme, options, taken=("root",))
        return FileBackend(unquote(parts.path), **options)
    if scheme == "memory":
        from hicache_fsm.storage.memory import MemoryBackend

        check_option_names(MemoryBackend, scheme, options, taken=("store",))
        return MemoryBackend(store=parts.netloc or None, **options)
    if scheme == "mooncake":
        from hicache_fsm.storage.mooncake import MooncakeBackend

        check_option_names(MooncakeBackend, scheme, options, taken=("url",))
        return MooncakeBackend(url, **options)
    try:  # redis, rediss, unix
        from hicache_fsm.storage.redis import RedisBackend
    except ModuleNotFoundError as exc:
        if exc.name != "redis":
            raise
        raise MissingExtra("the redis:// storage backend", "redis", "redis") from None
    check_option_names(RedisBackend, scheme, options, taken=("url",))
    return RedisBackend(url, **options)
