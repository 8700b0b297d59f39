"""Cache policy configuration (pool sizes live in ``pools.PoolConfig``)."""

from __future__ import annotations

import math
import reprlib
import threading

import attrs

from hicache_fsm.errors import ConfigError

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back", "write_behind")
EVICTION_POLICIES = ("lru", "lfu", "priority")


def check_positive_int(name: str, value: object, minimum: int = 1, error: type[ConfigError] = ConfigError) -> int:
    """``value`` if it is an int (not a bool) >= ``minimum``; else ``error`` (a ConfigError) naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise error(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


# Seconds are handed to thread waits and timers, which refuse (or overflow on) more than this
MAX_SECONDS = threading.TIMEOUT_MAX


def check_seconds(name: str, value: object, *, zero_ok: bool = False, error: type[ConfigError] = ConfigError,
                  maximum: float = MAX_SECONDS) -> float:
    """``value`` as seconds: a number (not a bool) > 0, or >= 0 with ``zero_ok``, and at most ``maximum``
    (``MAX_SECONDS`` unless a caller bounds it tighter); else ``error`` naming it."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    if ok:
        try:
            ok = math.isfinite(value) and (value > 0 or (zero_ok and value == 0)) and value <= maximum
        except OverflowError:  # an int beyond any float
            ok = False
    if not ok:
        raise error(f"{name} must be a finite number of seconds {'>=' if zero_ok else '>'} 0 and <= "
                    f"{maximum:g}, got {reprlib.repr(value)}")
    return float(value)


def _one_of(options: tuple[str, ...]):
    def check(instance, attribute, value):
        if value not in options:
            raise ConfigError(f"{attribute.name} must be one of {', '.join(options)}; got {value!r}")

    return check


def _count(instance, attribute, value):
    """An int >= 0: a float, a bool or a str compared fine here and misbehaved later."""
    check_positive_int(attribute.name, value, minimum=0)


def _optional_count(instance, attribute, value):
    if value is not None:
        _count(instance, attribute, value)


@attrs.frozen
class CacheConfig:
    """How the cache decides; every field has the reference's default behaviour.

    - ``write_policy``: when device KV is backed up to host.
      ``write_through`` backs up every new node at once;
      ``write_through_selective`` once a node's hit count reaches
      ``write_through_threshold``; ``write_back`` only when an un-backed node is
      evicted from the device (eviction waits for the copy); ``write_behind``
      defers backup: each ``poll`` backs up device-only nodes that have gone
      cold (not matched or inserted during the last ``write_behind_idle_steps``
      calls of ``poll``; 0 = at the next poll), coldest first, at most
      ``write_behind_batch_tokens`` tokens per poll, so hot prefixes are not
      copied while they churn and copies go out in batches. Like
      ``write_back``, eviction of a node not yet backed up backs it up first
      instead of losing it. Under both, a node whose backup cannot start
      (host full even after host eviction) is dropped when eviction needs
      its room.
    - ``eviction_policy``: order of device/host eviction among evictable leaves.
    - ``load_back_threshold``: a load-back of fewer tokens is skipped (recompute is cheaper).
    - ``load_back_max_tokens``: a load-back of more tokens is skipped (memory quota); None = no cap.
    - ``eviction_headroom_tokens``: when ``alloc_device`` / ``load_back`` must evict, free this many
      tokens beyond the shortfall (a low watermark, so the next requests find room without evicting).
      0 (the default, chosen by ``hicache-fsm bench scale --headroom-pages``: with eviction in
      O(k log N) a pass per allocation costs no more than one batched pass, and evicting early
      only drops KV that might still be hit) evicts exactly the shortfall.
    """

    write_policy: str = attrs.field(default="write_through", validator=_one_of(WRITE_POLICIES))
    write_through_threshold: int = attrs.field(default=2, validator=_count)
    eviction_policy: str = attrs.field(default="lru", validator=_one_of(EVICTION_POLICIES))
    load_back_threshold: int = attrs.field(default=0, validator=_count)
    load_back_max_tokens: int | None = attrs.field(default=None, validator=_optional_count)
    write_behind_idle_steps: int = attrs.field(default=2, validator=_count)
    write_behind_batch_tokens: int = attrs.field(default=1 << 20, validator=_count)
    eviction_headroom_tokens: int = attrs.field(default=0, validator=_count)

    @property
    def keeps_unbacked(self) -> bool:
        """Whether device eviction keeps device-only KV until it is backed up (``write_back``, ``write_behind``)
        rather than dropping it."""
        return self.write_policy in ("write_back", "write_behind")
