"""Fault injection for any storage backend: ``FaultyBackend(inner, schedule)``.

The wrapper behaves exactly like ``inner`` except on calls that a :class:`Fault`
in the schedule selects. A fault selects calls by method name (``None``: any of
:data:`METHODS`), by the per-method call index (0-based; ``None``: every call),
by a firing limit (``times``) and by a probability drawn from the wrapper's own
seeded RNG (so a fuzzer run replays exactly). The first fault in the schedule
that selects a call fires; at most one fault fires per call. ``schedule`` may
instead be a callable ``(method, call_index, keys) -> Fault | None``.

Kinds:

``error`` / ``unavailable``
    raise StorageError / StorageUnavailable instead of calling ``inner``
    (``after=True``: call ``inner`` first, so the operation happened but its
    answer was lost).
``timeout``
    sleep ``delay`` seconds (the caller's deadline passing), then raise
    StorageTimeout; ``after=True`` as above.
``slow``
    sleep ``delay`` seconds, then answer normally.
``partial``
    only the first ``keep`` keys reach ``inner``; the rest are answered as
    misses (``batch_exists`` is capped at ``keep``; gets give None / False;
    sets give False and store nothing).
``corrupt``
    damage the stored copy of the keys at ``positions`` (default: all) through
    ``inner.debug_corrupt`` -- before a get, so ``inner``'s checksum check turns
    them into counted misses; after a set, so the next read does. This never
    makes a backend return unverified bytes.

Every fired fault is appended to ``fired`` as ``(method, call_index, kind)``;
``stats()`` is ``inner``'s plus ``faults_injected`` (and injected raises are
added to ``errors``).
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Iterable
from typing import Any, Callable, Sequence, Union

import attrs

from hicache_fsm.errors import ConfigError, StorageError, StorageKeyError, StorageTimeout, StorageUnavailable
from hicache_fsm.storage.base import StorageBackend
from hicache_fsm.storage.page_format import PageFormat

__all__ = ["FAULT_KINDS", "METHODS", "Fault", "FaultyBackend"]

METHODS = ("batch_exists", "batch_get", "batch_set", "batch_get_into", "batch_set_from", "clear")
FAULT_KINDS = ("error", "unavailable", "timeout", "slow", "partial", "corrupt")
_RAISING = {"error": StorageError, "unavailable": StorageUnavailable, "timeout": StorageTimeout}


def _calls(value: int | Iterable[int] | None) -> frozenset[int] | None:
    if value is None:
        return None
    if isinstance(value, int):
        return frozenset({value})
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ConfigError(f"Fault.calls must be a call index or indices, got {value!r}")
    return frozenset(value)


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@attrs.frozen
class Fault:
    """One rule of a fault schedule (see the module docstring); a field no schedule can use is a ConfigError."""

    kind: str
    method: str | None = None
    calls: frozenset[int] | None = attrs.field(default=None, converter=_calls)
    times: int | None = None
    probability: float = 1.0
    keep: int = 0
    positions: tuple[int, ...] | None = attrs.field(
        default=None, converter=attrs.converters.optional(tuple)
    )
    delay: float = 0.0
    after: bool = False
    message: str = "injected fault"

    def __attrs_post_init__(self) -> None:
        problems = [
            (self.kind not in FAULT_KINDS, f"kind must be one of {', '.join(FAULT_KINDS)}"),
            (self.method is not None and self.method not in METHODS,
             f"method must be None or one of {', '.join(METHODS)}"),
            (self.calls is not None and not all(_is_index(c) for c in self.calls), "calls must be indices >= 0"),
            (self.times is not None and not (_is_index(self.times) and self.times >= 1),
             "times must be None or an int >= 1"),
            (not _number_within(self.probability, 0.0, 1.0), "probability must be a number in [0, 1]"),
            (not _is_index(self.keep), "keep must be an int >= 0"),
            (self.positions is not None and not all(_is_index(p) for p in self.positions),
             "positions must be indices >= 0"),
            (not _number_within(self.delay, 0.0, math.inf), "delay must be a finite number of seconds >= 0"),
            (not isinstance(self.after, bool), "after must be True or False"),
            (not isinstance(self.message, str), "message must be a str"),
        ]
        for bad, what in problems:
            if bad:
                raise ConfigError(f"Fault: {what}, got {self!r}")


def _number_within(value: object, low: float, high: float) -> bool:
    """A real number (not a bool) in ``[low, high]``; infinity never."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and low <= value <= high)


