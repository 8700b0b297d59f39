"""What a block-store adapter implements (``BlockStoreAdapter``) and the answers it gives (``StoreJob``, ``Answer``).

The adapter translates the toolkit's calls into the store's own API and reports
what the store did that the toolkit cannot see: evictions (``evicted``) and, for
policy conformance, the keys an engine used (``touched``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from hicache_fsm.errors import ConfigError
from hicache_fsm.testing.adapter import NotSupported, kv_fingerprint
from hicache_fsm.testing.blockstore.state import BlockKey, Key, canonical, clone

if TYPE_CHECKING:
    from hicache_fsm.testing.blockstore.model import StoreModel

REDELIVERY_CONTRACTS = ("reject", "idempotent", "caller_guarantees_once")


def value_of(key: Key) -> int:
    """What a store's copy writes for ``key`` (and what a load must read back)."""
    return kv_fingerprint(key)


def chain(pages: Sequence[int]) -> tuple[Key, ...]:
    """Block keys of a prompt of page ids: each block's key is the prefix up to it (as block hashes chain)."""
    pages = tuple(pages)
    return tuple(BlockKey(pages[: i + 1]) for i in range(len(pages)))


class Answer(enum.Enum):
    """A per-key lookup answer (vLLM's ``LookupResult`` names; any enum or string with these names is taken)."""

    MISS = "miss"  # not held
    HIT = "hit"  # readable now
    HIT_PENDING = "hit_pending"  # its store is in flight
    RETRY = "retry"  # ask again later (never wrong, never a hit)

    @classmethod
    def of(cls, value: Any) -> Answer | None:
        """``value`` as an ``Answer`` (by member, name or value, any case); None when it is none of them."""
        if isinstance(value, cls):
            return value
        name = getattr(value, "name", value)
        if isinstance(name, str):
            return cls.__members__.get(name.upper()) or next((a for a in cls if a.value == name.lower()), None)
        return None


def _hashable_keys(instance: object, attribute: attrs.Attribute, keys: tuple) -> None:
    """Keys are tuples of page ids: a list key would fail far from the adapter that made it (the explorer hashes
    every key), so the job names it here, inside the adapter's own call."""
    for key in keys:
        try:
            hash(key)
        except TypeError:
            raise ConfigError(f"StoreJob.{attribute.name}: key {key!r} is not hashable (a key is a tuple of page "
                              f"ids)") from None


@attrs.frozen
class StoreJob:
    """An asynchronous store or load: its id and the keys it copies.

    A store may skip keys it holds and list keys it ``declined`` (an admission
    filter). A job with no keys (``StoreJob.nothing()``) is "nothing to copy": it
    takes no job slot and is never acknowledged.
    """

    id: Hashable
    keys: tuple[Key, ...] = attrs.field(converter=tuple, validator=_hashable_keys)
    declined: tuple[Key, ...] = attrs.field(default=(), converter=tuple, validator=_hashable_keys)

    @classmethod
    def nothing(cls, declined: Sequence[Key] = ()) -> StoreJob:
        return cls(None, (), tuple(declined))


