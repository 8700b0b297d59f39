"""The generic lock check: a held lock keeps its prefix on the device (``lock_kept_on_device``).

A cache that evicts a locked prefix still serves the right KV from its slower tier, so the KV,
capacity and contract checks all pass it. An adapter that reports, per held lock, the tokens
the device still serves (``locked_device_tokens``) has every step checked against that promise,
by ``check``'s explorer and by ``fuzz``'s stateful machine alike.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest

from hicache_fsm.testing import (
    Bounds,
    CacheAdapter,
    CacheProtocolMachine,
    MatchInfo,
    Occupancy,
    Rejected,
    explore,
    kv_fingerprint,
    run_fuzz,
)
from hicache_fsm.testing.checks import Step, perform


class LockingCache(CacheAdapter):
    """Two LRU tiers of one-token pages keyed by their prefix; a lock keeps its pages in the fast tier.

    ``bug="evict_locked"``: ``evict`` demotes locked pages too (inserts still respect locks).
    """

    name = "locking_cache"

    def __init__(self, fast_pages: int = 2, slow_pages: int = 2, bug: str | None = None) -> None:
        self.fast: OrderedDict[tuple, int] = OrderedDict()  # prefix -> the page's KV, oldest first
        self.slow: OrderedDict[tuple, int] = OrderedDict()
        self.fast_pages, self.slow_pages, self.bug = fast_pages, slow_pages, bug
        self.locks: dict[int, list[tuple]] = {}
        self.next_lock = 0

    def _locked(self, key: tuple) -> bool:
        return any(key in keys for keys in self.locks.values())

    def _demote(self, key: tuple) -> None:
        self.slow[key] = self.fast.pop(key)
        while len(self.slow) > self.slow_pages:
            self.slow.popitem(last=False)

    def _make_room(self) -> bool:
        while len(self.fast) > self.fast_pages:
            victim = next((k for k in self.fast if not self._locked(k)), None)
            if victim is None:
                return False
            self._demote(victim)
        return True

    def insert(self, tokens) -> bool:
        tokens = tuple(tokens)
        for i in range(1, len(tokens) + 1):
            key = tokens[:i]
            value = self.slow.pop(key, None) if key not in self.fast else self.fast.pop(key)
            self.fast[key] = kv_fingerprint(key) if value is None else value
            if not self._make_room():
                self.fast.pop(key)
                return False
        return len(self.read_kv(tokens)) == len(tokens)  # True promises the whole prompt is cached

    def match(self, tokens) -> MatchInfo:
        n = 0
        for i in range(1, len(tokens) + 1):
            key = tuple(tokens[:i])
            if key not in self.fast and key not in self.slow:
                break
            n = i
        return MatchInfo(0, n) if n and tuple(tokens[:1]) not in self.fast else MatchInfo(n)

    def read_kv(self, tokens) -> list[tuple[int, ...]]:
        out = []
        for i in range(1, len(tokens) + 1):
            key = tuple(tokens[:i])
            copies = tuple(t[key] for t in (self.fast, self.slow) if key in t)
            if not copies:
                break
            out.append(copies)
        return out

    def invariant_violations(self) -> list[str]:
        return []

    def lock(self, tokens):
        keys = []
        for i in range(1, len(tokens) + 1):
            if tuple(tokens[:i]) not in self.fast:
                break
            keys.append(tuple(tokens[:i]))
        if not keys:
            return None
        self.next_lock += 1
        self.locks[self.next_lock] = keys
        return self.next_lock

    def unlock(self, lock_id: int) -> None:
        if lock_id not in self.locks:
            raise Rejected(f"lock {lock_id} is not held")
        del self.locks[lock_id]

    def held_locks(self) -> list[int]:
        return sorted(self.locks)

    def locked_device_tokens(self) -> dict[int, int]:
        return {lid: sum(1 for k in keys if k in self.fast) for lid, keys in self.locks.items()}

    def evict(self, num_tokens: int) -> int:
        freed = 0
        for key in list(self.fast):
            if freed >= num_tokens:
                break
            if self.bug == "evict_locked" or not self._locked(key):
                self._demote(key)
                freed += 1
        return freed

    def occupancy(self) -> Occupancy:
        return Occupancy(len(self.fast), len(self.slow))

    def capacity(self) -> Occupancy:
        return Occupancy(self.fast_pages, self.slow_pages)

    def state_key(self):
        return (tuple(self.fast), tuple(self.slow), tuple(tuple(k) for k in self.locks.values()))

    def size(self) -> int:
        return len(self.fast) + len(self.slow)


class BlindLockingCache(LockingCache):
    """The same cache through an adapter that does not report its locks' device tokens."""

    locked_device_tokens = CacheAdapter.locked_device_tokens


BOUNDS = Bounds(nodes=3, device_pages=2, host_pages=2, max_depth=5)


def _explore(cls, bug=None):
    return explore(BOUNDS, lambda b: cls(b.device_pages, b.host_pages, bug), stop_on_first=True)


def test_a_correct_locking_cache_passes_every_state():
    result = _explore(LockingCache)
    assert result.ok and result.states > 20


def test_the_explorer_catches_an_eviction_of_a_locked_prefix():
    result = _explore(LockingCache, "evict_locked")
    assert not result.ok
    [violation] = result.violations
    assert any("lock_kept_on_device" in p for p in violation.problems), violation.format()
    assert [s.op for s in violation.trace][-1] == "evict"


def test_without_the_report_the_same_bug_passes_every_other_check():
    """Why the check exists: the KV stays right (read from the slow tier), so nothing else notices."""
    assert _explore(BlindLockingCache, "evict_locked").ok


@pytest.mark.parametrize("bug", [None, "evict_locked"])
def test_the_fuzzer_catches_it_too(bug):
    machine = CacheProtocolMachine.bind(lambda **kw: LockingCache(bug=bug, **kw), name="LockingMachine")
    result = run_fuzz(machine, examples=100, steps=20, seed=0, shrink=False)
    if bug is None:
        assert result.ok, result.failure
    else:
        assert not result.ok and "lock_kept_on_device" in result.failure


@pytest.mark.parametrize("op", ["insert", "evict"])
def test_a_step_that_keeps_the_lock_passes(op):
    cache = LockingCache()
    cache.insert((1, 2))
    lock = cache.lock((1, 2))
    step = Step("insert", ((3,),)) if op == "insert" else Step("evict", (2,))
    out = perform(cache, step)
    assert out.problems == [] and cache.locked_device_tokens() == {lock: 2}
