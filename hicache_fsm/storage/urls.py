"""The form of a storage URL, checked before anything is opened (``check_url``)."""

from __future__ import annotations

import re
from urllib.parse import SplitResult, parse_qsl, unquote, urlsplit

from hicache_fsm.errors import StorageURLError

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
    if scheme == "file":
        file_directory(parts, url)
    if scheme in ("redis", "rediss") and not re.fullmatch(r"/?([0-9]+)?", parts.path):
        raise StorageURLError(f"bad redis URL {url!r}: the path names a database by its number, "
                              f"got {parts.path[:40]!r}")  # redis-py would fall back to database 0
    if scheme in ("redis", "rediss", "unix"):
        redis_query(parts, url)
    if scheme == "mooncake" and (not parts.hostname or port is None):
        raise StorageURLError(f"mooncake URLs need HOST:PORT (the master's RPC port), got {url!r}")
    if scheme == "memory" and (parts.path not in ("", "/") or parts.query or port is not None or "@" in parts.netloc):
        raise StorageURLError(f"memory URLs look like memory:// or memory://NAME, got {url!r}")
    return parts


# redis-py URL parameters that would override, unchecked, what the backend sets from its own options
REDIS_OPTION_PARAMETERS = {"socket_timeout": "socket_timeout", "socket_connect_timeout": "connect_timeout",
                           "max_connections": "max_connections", "timeout": "socket_timeout and connect_timeout",
                           "health_check_interval": None, "retry_on_timeout": "retries", "retry_on_error": "retries"}


def redis_query(parts: SplitResult, url: str) -> None:
    """Refuse URL parameters the backend's options set: redis-py lets the URL's win without a word, so
    ``?socket_timeout=inf`` (or ``=20`` over an option of 0.3) would undo the option's check."""
    given = sorted({name for name, _ in parse_qsl(parts.query, keep_blank_values=True)} & set(REDIS_OPTION_PARAMETERS))
    if given:
        options = sorted({REDIS_OPTION_PARAMETERS[name] for name in given} - {None})
        instead = f"; pass {', '.join(options)} to attach_storage instead" if options else ""
        raise StorageURLError(f"redis URL parameter(s) {', '.join(given)} are set by the backend (checked), not "
                              f"by the URL{instead}: got {url!r}")


def file_directory(parts: SplitResult, url: str) -> str:
    """The directory a ``file://`` URL names, decoded one path segment at a time (RFC 8089).

    A percent-encoded ``/`` (``%2F``) is data inside one segment, which no
    POSIX file name can hold: refused, not read as a separator (``a%2Fb``
    would otherwise name the directory ``a/b``). So is a NUL byte.
    """
    segments = [unquote(s) for s in parts.path.split("/")]
    if (parts.netloc not in ("", "localhost") or not "".join(segments) or parts.query
            or any("/" in s or "\x00" in s for s in segments)):
        raise StorageURLError(f"file URLs look like file:///absolute/dir (not the root itself; no %2F or %00 "
                              f"in a directory name), got {url!r}")
    return "/".join(segments)


__all__ = ["REDIS_OPTION_PARAMETERS", "SCHEMES", "check_url", "file_directory", "redis_query"]