class BlockStoreAdapter:
    """Drive an asynchronous block store; see ``hicache_fsm.testing.blockstore``.

    Required: ``lookup``, ``store``, ``load``, ``complete``. Call
    ``self.evicted(keys)`` whenever the store reports evictions (from any call),
    and ``self.touched(keys)`` for the keys the store counts as used (when an
    ``eviction_policy`` is named). Optional: ``begin_request`` / ``end_request``
    (request scopes), ``slots``, ``free_slots`` and ``capacity`` (slot
    accounting), ``postconditions``, ``invariant_violations``, ``snapshot``,
    ``state_key`` and ``clone`` (defaults: a canonical walk of the attributes and
    a deep copy, or a replay from the factory when it cannot be copied).
    """

    name = "blockstore"
    redelivery = "reject"
    capacity: int | None = None
    keeps_keys = True  # a store takes, holds or declines every key asked for; False: it may drop keys silently
    eviction_policy: str | Callable[[], Any] | None = None  # "lru", "lfu", "arc", "fifo" or a ReferencePolicy factory
    state_ignores: tuple[str, ...] = ()  # attributes the default state key leaves out (job counters, request ids)

    # ------------------------------------------------------------------ request scopes

    def begin_request(self, request_id: int) -> None:
        """A request starts; the lookups, loads and stores until ``end_request`` are its calls."""

    def end_request(self, request_id: int) -> None:
        """The request finished (its jobs may still be in flight)."""

    # ------------------------------------------------------------------ required

    def _missing(self, method: str) -> str:
        """What a required method left to the base class says (it was raised with no text)."""
        return f"{type(self).__name__} does not implement {method}, which every BlockStoreAdapter must"

    def lookup(self, keys: Sequence[Key]) -> int | Sequence[Any]:
        """How many leading ``keys`` are readable now, or one ``Answer`` per key up to the first non-hit."""
        raise NotImplementedError(self._missing("lookup"))

    def store(self, keys: Sequence[Key]) -> StoreJob | None:
        """Prepare storing ``keys``; the job copies ``job.keys`` (None: refused, e.g. no room)."""
        raise NotImplementedError(self._missing("store"))

    def load(self, keys: Sequence[Key]) -> StoreJob | None:
        """Prepare loading ``keys`` (all readable); None when refused."""
        raise NotImplementedError(self._missing("load"))

    def complete(self, job: StoreJob, ok: bool) -> list[int] | None:
        """The job's copy ran (``ok``) or failed; acknowledge it. A store's copy writes ``value_of(key)``
        into each slot, a load's copy returns the values it read, one per key."""
        raise NotImplementedError(self._missing("complete"))

    # ------------------------------------------------------------------ optional

    def slots(self) -> dict[Key, Hashable]:
        """Key -> slot of every entry holding one (stored or being stored)."""
        raise NotSupported("slots")

    def free_slots(self) -> int:
        """Slots free now (with ``capacity``: used plus free must be the capacity, else slots leaked)."""
        raise NotSupported("free_slots")

    def postconditions(self, op: str, args: tuple, result: Any, model: StoreModel) -> list[str]:
        """The adapter's own rules for one call; ``model`` is the reference model after the call."""
        return []

    def invariant_violations(self) -> list[str]:
        return []

    def snapshot(self) -> Any:
        """The store's state, compared around a redelivered ack (default: the state key)."""
        return self.state_key()

    def state_key(self) -> Hashable:
        """What tells two states apart for the explorer (default: every attribute but ``state_ignores``)."""
        return canonical(self, ignore=self.state_ignores)

    def clone(self) -> BlockStoreAdapter:
        """An independent copy; ``NotSupported`` makes the explorer rebuild states by replay instead."""
        try:
            return clone(self)
        except Exception as exc:  # noqa: BLE001 - locks, sockets, C objects: anything a deep copy refuses
            raise NotSupported(f"clone: {type(exc).__name__}: {exc}") from None

    def describe(self) -> str:
        return self.name

    # ------------------------------------------------------------------ reports, from any call

    def evicted(self, keys: Sequence[Key]) -> None:
        """Call when the store reports ``keys`` evicted (e.g. from ``store``)."""
        self.__dict__.setdefault("_evicted", []).extend(k if isinstance(k, tuple) else tuple(k) for k in keys)

    def touched(self, keys: Sequence[Key]) -> None:
        """Call with the keys the store counts as used, in the order used (the last is the most recent)."""
        self.__dict__.setdefault("_touched", []).extend(k if isinstance(k, tuple) else tuple(k) for k in keys)

    def take_evicted(self) -> list[Key]:
        return self.__dict__.pop("_evicted", [])

    def take_touched(self) -> list[Key]:
        return self.__dict__.pop("_touched", [])
