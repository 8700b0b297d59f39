"""The check both explorers make of their bounds: a count below its least is refused, not explored.

An exploration over, say, ``nodes=0`` or ``max_len=-1`` finishes at once,
complete and without a violation: a pass that checked next to nothing.
"""

from __future__ import annotations

from hicache_fsm.errors import ConfigError


def check_bound(owner: str, name: str, value: object, least: int) -> None:
    """``ConfigError`` unless ``value`` is an int (not a bool) of at least ``least``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{owner}.{name} must be an int >= {least}, got {value!r}")


__all__ = ["check_bound"]
