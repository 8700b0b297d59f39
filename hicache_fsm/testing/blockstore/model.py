"""The reference model of a block store: what it must answer, given what it was asked and what it reported."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import attrs

from hicache_fsm.testing.blockstore.policies import ReferencePolicy
from hicache_fsm.testing.blockstore.state import Key, clone

STORING, READABLE = "storing", "readable"


@attrs.define
class StoreModel:
    """Per key ``storing`` or ``readable``; loads in flight per key; jobs in flight; the last finished job;
    the reference eviction policy when the adapter names one."""

    keys: dict[Key, str] = attrs.Factory(dict)
    reading: dict[Key, int] = attrs.Factory(dict)
    jobs: dict[Hashable, tuple[str, tuple[Key, ...]]] = attrs.Factory(dict)
    finished: list[tuple[Hashable, str, tuple[Key, ...], bool]] = attrs.Factory(list)
    policy: ReferencePolicy | None = None

    def state(self, key: Key) -> str | None:
        """``storing``, ``readable`` or None (not held)."""
        return self.keys.get(tuple(key))

    def readable_prefix(self, keys: Sequence[Key]) -> int:
        n = 0
        for k in keys:
            if self.keys.get(tuple(k)) != READABLE:
                break
            n += 1
        return n

    def evictable(self, protected: Sequence[Key] = ()) -> set[Key]:
        """Keys a policy may evict now: readable, not being read, not asked for by the evicting call."""
        return {k for k, s in self.keys.items() if s == READABLE and not self.reading.get(k)} - set(protected)

    def key(self) -> Hashable:
        return (tuple(sorted(self.keys.items())), tuple(sorted(self.reading.items())),
                tuple(sorted((kind, keys) for kind, keys in self.jobs.values())),
                None if self.policy is None else self.policy.key())

    def copy(self) -> StoreModel:
        return StoreModel(dict(self.keys), dict(self.reading), dict(self.jobs), list(self.finished),
                          clone(self.policy))