Schedule = Union[Sequence[Fault], Callable[[str, int, Sequence[str]], Union[Fault, None]]]


class FaultyBackend(StorageBackend):
    """Wraps ``inner`` and injects the faults that ``schedule`` selects."""

    def __init__(self, inner: StorageBackend, schedule: Schedule = (), *, seed: int = 0) -> None:
        if not isinstance(inner, StorageBackend):
            raise ConfigError(f"FaultyBackend wraps a StorageBackend, got {type(inner).__name__}")
        rules = None if callable(schedule) or not isinstance(schedule, Iterable) else list(schedule)
        if not callable(schedule) and (rules is None or isinstance(schedule, (str, bytes))
                                       or not all(isinstance(rule, Fault) for rule in rules)):
            raise ConfigError(f"schedule must be Fault rules or a callable (method, call, keys) -> Fault | None, "
                              f"got {schedule!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"seed must be an int, got {seed!r}")
        super().__init__(inner.namespace)
        self.inner = inner
        self.scheme = inner.scheme
        self._rules: list[Fault] | None = rules
        self._chooser = schedule if callable(schedule) else None
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._call_index = dict.fromkeys(METHODS, 0)
        self._fire_counts: dict[int, int] = {}
        self._raised = 0
        self.fired: list[tuple[str, int, str]] = []

    @property
    def chooser(self):
        """The schedule callable (a ``FaultPlan`` in the explorer), or None for a rule list."""
        return self._chooser

    def add(self, fault: Fault) -> None:
        """Append a rule to a list schedule."""
        if self._rules is None:
            raise StorageKeyError("this FaultyBackend uses a callable schedule")
        if not isinstance(fault, Fault):
            raise ConfigError(f"add takes a Fault, got {fault!r}")
        with self._lock:
            self._rules.append(fault)

    def fork(self, memo: dict) -> "FaultyBackend":
        """A copy over a fork of ``inner``: same schedule position, RNG state and fired log.

        A callable schedule with its own ``fork(memo)`` (the explorer's
        ``FaultPlan``) is forked too; any other callable is shared.
        """
        if id(self) in memo:
            return memo[id(self)]
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        memo[id(self)] = new
        new._stats = self._stats.fork()
        new.inner = self.inner.fork(memo)
        new._lock = threading.Lock()
        with self._lock:
            new._rng = random.Random()
            new._rng.setstate(self._rng.getstate())
            new._call_index = dict(self._call_index)
            new._fire_counts = dict(self._fire_counts)
            new.fired = list(self.fired)
            new._rules = None if self._rules is None else list(self._rules)
        fork_chooser = getattr(self._chooser, "fork", None)
        if fork_chooser is not None:
            new._chooser = fork_chooser(memo)
        return new

    def calls(self, method: str) -> int:
        """How many times ``method`` has been called so far."""
        return self._call_index[method]

    # -- selection --------------------------------------------------------

    def _select(self, method: str, keys: Sequence[str]) -> Fault | None:
        with self._lock:
            index = self._call_index[method]
            self._call_index[method] = index + 1
            fault = None
            if self._chooser is not None:
                fault = self._chooser(method, index, list(keys))
            else:
                for rule_id, rule in enumerate(self._rules or ()):
                    if rule.method is not None and rule.method != method:
                        continue
                    if rule.calls is not None and index not in rule.calls:
                        continue
                    if rule.times is not None and self._fire_counts.get(rule_id, 0) >= rule.times:
                        continue
                    if rule.probability < 1.0 and self._rng.random() >= rule.probability:
                        continue
                    self._fire_counts[rule_id] = self._fire_counts.get(rule_id, 0) + 1
                    fault = rule
                    break
            if fault is not None:
                self.fired.append((method, index, fault.kind))
            return fault

    def _raise(self, fault: Fault, method: str) -> None:
        with self._lock:
            self._raised += 1
        raise _RAISING[fault.kind](f"{fault.message} ({fault.kind} in {method})")

    def _run(self, method: str, keys: Sequence[str], call: Callable[[Sequence[str]], Any], miss: Any) -> Any:
        """Apply the selected fault around ``call(keys_subset)``; ``miss`` pads partial answers."""
        if self._closed:
            raise StorageUnavailable("FaultyBackend is closed")
        if isinstance(keys, (str, bytes)):
            raise StorageKeyError("keys must be a sequence of str, not a single str")
        keys = list(keys)
        fault = self._select(method, keys)
        if fault is None:
            return call(keys)
        kind = fault.kind
        if kind in ("slow", "timeout"):
            time.sleep(fault.delay)
        if kind in _RAISING:
            if fault.after:
                try:
                    call(keys)
                except StorageError:
                    pass
            self._raise(fault, method)
        if kind == "partial":
            keep = max(0, min(fault.keep, len(keys)))
            if method == "batch_exists":
                return min(call(keys[:keep]) if keep else 0, keep)
            if method == "clear":
                return None
            head = call(keys[:keep]) if keep else []
            return list(head) + [miss] * (len(keys) - keep)
        if kind == "corrupt":
            chosen = range(len(keys)) if fault.positions is None else [p for p in fault.positions if 0 <= p < len(keys)]
            targets = [keys[p] for p in chosen]
            if method in ("batch_set", "batch_set_from"):
                result = call(keys)
                for key in targets:
                    self.inner.debug_corrupt(key)
                return result
            for key in targets:
                self.inner.debug_corrupt(key)
        return call(keys)

    # -- the interface ----------------------------------------------------

    def batch_exists(self, keys: Sequence[str]) -> int:
        return self._run("batch_exists", keys, self.inner.batch_exists, None)

    def batch_get(self, keys: Sequence[str], page_format: PageFormat | None = None) -> list[bytes | None]:
        return self._run("batch_get", keys, lambda ks: self.inner.batch_get(ks, page_format), None)

    def batch_set(self, keys: Sequence[str], values: Sequence[Any], page_format: PageFormat | None = None) -> list[bool]:
        keys, values = list(keys), list(values)
        if len(values) != len(keys):
            raise StorageKeyError(f"{len(keys)} keys but {len(values)} values")
        return self._run("batch_set", keys, lambda ks: self.inner.batch_set(ks, values[: len(ks)], page_format), False)

    def batch_get_into(self, keys: Sequence[str], host_pool: Any, page_ids: Sequence[int]) -> list[bool]:
        ids = page_ids.tolist() if hasattr(page_ids, "tolist") else list(page_ids)
        return self._run(
            "batch_get_into", keys, lambda ks: self.inner.batch_get_into(ks, host_pool, ids[: len(ks)]), False
        )

    def batch_set_from(self, keys: Sequence[str], host_pool: Any, page_ids: Sequence[int]) -> list[bool]:
        ids = page_ids.tolist() if hasattr(page_ids, "tolist") else list(page_ids)
        return self._run(
            "batch_set_from", keys, lambda ks: self.inner.batch_set_from(ks, host_pool, ids[: len(ks)]), False
        )

    def clear(self) -> None:
        self._run("clear", (), lambda ks: self.inner.clear(), None)

    def data_epoch(self) -> int:
        return self.inner.data_epoch()

    @property
    def reports_evictions(self) -> bool:  # type: ignore[override]
        return self.inner.reports_evictions

    def add_eviction_listener(self, listener) -> None:
        self.inner.add_eviction_listener(listener)  # the inner backend evicts; its keys are ours (same namespace)

    def remove_eviction_listener(self, listener) -> None:
        self.inner.remove_eviction_listener(listener)

    def stats(self) -> dict[str, int]:
        stats = self.inner.stats()
        with self._lock:
            stats["errors"] += self._raised
            stats["faults_injected"] = len(self.fired)
        return stats

    def _close(self) -> None:
        self.inner.close()

    def debug_corrupt(self, key: str) -> bool:
        return self.inner.debug_corrupt(key)

    # Hooks are never reached: every public method delegates to ``inner``.
    def _exists(self, skeys: list[str]) -> int:  # pragma: no cover
        raise NotImplementedError

    def _get(self, skeys: list[str], fmt: bytes) -> list[bytes | None]:  # pragma: no cover
        raise NotImplementedError

    def _set(self, skeys: list[str], payloads: list[list[memoryview]], fmt: bytes) -> list[str]:  # pragma: no cover
        raise NotImplementedError

    def _clear(self) -> None:  # pragma: no cover
        raise NotImplementedError
