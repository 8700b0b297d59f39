"""Tree namespaces (LoRA ids, tenants) inside the fuzzers' plain token prompts.

The ``CacheAdapter`` interface speaks token prompts only, so a ``HiCacheAdapter``
built with ``namespaces=N > 1`` reads the namespace off each prompt's first token:
``t0 - 1 = N * (c - 1) + r`` gives namespace ``r`` and first cache token ``c``. The
mapping is one to one and keeps prefixes (prompts share a prefix exactly when
their cache forms share one in the same namespace), so the fuzzers' model of
what must match is unchanged. It also makes twins: with ``N = 2`` the prompts
``(1, x, ...)`` and ``(2, x, ...)`` are the same cache tokens in two namespaces,
whose KV differs (each prompt's KV is written from the prompt itself). A cache
that lets one namespace match, load or prefetch the other's pages, or that keys
both alike in storage, then reads back the wrong KV or hits where nothing was
inserted.
"""

from __future__ import annotations

from collections.abc import Hashable

__all__ = ["join_namespace", "namespace_index", "namespace_name", "split_namespace"]


def namespace_name(index: int) -> Hashable:
    """The tree namespace of index ``index``: None (the default namespace) for 0, a tenant name after it."""
    return None if index == 0 else f"tenant-{index}"


def namespace_index(namespace: Hashable) -> int:
    """The inverse of ``namespace_name``."""
    if namespace is None:
        return 0
    if isinstance(namespace, str) and namespace.startswith("tenant-") and namespace[7:].isdigit():
        return int(namespace[7:])
    raise ValueError(f"{namespace!r} is not a namespace the fuzzers made")


def split_namespace(tokens: tuple[int, ...], count: int) -> tuple[Hashable, tuple[int, ...]]:
    """The cache's (namespace, tokens) for a prompt, with ``count`` namespaces."""
    if count == 1 or not tokens:
        return None, tokens
    first, index = divmod(tokens[0] - 1, count)
    return namespace_name(index), (first + 1,) + tokens[1:]


def join_namespace(namespace: Hashable, tokens: tuple[int, ...], count: int) -> tuple[int, ...]:
    """The prompt whose cache form is (``namespace``, ``tokens``): the inverse of ``split_namespace``."""
    if count == 1 or not tokens:
        return tokens
    return (count * (tokens[0] - 1) + namespace_index(namespace) + 1,) + tokens[1:]

