"""Checks of a storage backend's constructor options, made before anything is opened.

A backend's options come from an engine's configuration, often as text turned
into values by hand, so a wrong one (a negative timeout, ``"4"`` connections,
``True`` as a TTL, a misspelt name) is refused here with a ``StorageURLError``
naming it, instead of surfacing as a ``TypeError`` or ``ValueError`` from the
client library, or worse, being taken as some other value.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable

from hicache_fsm import config
from hicache_fsm.errors import StorageURLError, UnknownStorageOption


def check_seconds(name: str, value: object) -> float:
    """``value`` as seconds if it is a finite number > 0 (not a bool)."""
    return config.check_seconds(name, value, error=StorageURLError)


def check_count(name: str, value: object, minimum: int = 1) -> int:
    """``value`` if it is an int (not a bool) >= ``minimum``."""
    return config.check_positive_int(name, value, minimum, error=StorageURLError)


def check_flag(name: str, value: object) -> bool:
    """``value`` if it is a bool: a string such as ``"no"`` would read as true."""
    if not isinstance(value, bool):
        raise StorageURLError(f"{name} must be True or False, got {value!r}")
    return value


def check_option_names(constructor: Callable[..., object], scheme: str, options: Iterable[str],
                       taken: tuple[str, ...]) -> None:
    """Refuse option names ``constructor`` has no keyword for (``taken``: those the URL itself fills)."""
    keywords = [
        p.name for p in inspect.signature(constructor).parameters.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in taken
    ]
    unknown = sorted(set(options) - set(keywords))
    if unknown:
        raise UnknownStorageOption(scheme, unknown, keywords)
