"""One world: an adapter and its reference model stepped together; every step returns the problems it found."""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from hicache_fsm.errors import ConfigError
from hicache_fsm.testing.adapter import NotSupported, Rejected
from hicache_fsm.testing.blockstore.adapter import REDELIVERY_CONTRACTS, Answer, BlockStoreAdapter, Key, StoreJob, value_of
from hicache_fsm.testing.blockstore.model import READABLE, STORING, StoreModel
from hicache_fsm.testing.blockstore.policies import reference_policy
from hicache_fsm.testing.blockstore.state import clone

SCOPED = ("lookup", "store", "load", "request")  # the calls an engine makes for a request
EXPECTED = {READABLE: Answer.HIT, STORING: Answer.HIT_PENDING, None: Answer.MISS}


class StoreWorld:
    """``adapter`` and a fresh ``StoreModel``; ``factory`` (optional) rebuilds states by replay when the
    adapter cannot be cloned. Bad adapter settings raise ``ValueError``."""

    def __init__(self, adapter: BlockStoreAdapter, factory: Callable[[], BlockStoreAdapter] | None = None) -> None:
        if adapter.redelivery not in REDELIVERY_CONTRACTS:
            raise ValueError(f"redelivery must be one of {REDELIVERY_CONTRACTS}, got {adapter.redelivery!r}")
        if not isinstance(adapter.keeps_keys, bool):
            raise ValueError(f"keeps_keys must be True or False, got {adapter.keeps_keys!r}")
        policy = None
        if adapter.eviction_policy is not None:
            policy = reference_policy(adapter.eviction_policy, adapter.capacity)
        self.adapter = adapter
        self.model = StoreModel(policy=policy)
        self.factory = factory
        self.trace: tuple[tuple, ...] = ()
        self.next_request = 0
        self.open_request: int | None = None
        self.replay_only = False

    def clone(self) -> StoreWorld:
        """An independent copy: the adapter's ``clone``, else (``NotSupported``) a replay from the factory."""
        if not self.replay_only:
            try:
                adapter = self.adapter.clone()
            except NotSupported:
                if self.factory is None:
                    raise
                self.replay_only = True
            else:
                new = object.__new__(StoreWorld)
                new.__dict__.update(self.__dict__)
                new.adapter, new.model = adapter, self.model.copy()
                return new
        world = StoreWorld(self.factory(), self.factory)
        world.replay_only = True
        for step in self.trace:
            world.do(*step)
        return world

    def key(self) -> Hashable:
        """What tells states apart: the adapter's state key, the model's, an open scope, and the last finished
        job when a redelivery of it may be tried."""
        finished = () if self.adapter.redelivery == "caller_guarantees_once" else \
            tuple((kind, keys, ok) for _, kind, keys, ok in self.model.finished)
        state = self.adapter.state_key()
        try:
            hash(state)
        except TypeError:  # the visited set could not hold it: the adapter's mistake, named, not a traceback
            raise ConfigError(f"{type(self.adapter).__name__}.state_key() returned an unhashable "
                              f"{type(state).__name__}; return a tuple (or another hashable value)") from None
        return state, self.model.key(), self.open_request is not None, finished

    def renamed(self, rename: dict) -> StoreWorld:
        """A copy with block keys and written values renamed (``rename``: old -> new), for its state key."""
        new = object.__new__(StoreWorld)
        new.__dict__.update(self.__dict__)
        new.adapter, new.model = clone(self.adapter, rename), clone(self.model, rename)
        return new

    # ------------------------------------------------------------------ steps

    def steps(self, prompts: Sequence[tuple[Key, ...]], max_jobs: int | None = None, redeliver: bool = True) -> list[tuple]:
        room = max_jobs is None or len(self.model.jobs) < max_jobs
        out: list[tuple] = []
        for p in prompts:
            out.append(("lookup", p))
            if room:
                out.append(("store", p))
                hits = self.model.readable_prefix(p)
                if hits:
                    out.append(("load", p[:hits]))
                out.append(("request", p))
        for job in self.model.jobs:
            out += [("complete", job, True), ("complete", job, False)]
        if redeliver and self.model.finished and self.adapter.redelivery != "caller_guarantees_once":
            out.append(("redeliver",))
        return list(dict.fromkeys(out))  # prompts with one readable prefix load the same keys: try it once

    def do(self, op: str, *args: Any) -> list[str]:
        """Run one step against adapter and model; the problems (contract, model, policy, postconditions, invariants)."""
        self.trace += ((op, *args),)
        try:
            if op in SCOPED and self.open_request is None:
                rid = self._begin()
                result, problems = getattr(self, "_" + op)(*args)
                problems += self._sync(op)
                self._end(rid)
            else:
                result, problems = getattr(self, "_" + op)(*args)
        except Exception as exc:  # noqa: BLE001 - any unexpected exception is a finding
            return [f"{op}: raised {type(exc).__name__}: {exc}"]
        problems += self._sync(op)
        post_fn = self.adapter.postconditions
        post = post_fn(op, args, result, self.model) if _takes_model(post_fn) else post_fn(op, args, result)
        problems += [f"postcondition: {p}" for p in post]
        return problems + self.violations()

    def _begin(self) -> int:
        rid, self.next_request = self.next_request, self.next_request + 1
        self.adapter.begin_request(rid)
        self.open_request = rid
        return rid

    def _end(self, rid: int) -> None:
        self.open_request = None
        self.adapter.end_request(rid)

    def _open(self) -> tuple[Any, list[str]]:
        if self.open_request is not None:
            return None, ["open: a request is already open"]
        return self._begin(), []

    def _close(self) -> tuple[Any, list[str]]:
        if self.open_request is None:
            return None, ["close: no request is open"]
        self._end(self.open_request)
        return None, []

    def _lookup(self, keys: tuple[Key, ...]) -> tuple[int, list[str]]:
        got = self.adapter.lookup(keys)
        if isinstance(got, int) and not isinstance(got, bool):
            want = self.model.readable_prefix(keys)
            if got != want:
                return got, [f"lookup: {got} of {len(keys)} keys of {fmt(keys)} reported readable, the model says {want}"]
            return got, []
        return self._answers(keys, list(got))

    def _answers(self, keys: tuple[Key, ...], answers: list[Any]) -> tuple[int, list[str]]:
        """Per-key answers: HIT iff readable, HIT_PENDING iff its store is in flight, MISS iff not held; RETRY any."""
        problems, hits = [], 0
        if len(answers) > len(keys):
            problems.append(f"lookup: {len(answers)} answers for {len(keys)} keys of {fmt(keys)}")
        for i, (k, raw) in enumerate(zip(keys, answers)):
            answer, state = Answer.of(raw), self.model.state(k)
            if answer is None:
                problems.append(f"lookup: answer {raw!r} for {fmt([k])} is not one of {[a.name for a in Answer]}")
            elif answer is not Answer.RETRY and answer is not EXPECTED[state]:
                problems.append(f"lookup: {fmt([k])} answered {answer.name}, the model says {state or 'not held'}")
            if hits == i and answer is Answer.HIT:
                hits += 1
        if hits == len(answers) < len(keys):
            problems.append(f"lookup: stopped after {hits} hits of {len(keys)} keys of {fmt(keys)} without a miss")
        return hits, problems

    def _store(self, keys: tuple[Key, ...]) -> tuple[Any, list[str]]:
        job = self.adapter.store(keys)
        problems = self._sync("store", protected=keys)  # evictions the store reported happen before its own keys
        if job is None:
            return None, problems
        if not isinstance(job, StoreJob):
            return job, problems + [f"store: returned {type(job).__name__}, not a StoreJob or None"]
        problems += [f"store: job copies {fmt([k])}, which was not asked for" for k in job.keys if k not in keys]
        problems += [f"store: declined {fmt([k])}, which was not asked for" for k in job.declined if k not in keys]
        problems += [f"store: both copies and declines {fmt([k])}" for k in job.declined if k in job.keys]
        if self.adapter.keeps_keys:
            problems += [f"store: skipped {fmt([k])}, which it does not hold (nor declined)" for k in keys
                         if k not in job.keys and k not in job.declined and k not in self.model.keys]
        if not job.keys:  # nothing to copy: no job slot, never acknowledged
            return job, problems
        if job.id in self.model.jobs:
            problems.append(f"store: job id {job.id!r} is already in flight")
        for k in job.keys:
            if k not in self.model.keys and self.model.policy is not None:
                self.model.policy.insert(k)
            if self.model.keys.get(k) != READABLE:
                self.model.keys[k] = STORING
        self.model.jobs[job.id] = ("store", job.keys)
        return job, problems

    def _load(self, keys: tuple[Key, ...]) -> tuple[Any, list[str]]:
        job = self.adapter.load(keys)
        problems = self._sync("load")
        if job is None or not job.keys:
            return job, problems
        problems += [f"load: job copies {fmt([k])}, which is not readable" for k in job.keys
                     if self.model.keys.get(k) != READABLE]
        if job.id in self.model.jobs:
            problems.append(f"load: job id {job.id!r} is already in flight")
        for k in job.keys:
            self.model.reading[k] = self.model.reading.get(k, 0) + 1
        self.model.jobs[job.id] = ("load", job.keys)
        return job, problems

    def _request(self, keys: tuple[Key, ...]) -> tuple[Any, list[str]]:
        """One request's calls: look up, load the hits, store the rest (the engine computed them)."""
        hits, problems = self._lookup(keys)
        if problems:
            return None, problems
        if hits:
            _, problems = self._load(keys[:hits])
            if problems:
                return None, problems
        if hits < len(keys):
            return self._store(keys[hits:])
        return None, []

    def _complete(self, job_id: Hashable, ok: bool) -> tuple[Any, list[str]]:
        kind, keys = self.model.jobs.pop(job_id)
        got = self.adapter.complete(StoreJob(job_id, keys), ok)
        self.model.finished = [(job_id, kind, keys, ok)]
        if kind == "store":
            for k in keys:
                if self.model.keys.get(k) == STORING:
                    if ok:
                        self.model.keys[k] = READABLE
                    else:
                        del self.model.keys[k]
                        if self.model.policy is not None:
                            self.model.policy.remove(k)
            return got, []
        for k in keys:
            self.model.reading[k] -= 1
            if not self.model.reading[k]:
                del self.model.reading[k]
        want = [value_of(k) for k in keys]
        if ok and list(got or ()) != want:
            read = list(got or ())
            bad = next(i for i, w in enumerate(want) if i >= len(read) or read[i] != w)
            return got, [f"kv_readback: load of {fmt(keys)} read {read}, the stores wrote {want} "
                         f"(key {fmt([keys[bad]])} differs: a reused or unwritten slot)"]
        return got, []

    def _redeliver(self) -> tuple[Any, list[str]]:
        job_id, kind, keys, ok = self.model.finished[-1]
        before = self._snapshot()
        try:
            self.adapter.complete(StoreJob(job_id, keys), ok)
        except Rejected:
            if self.adapter.redelivery == "idempotent":
                return None, [f"redeliver: the {kind} ack of job {job_id!r} was refused; the contract is idempotent"]
        else:
            if self.adapter.redelivery == "reject":
                return None, [f"redeliver: the {kind} ack of job {job_id!r} was accepted again; the contract is reject"]
        if before is not None and self._snapshot() != before:
            return None, [f"redeliver: a second {kind} ack of job {job_id!r} changed the store"]
        return None, []

    def _snapshot(self) -> Any:
        try:
            return self.adapter.snapshot()
        except NotSupported:
            return None

    # ------------------------------------------------------------------ checks

    def _sync(self, op: str, protected: Sequence[Key] = ()) -> list[str]:
        """Take the adapter's reports: check and apply evictions, feed touches to the reference policy."""
        problems = self._evictions(op, self.adapter.take_evicted(), protected)
        policy = self.model.policy
        for k in self.adapter.take_touched():
            if policy is not None:
                policy.touch(k, self.model.state(k) == READABLE)
        return problems

    def _evictions(self, op: str, victims: list[Key], protected: Sequence[Key]) -> list[str]:
        if not victims:
            return []
        problems = []
        for k in victims:
            state = self.model.keys.get(k)
            if state is None:
                problems.append(f"{op}: reported {fmt([k])} evicted, which it did not hold")
            elif state == STORING:
                problems.append(f"{op}: evicted {fmt([k])} while its store is in flight")
            elif self.model.reading.get(k):
                problems.append(f"{op}: evicted {fmt([k])} while a load reads it")
        policy = self.model.policy
        if policy is not None and not problems:
            want = policy.choose(self.model.evictable(protected), len(victims))
            if want is None or set(want) != set(victims):
                name = self.adapter.eviction_policy if isinstance(self.adapter.eviction_policy, str) else "reference"
                problems.append(f"policy: {op} evicted {fmt(victims)}, the {name} policy evicts "
                                f"{fmt(want) if want is not None else 'fewer'}")
        for k in victims:
            if policy is not None and k in self.model.keys:
                policy.evict(k)
            self.model.keys.pop(k, None)
        return problems

    def violations(self) -> list[str]:
        problems = list(self.adapter.invariant_violations())
        try:
            slots = self.adapter.slots()
        except NotSupported:
            return problems
        if not isinstance(slots, Mapping):  # read as one below: a list raised AttributeError out of the search
            return problems + [f"adapter_error: slots() returned {type(slots).__name__}, not a mapping of key to slot"]
        held = set(self.model.keys)
        for k in sorted(set(slots) - held):
            problems.append(f"slots: {fmt([k])} still holds slot {slots[k]!r}, the model says it is gone (leak)")
        for k in sorted(held - set(slots)):
            problems.append(f"slots: {fmt([k])} is {self.model.keys[k]} but holds no slot")
        owners: dict[Hashable, Key] = {}
        for k, s in slots.items():
            if s in owners:
                problems.append(f"slots: slot {s!r} has two owners, {fmt([owners[s]])} and {fmt([k])}")
            owners[s] = k
        try:
            free = self.adapter.free_slots()
        except NotSupported:
            return problems
        if isinstance(free, bool) or not isinstance(free, int):
            return problems + [f"adapter_error: free_slots() returned {type(free).__name__}, not an int"]
        capacity = self.adapter.capacity
        if capacity is not None and len(owners) + free != capacity:
            why = "slots leaked" if len(owners) + free < capacity else "a slot freed twice"
            problems.append(f"slots: {len(owners)} used + {free} free of {capacity} ({why})")
        return problems


def fmt(keys: Sequence[Key]) -> str:
    """Keys as ``[0, 0/1]`` (a key's page ids joined by ``/``)."""
    return "[" + ", ".join("/".join(map(str, k)) for k in keys) + "]"


def format_step(step: tuple) -> str:
    op, *args = step
    return f"{op}({', '.join(fmt(a) if isinstance(a, tuple) else repr(a) for a in args)})"


_TAKES_MODEL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # function -> takes the model


def _takes_model(method: Callable[..., Any]) -> bool:
    """Whether ``postconditions`` takes the model (``op, args, result, model``) or only ``op, args, result``."""
    func = getattr(method, "__func__", method)
    if func not in _TAKES_MODEL:
        try:
            params = list(inspect.signature(method).parameters.values())
        except (TypeError, ValueError):
            params = []
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        _TAKES_MODEL[func] = len(positional) >= 4 or any(p.kind == p.VAR_POSITIONAL for p in params)
    return _TAKES_MODEL[func]
