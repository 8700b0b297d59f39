"""Reference eviction policies: what a store naming ``eviction_policy`` must evict, victim by victim.

The toolkit feeds a policy the store's history: ``insert`` when a store takes a
key (its job is prepared), ``touch`` for each key the adapter reports used,
``remove`` when a store fails, ``evict`` for each reported victim. ``choose``
names the victims the policy would take among the eligible keys (readable, not
being read, not asked for by the evicting call); a store that evicts others is
not following its policy. ARC follows vLLM's ``ARCCachePolicy`` (T1/T2 with
ghost lists B1/B2 and an adaptive T1 target).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

Key = Hashable


class ReferencePolicy:
    """The interface: a policy's bookkeeping and its choice of victims (``choose`` changes nothing)."""

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity

    def insert(self, key: Key) -> None:
        raise NotImplementedError

    def touch(self, key: Key, ready: bool) -> None:
        """``key`` was used (``ready``: its store completed)."""

    def remove(self, key: Key) -> None:
        raise NotImplementedError

    def evict(self, key: Key) -> None:
        self.remove(key)

    def choose(self, eligible: set[Key], n: int) -> list[Key] | None:
        """The ``n`` victims among ``eligible``, in eviction order; None when fewer are eligible."""
        raise NotImplementedError

    def key(self) -> Hashable:
        raise NotImplementedError


class LRU(ReferencePolicy):
    """Least recently inserted or touched first."""

    def __init__(self, capacity: int | None = None) -> None:
        super().__init__(capacity)
        self.order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key) -> None:
        self.order[key] = None
        self.order.move_to_end(key)

    def touch(self, key: Key, ready: bool) -> None:
        if key in self.order:
            self.order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self.order.pop(key, None)

    def choose(self, eligible: set[Key], n: int) -> list[Key] | None:
        return _first(self.order, eligible, n)

    def key(self) -> Hashable:
        return tuple(self.order)


class FIFO(LRU):
    """First inserted first; use does not count."""

    def touch(self, key: Key, ready: bool) -> None:
        pass


class LFU(LRU):
    """Fewest uses (the insert counts one) first; ties: least recently used first."""

    def __init__(self, capacity: int | None = None) -> None:
        super().__init__(capacity)
        self.uses: dict[Key, int] = {}

    def insert(self, key: Key) -> None:
        super().insert(key)
        self.uses[key] = 1

    def touch(self, key: Key, ready: bool) -> None:
        if key in self.uses:
            self.uses[key] += 1
            super().touch(key, ready)

    def remove(self, key: Key) -> None:
        super().remove(key)
        self.uses.pop(key, None)

    def choose(self, eligible: set[Key], n: int) -> list[Key] | None:
        rank = {k: i for i, k in enumerate(self.order)}
        ordered = sorted((k for k in self.order if k in eligible), key=lambda k: (self.uses[k], rank[k]))
        return ordered[:n] if len(ordered) >= n else None

    def key(self) -> Hashable:
        return tuple((k, self.uses[k]) for k in self.order)


class ARC(ReferencePolicy):
    """Adaptive replacement: T1 (used once) and T2 (used again), ghosts B1/B2 steer the T1 target."""

    def __init__(self, capacity: int | None = None) -> None:
        super().__init__(capacity)
        self.target = 0.0
        self.t1: OrderedDict[Key, None] = OrderedDict()
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key) -> None:
        self.t1[key] = None
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def touch(self, key: Key, ready: bool) -> None:
        if key in self.t1:
            del self.t1[key]
            (self.t2 if ready else self.t1)[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)
        elif key in self.b1:
            self.target = min(self.target + max(1, len(self.b2) / len(self.b1)), self.capacity or 0)
            self.b1.move_to_end(key)
        elif key in self.b2:
            self.target = max(self.target - max(1, len(self.b1) / len(self.b2)), 0)
            self.b2.move_to_end(key)

    def remove(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
        else:
            self.t2.pop(key, None)

    def evict(self, key: Key) -> None:
        ghost = self.b1 if key in self.t1 else self.b2
        self.remove(key)
        ghost[key] = None
        if self.capacity is not None and len(ghost) > self.capacity:
            ghost.popitem(last=False)

    def choose(self, eligible: set[Key], n: int) -> list[Key] | None:
        t1 = (k for k in self.t1 if k in eligible)
        t2 = (k for k in self.t2 if k in eligible)
        virtual_t1, out = len(self.t1), []
        while len(out) < n:
            pick = next(t1, None) if virtual_t1 >= int(self.target) else None
            if pick is not None:
                virtual_t1 -= 1
            else:
                pick = next(t2, None)
                if pick is None:
                    return None
            out.append(pick)
        return out

    def key(self) -> Hashable:
        return self.target, tuple(self.t1), tuple(self.t2), tuple(self.b1), tuple(self.b2)


POLICIES: dict[str, Callable[[int | None], ReferencePolicy]] = {"lru": LRU, "lfu": LFU, "arc": ARC, "fifo": FIFO}


def reference_policy(spec: str | Callable[[int | None], Any], capacity: int | None) -> ReferencePolicy:
    """The policy an adapter names: one of ``POLICIES`` or a callable taking the capacity (ValueError otherwise)."""
    if isinstance(spec, str):
        if spec.lower() not in POLICIES:
            raise ValueError(f"eviction_policy must be one of {sorted(POLICIES)} or a callable, got {spec!r}")
        return POLICIES[spec.lower()](capacity)
    if not callable(spec):
        raise ValueError(f"eviction_policy must be a policy name or a callable, got {type(spec).__name__}")
    policy = spec(capacity)
    if not isinstance(policy, ReferencePolicy):
        raise ValueError(f"eviction_policy {spec!r} made a {type(policy).__name__}, not a ReferencePolicy")
    return policy


def _first(order: Sequence[Key] | OrderedDict, eligible: set[Key], n: int) -> list[Key] | None:
    out = [k for k in order if k in eligible][:n]
    return out if len(out) == n else None
