"""Options of the storage tier (``HiCache.attach_storage(url, **options)``).

``attach_storage`` takes the fields of :class:`TierOptions` by name; every
other keyword goes to the backend's constructor (``socket_timeout`` for Redis,
``max_bytes`` for files, ...). Values are checked before anything is opened.
"""

from __future__ import annotations

from typing import Any

import attrs

from hicache_fsm.config import check_seconds
from hicache_fsm.errors import ConfigError, StorageLinkError
from hicache_fsm.storage.keys import KeyNamespace

STOP_POLICIES = ("best_effort", "wait_complete", "timeout")


def _positive_int(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{attribute.name} must be a positive int, got {value!r}")


def _non_negative_int(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{attribute.name} must be a non-negative int, got {value!r}")


def _opt_non_negative_int(instance, attribute, value) -> None:
    if value is not None:
        _non_negative_int(instance, attribute, value)


def _non_negative_number(instance, attribute, value) -> None:
    check_seconds(attribute.name, value, zero_ok=True)


def _positive_number(instance, attribute, value) -> None:
    check_seconds(attribute.name, value)


def _policy(instance, attribute, value) -> None:
    if value not in STOP_POLICIES:
        raise ConfigError(f"stop_policy must be one of {', '.join(STOP_POLICIES)}; got {value!r}")


def _opt_namespace(instance, attribute, value) -> None:
    if value is not None and not isinstance(value, KeyNamespace):
        raise ConfigError(f"namespace must be a KeyNamespace, got {type(value).__name__}")


def _bool(instance, attribute, value) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{attribute.name} must be a bool, got {value!r}")


@attrs.frozen
class TierOptions:
    """How the storage tier behaves; defaults follow the reference.

    Prefetch: ``prefetch_threshold`` tokens (at least one page) is the least
    worth fetching, checked at admission and again on the hit count;
    ``prefetch_capacity_tokens`` caps the host tokens all running prefetches
    hold (None: 80% of the host pool); ``stop_policy`` says when the scheduler
    may end a prefetch (``best_effort``: any time, ``wait_complete``: once the
    transfer ended, ``timeout``: once it ended or ``min(timeout_base +
    timeout_per_1k_tokens * tokens / 1024, timeout_max)`` seconds passed);
    ``batch_pages`` pages go per storage call (hit query and transfers).

    Keys: ``namespace`` (a ``KeyNamespace``), or one built from ``model``,
    ``tenant``, ``tp_rank``, ``tp_size``, ``is_mla``. MLA models keep one copy
    for all ranks: ranks other than 0 skip their writes and ack them at once.

    Failures: a failed backup is retried when storage answers again, at most
    ``retry_batch_tokens`` tokens every ``retry_interval`` seconds; while
    storage is unhealthy the I/O thread probes it every ``probe_interval``
    seconds. Stopping the threads waits at most ``join_timeout`` seconds.
    """

    prefetch_threshold: int = attrs.field(default=256, validator=_non_negative_int)
    prefetch_capacity_tokens: int | None = attrs.field(default=None, validator=_opt_non_negative_int)
    stop_policy: str = attrs.field(default="best_effort", validator=_policy)
    timeout_base: float = attrs.field(default=1.0, validator=_non_negative_number)
    timeout_per_1k_tokens: float = attrs.field(default=0.25, validator=_non_negative_number)
    timeout_max: float = attrs.field(default=30.0, validator=_non_negative_number)
    batch_pages: int = attrs.field(default=128, validator=_positive_int)
    model: str = "default"
    tenant: str | None = None
    tp_rank: int = attrs.field(default=0, validator=_non_negative_int)
    tp_size: int = attrs.field(default=1, validator=_positive_int)
    is_mla: bool = attrs.field(default=False, validator=_bool)
    namespace: KeyNamespace | None = attrs.field(default=None, validator=_opt_namespace)
    retry_interval: float = attrs.field(default=1.0, validator=_non_negative_number)
    retry_batch_tokens: int = attrs.field(default=1 << 16, validator=_positive_int)
    probe_interval: float = attrs.field(default=0.5, validator=_positive_number)
    join_timeout: float = attrs.field(default=10.0, validator=_positive_number)

    @classmethod
    def split(cls, options: dict[str, Any]) -> tuple[TierOptions, dict[str, Any]]:
        """(tier options, backend options) from ``attach_storage``'s keywords."""
        names = set(cls.names())
        mine = {k: v for k, v in options.items() if k in names}
        rest = {k: v for k, v in options.items() if k not in names}
        both = sorted(set(mine) & set(KEY_PARTS)) if mine.get("namespace") is not None else []
        if both:  # the namespace is the whole key prefix: these would be ignored without a word
            raise ConfigError(f"give namespace or {', '.join(both)}, not both (a KeyNamespace holds the model, "
                              f"tenant and ranks)")
        return cls(**mine), rest

    def keyed_like(self, backend: object, given: dict[str, Any]) -> TierOptions:
        """These options keyed as the open ``backend`` was opened, but for the key parts ``given`` names.

        An open backend keeps the namespace it was built with: the tier's
        skip-writes rule and its rank checks read that one, and the parts
        given must agree with it (``check_backend_keys``).
        """
        own = getattr(backend, "namespace", None)
        if "namespace" in given or not isinstance(own, KeyNamespace):
            return self
        parts = {name: getattr(self if name in given else own, name) for name in KEY_PARTS}
        return attrs.evolve(self, namespace=KeyNamespace(**parts))

    def ranked_in(self, group: Any, given: dict[str, Any]) -> TierOptions:
        """These options keyed by the cache's rank in ``group`` (taken from the group when not given).

        Ranks whose keys named the same rank (the defaults, 0 of 1) overwrote
        each other's head shards in a shared store; an MLA rank that is not
        rank 0 of its group would write the shared copy too.
        """
        if group.solo:
            return self
        ns = self.namespace
        if ns is None and "tp_rank" not in given and "tp_size" not in given:
            return attrs.evolve(self, tp_rank=group.rank, tp_size=group.size)
        rank, size = (ns.tp_rank, ns.tp_size) if ns is not None else (self.tp_rank, self.tp_size)
        if (rank, size) != (group.rank, group.size):
            raise StorageLinkError(
                f"storage keys for tp_rank {rank} of tp_size {size}, but this cache is rank {group.rank} of "
                f"{group.size} in its group: leave tp_rank and tp_size out (the group's are taken) or give its own "
                f"(an open backend: open it with this rank's namespace)")
        return self

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The tier's option names (``attach_storage`` hands the other keywords to the backend)."""
        return tuple(f.name for f in attrs.fields(cls))

    def key_namespace(self) -> KeyNamespace:
        if self.namespace is not None:
            return self.namespace
        return KeyNamespace(self.model, self.tp_rank, self.tp_size, self.is_mla, self.tenant)

    @property
    def skip_writes(self) -> bool:
        """MLA keeps one shared copy: only rank 0 writes it."""
        if self.namespace is not None:
            return self.namespace.is_mla and self.namespace.tp_rank != 0
        return self.is_mla and self.tp_rank != 0


KEY_PARTS = ("model", "tenant", "tp_rank", "tp_size", "is_mla")  # what a KeyNamespace holds
KEY_OPTIONS = (*KEY_PARTS, "namespace")


def check_backend_keys(backend: object, namespace: KeyNamespace, given: dict[str, Any]) -> None:
    """Refuse key options an open ``backend`` would not follow: its keys are fixed when it is opened.

    Dropping them would let two ranks (or tenants) share keys: one rank's
    backup skipped as stored, the other reading the wrong rank's KV.
    """
    own = getattr(backend, "namespace", None)
    if isinstance(own, KeyNamespace):
        if own.prefix == namespace.prefix:  # the keys agree (an MLA copy is shared by every rank)
            return
        raise StorageLinkError(
            f"this backend was opened with namespace {own.prefix!r}, but the attach names {namespace.prefix!r} "
            f"(its options or its rank group): an open backend keeps its keys; open it with "
            f"namespace=KeyNamespace(...) for this cache, or attach a URL")
    named = sorted(name for name in KEY_OPTIONS if name in given)
    if named:
        raise StorageLinkError(f"{', '.join(named)} need a URL or a StorageBackend: this backend has no "
                               f"KeyNamespace to compare them with")


__all__ = ["KEY_OPTIONS", "KEY_PARTS", "STOP_POLICIES", "TierOptions", "check_backend_keys"]
