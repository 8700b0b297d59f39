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

from typing import Any

from hicache_fsm.errors import MissingExtra
from hicache_fsm.storage.backend_checks import check_option_names
from hicache_fsm.storage.base import HostPoolLike, StorageBackend
from hicache_fsm.storage.keys import KeyNamespace, page_hash, page_keys
from hicache_fsm.storage.urls import SCHEMES, check_url, file_directory

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


def open_backend(url: str, **options: Any) -> StorageBackend:
    """Open the backend that ``url`` names (checked by ``check_url``); ``options`` go to its constructor."""
    parts = check_url(url)
    scheme = parts.scheme.lower()
    if scheme == "file":
        from hicache_fsm.storage.file import FileBackend

        check_option_names(FileBackend, scheme, options, taken=("root",))
        return FileBackend(file_directory(parts, url), **options)
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
