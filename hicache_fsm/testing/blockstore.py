"""The outsider profile for *asynchronous block stores* (offload managers keyed by block hash).

Prefix caches (``CacheAdapter``) insert a prompt and can read it now. Many
offload managers do not work like that: a store is *prepared* (slots handed
out, maybe others evicted as a side effect), the copy runs elsewhere, and
the data is readable only once the store is *acknowledged*; loads likewise.
This profile drives such a store through five calls and keeps, in the
toolkit, everything an adapter should not have to write:

- a **reference model**: a key is readable after its store's successful ack,
  until the store reports it evicted, never after; ``lookup`` must say exactly
  that (a key readable early, or gone without a report, is a bug); an eviction
  never hits a key that is still being stored or that a load in flight reads;
- **KV read-back**: a store's copy writes ``value_of(key)``; a load's copy must
  read exactly that for each key (a load never reads a reused slot);
- **slot accounting** (when the adapter reports ``slots()``): the keys holding
  slots are exactly the model's stored and storing keys (no leak), no slot has
  two owners, used plus free slots is the capacity;
- the **ack-redelivery contract** the adapter chooses (``redelivery``):
  ``reject`` (a second ack raises ``Rejected`` and changes nothing),
  ``idempotent`` (it is accepted and changes nothing) or
  ``caller_guarantees_once`` (never re-delivered: the engine promises it);
- **request scopes**: ``request(keys)`` is what a serving engine does for one
  request over several calls (lookup, load the hits, store the rest), checked
  as a whole;
- **per-step postconditions**: ``postconditions(op, args, result)``, the
  adapter's own rules for one call;
- a bounded **explorer** (``explore_store``: ``StoreBounds`` limits prompts,
  entries and jobs in flight) and a hypothesis **machine** (``store_machine``,
  ``run_store_fuzz``), both behind ``hicache-fsm check / fuzz --adapter``.

An adapter implements ``lookup``, ``store``, ``load`` and ``complete`` and calls
``self.evicted(keys)`` from whichever call evicts; see
``examples/block_offload_manager.py`` and docs/fuzzing.md.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TextIO

import attrs
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hicache_fsm.testing.adapter import NotSupported, Rejected, kv_fingerprint

__all__ = [
    "REDELIVERY_CONTRACTS", "BlockStoreAdapter", "StoreBounds", "StoreJob", "StoreModel", "StoreWorld",
    "explore_store", "run_store_fuzz", "store_machine", "value_of",
]

REDELIVERY_CONTRACTS = ("reject", "idempotent", "caller_guarantees_once")
Key = tuple  # a block key: the chained prefix of page ids up to and including the block


def value_of(key: Key) -> int:
    """What a store's copy writes for ``key`` (and what a load must read back)."""
    return kv_fingerprint(key)


@attrs.frozen
class StoreJob:
    """An asynchronous store or load: its id and the keys it copies (a store may skip keys it holds)."""

    id: Hashable
    keys: tuple[Key, ...]


class BlockStoreAdapter:
    """Drive an asynchronous block store; see the module docstring.

    Required: ``lookup``, ``store``, ``load``, ``complete``. Call
    ``self.evicted(keys)`` whenever the store reports evictions (from any call).
    Optional: ``slots``, ``free_slots`` and ``capacity`` (slot accounting), ``postconditions``,
    ``invariant_violations``, ``snapshot`` (redelivery checks), ``state_key``
    (the explorer; default: the snapshot), ``clone`` (deep copy by default).
    """

    name = "blockstore"
    redelivery = "reject"
    capacity: int | None = None

    def lookup(self, keys: Sequence[Key]) -> int:
        """How many leading ``keys`` are readable now."""
        raise NotImplementedError

    def store(self, keys: Sequence[Key]) -> StoreJob | None:
        """Prepare storing ``keys``; the job copies ``job.keys`` (None: refused, e.g. no room)."""
        raise NotImplementedError

    def load(self, keys: Sequence[Key]) -> StoreJob | None:
        """Prepare loading ``keys`` (all readable); None when refused."""
        raise NotImplementedError

    def complete(self, job: StoreJob, ok: bool) -> list[int] | None:
        """The job's copy ran (``ok``) or failed; acknowledge it. A store's copy writes ``value_of(key)``
        into each slot, a load's copy returns the values it read, one per key."""
        raise NotImplementedError

    # ------------------------------------------------------------------ optional

    def slots(self) -> dict[Key, Hashable]:
        """Key -> slot of every entry holding one (stored or being stored)."""
        raise NotSupported("slots")

    def free_slots(self) -> int:
        """Slots free now (with ``capacity``: used plus free must be the capacity, else slots leaked)."""
        raise NotSupported("free_slots")

    def postconditions(self, op: str, args: tuple, result: Any) -> list[str]:
        return []

    def invariant_violations(self) -> list[str]:
        return []

    def snapshot(self) -> Any:
        raise NotSupported("snapshot")

    def state_key(self) -> Hashable:
        return self.snapshot()

    def clone(self) -> BlockStoreAdapter:
        return copy.deepcopy(self)

    def describe(self) -> str:
        return self.name

    # ------------------------------------------------------------------ evictions, reported by any call

    def evicted(self, keys: Sequence[Key]) -> None:
        """Call when the store reports ``keys`` evicted (e.g. from ``store``)."""
        self.__dict__.setdefault("_evicted", []).extend(tuple(k) for k in keys)

    def take_evicted(self) -> list[Key]:
        return self.__dict__.pop("_evicted", [])


# =========================================================================== the reference model


@attrs.define
class StoreModel:
    """What the store must answer: per key ``storing`` or ``readable``; loads in flight; jobs."""

    keys: dict[Key, str] = attrs.Factory(dict)
    reading: dict[Key, int] = attrs.Factory(dict)
    jobs: dict[Hashable, tuple[str, tuple[Key, ...]]] = attrs.Factory(dict)
    finished: list[tuple[Hashable, str, tuple[Key, ...], bool]] = attrs.Factory(list)

    def readable_prefix(self, keys: Sequence[Key]) -> int:
        n = 0
        for k in keys:
            if self.keys.get(tuple(k)) != "readable":
                break
            n += 1
        return n

    def key(self) -> Hashable:
        return (tuple(sorted(self.keys.items())), tuple(sorted(self.reading.items())),
                tuple(sorted((kind, keys) for kind, keys in self.jobs.values())))


@attrs.frozen
class StoreBounds:
    """Explorer bounds: prompts of 1..``max_len`` blocks over ``alphabet`` page ids, at most ``max_jobs``
    jobs in flight and ``max_entries`` keys held (a state beyond is checked, not expanded)."""

    alphabet: int = 2
    max_len: int = 3
    max_jobs: int = 2
    max_entries: int | None = None
    max_states: int | None = None
    max_seconds: float | None = None


def chain(pages: Sequence[int]) -> tuple[Key, ...]:
    """Block keys of a prompt of page ids: each block's key is the prefix up to it (as block hashes chain)."""
    pages = tuple(pages)
    return tuple(pages[: i + 1] for i in range(len(pages)))


def prompts_for(bounds: StoreBounds) -> list[tuple[Key, ...]]:
    import itertools

    return [chain(p) for n in range(1, bounds.max_len + 1) for p in itertools.product(range(bounds.alphabet), repeat=n)]


# =========================================================================== one world: adapter + model


class StoreWorld:
    """An adapter and its reference model, stepped together; every step returns the problems it found."""

    def __init__(self, adapter: BlockStoreAdapter) -> None:
        if adapter.redelivery not in REDELIVERY_CONTRACTS:
            raise ValueError(f"redelivery must be one of {REDELIVERY_CONTRACTS}, got {adapter.redelivery!r}")
        self.adapter = adapter
        self.model = StoreModel()

    def clone(self) -> StoreWorld:
        new = object.__new__(StoreWorld)
        new.adapter = self.adapter.clone()
        new.model = copy.deepcopy(self.model)
        return new

    def key(self) -> Hashable:
        return (self.adapter.state_key(), self.model.key())

    # ------------------------------------------------------------------ steps

    def steps(self, prompts: Sequence[tuple[Key, ...]], max_jobs: int | None = None) -> list[tuple]:
        room = max_jobs is None or len(self.model.jobs) < max_jobs
        out: list[tuple] = []
        for p in prompts:
            out.append(("lookup", p))
            if room:
                out.append(("store", p))
                if self.model.readable_prefix(p):
                    out.append(("load", p[: self.model.readable_prefix(p)]))
                out.append(("request", p))
        for job in self.model.jobs:
            out += [("complete", job, True), ("complete", job, False)]
        if self.model.finished and self.adapter.redelivery != "caller_guarantees_once":
            out.append(("redeliver",))
        return out

    def do(self, op: str, *args: Any) -> list[str]:
        """Run one step against adapter and model; the problems (contract, model, postconditions, invariants)."""
        try:
            result, problems = getattr(self, "_" + op)(*args)
        except Exception as exc:  # noqa: BLE001 - any unexpected exception is a finding
            return [f"{op}: raised {type(exc).__name__}: {exc}"]
        problems += self._evictions(op)
        problems += [f"postcondition: {p}" for p in self.adapter.postconditions(op, args, result)]
        return problems + self.violations()

    def _lookup(self, keys: tuple[Key, ...]) -> tuple[int, list[str]]:
        got = self.adapter.lookup(keys)
        want = self.model.readable_prefix(keys)
        if got != want:
            return got, [f"lookup: {got} of {len(keys)} keys of {_fmt(keys)} reported readable, the model says {want}"]
        return got, []

    def _store(self, keys: tuple[Key, ...]) -> tuple[Any, list[str]]:
        job = self.adapter.store(keys)
        problems = self._evictions("store")  # evictions the store reported happen before its own keys
        if job is None:
            return None, problems
        for k in job.keys:
            if k not in keys:
                problems.append(f"store: job copies {_fmt([k])}, which was not asked for")
        for k in keys:
            if k not in job.keys and k not in self.model.keys:
                problems.append(f"store: skipped {_fmt([k])}, which it does not hold")
        if job.id in self.model.jobs:
            problems.append(f"store: job id {job.id!r} is already in flight")
        for k in job.keys:
            if self.model.keys.get(k) != "readable":
                self.model.keys[k] = "storing"
        self.model.jobs[job.id] = ("store", job.keys)
        return job, problems

    def _load(self, keys: tuple[Key, ...]) -> tuple[Any, list[str]]:
        job = self.adapter.load(keys)
        if job is None:
            return None, []
        problems = [f"load: job copies {_fmt([k])}, which is not readable" for k in job.keys
                    if self.model.keys.get(k) != "readable"]
        for k in job.keys:
            self.model.reading[k] = self.model.reading.get(k, 0) + 1
        self.model.jobs[job.id] = ("load", job.keys)
        return job, problems

    def _request(self, keys: tuple[Key, ...]) -> tuple[Any, list[str]]:
        """One request's scope: look up, load the hits, store the rest (the engine computed them)."""
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
        problems = []
        if kind == "store":
            for k in keys:
                if self.model.keys.get(k) == "storing":
                    if ok:
                        self.model.keys[k] = "readable"
                    else:
                        del self.model.keys[k]
            return got, problems
        for k in keys:
            self.model.reading[k] -= 1
            if not self.model.reading[k]:
                del self.model.reading[k]
        if ok:
            want = [value_of(k) for k in keys]
            if list(got or ()) != want:
                bad = next((i for i, (g, w) in enumerate(zip(list(got or ()) + [None] * len(want), want)) if g != w))
                problems.append(f"kv_readback: load of {_fmt(keys)} read {list(got or ())}, the stores wrote {want} "
                                f"(key {_fmt([keys[bad]])} differs: a reused or unwritten slot)")
        return got, problems

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

    def _evictions(self, op: str) -> list[str]:
        problems = []
        for k in self.adapter.take_evicted():
            state = self.model.keys.get(k)
            if state is None:
                problems.append(f"{op}: reported {_fmt([k])} evicted, which it did not hold")
            elif state == "storing":
                problems.append(f"{op}: evicted {_fmt([k])} while its store is in flight")
            elif self.model.reading.get(k):
                problems.append(f"{op}: evicted {_fmt([k])} while a load reads it")
            self.model.keys.pop(k, None)
        return problems

    def violations(self) -> list[str]:
        problems = list(self.adapter.invariant_violations())
        try:
            slots = self.adapter.slots()
        except NotSupported:
            return problems
        held = set(self.model.keys)
        for k in sorted(set(slots) - held):
            problems.append(f"slots: {_fmt([k])} still holds slot {slots[k]!r}, the model says it is gone (leak)")
        for k in sorted(held - set(slots)):
            problems.append(f"slots: {_fmt([k])} is {self.model.keys[k]} but holds no slot")
        owners: dict[Hashable, Key] = {}
        for k, s in slots.items():
            if s in owners:
                problems.append(f"slots: slot {s!r} has two owners, {_fmt([owners[s]])} and {_fmt([k])}")
            owners[s] = k
        try:
            free = self.adapter.free_slots()
        except NotSupported:
            return problems
        if self.adapter.capacity is not None and len(owners) + free != self.adapter.capacity:
            problems.append(f"slots: {len(owners)} used + {free} free of {self.adapter.capacity} (slots leaked)")
        return problems


def _fmt(keys: Sequence[Key]) -> str:
    return "[" + ", ".join("/".join(map(str, k)) for k in keys) + "]"


# =========================================================================== explorer


@attrs.define
class StoreExploreResult:
    adapter: str
    states: int = 0
    transitions: int = 0
    max_depth: int = 0
    seconds: float = 0.0
    complete: bool = False
    violations: list[tuple[tuple[str, ...], tuple[tuple, ...]]] = attrs.Factory(list)

    def format_violation(self, i: int = 0) -> str:
        problems, trace = self.violations[i]
        lines = [f"violation after {len(trace)} steps:"]
        lines += [f"  {n + 1:2d}. {_step_str(s)}" for n, s in enumerate(trace)]
        return "\n".join(lines + [f"  ! {p}" for p in problems])

    def to_json(self) -> dict:
        return {"adapter": self.adapter, "states": self.states, "transitions": self.transitions,
                "max_depth": self.max_depth, "complete": self.complete, "seconds": round(self.seconds, 3),
                "violations": len(self.violations),
                "counterexamples": [{"problems": list(p), "steps": [_step_str(s) for s in t]} for p, t in self.violations]}


def _step_str(step: tuple) -> str:
    op, *args = step
    return f"{op}({', '.join(_fmt(a) if isinstance(a, tuple) else repr(a) for a in args)})"


def explore_store(factory: Callable[[], BlockStoreAdapter], bounds: StoreBounds = StoreBounds(), *,
                  stop_on_first: bool = False, max_violations: int = 5, progress: TextIO | None = None) -> StoreExploreResult:
    """Breadth-first over every state ``factory()`` reaches within ``bounds``; shortest counterexamples.

    Job ids are the adapter's; the model keys jobs by kind and keys, so the
    adapter's ``state_key`` should not carry job ids either.
    """
    t0 = time.perf_counter()
    root = StoreWorld(factory())
    result = StoreExploreResult(root.adapter.describe())
    prompts = prompts_for(bounds)
    parents: dict = {root.key(): (None, None)}
    queue = deque([(root, root.key(), 0)])
    seen_kinds: set[str] = set()
    stop = False
    while queue and not stop:
        world, key, depth = queue.popleft()
        for step in world.steps(prompts, bounds.max_jobs):
            child = world.clone()
            problems = child.do(*step)
            result.transitions += 1
            if problems:
                kinds = {p.split(":")[0] for p in problems}
                if stop_on_first or not kinds <= seen_kinds:
                    seen_kinds |= kinds
                    trace, k = [step], key
                    while parents[k][0] is not None:
                        trace.append(parents[k][1])
                        k = parents[k][0]
                    result.violations.append((tuple(problems), tuple(reversed(trace))))
                    if stop_on_first or len(result.violations) >= max_violations:
                        stop = True
                        break
                continue
            ckey = child.key()
            if ckey in parents:
                continue
            parents[ckey] = (key, step)
            if bounds.max_entries is None or len(child.model.keys) <= bounds.max_entries:
                queue.append((child, ckey, depth + 1))
                result.max_depth = max(result.max_depth, depth + 1)
        if bounds.max_states is not None and len(parents) >= bounds.max_states:
            break
        if bounds.max_seconds is not None and time.perf_counter() - t0 >= bounds.max_seconds:
            break
    result.states = len(parents)
    result.complete = not queue and not stop
    result.seconds = time.perf_counter() - t0
    if progress is not None:
        print(f"explore: done: {result.states} states, {result.transitions} transitions, "
              f"{len(result.violations)} violations, {result.seconds:.1f}s", file=progress, flush=True)
    return result


# =========================================================================== the hypothesis machine


ALPHABET = 3
MAX_BLOCKS = 4


class BlockStoreMachine(RuleBasedStateMachine):
    """Random store / load / lookup / request / ack / fail / redeliver steps; every check after each."""

    factory: Callable[..., BlockStoreAdapter] | None = None
    variants: tuple[dict, ...] = ({},)

    def __init__(self) -> None:
        super().__init__()
        self.world: StoreWorld | None = None

    def _do(self, *step: Any) -> None:
        problems = self.world.do(*step)
        assert not problems, f"{_step_str(step)}:\n  " + "\n  ".join(problems)

    @initialize(variant=st.integers(0, 63))
    def setup(self, variant: int) -> None:
        self.world = StoreWorld(type(self).factory(**self.variants[variant % len(self.variants)]))

    @invariant()
    def check(self) -> None:
        if self.world is not None:
            problems = self.world.violations()
            assert not problems, "\n".join(problems)

    @rule(pages=st.lists(st.integers(0, ALPHABET - 1), min_size=1, max_size=MAX_BLOCKS),
          op=st.sampled_from(["request", "request", "store", "lookup", "load"]))
    def on_prompt(self, pages: list[int], op: str) -> None:
        keys = chain(pages)
        if op == "load":
            keys = keys[: self.world.model.readable_prefix(keys)]
            if not keys:
                return
        self._do(op, keys)

    @precondition(lambda self: self.world is not None and bool(self.world.model.jobs))
    @rule(pick=st.integers(0, 15), ok=st.sampled_from([True, True, True, False]))
    def complete(self, pick: int, ok: bool) -> None:
        jobs = list(self.world.model.jobs)
        self._do("complete", jobs[pick % len(jobs)], ok)

    @precondition(lambda self: self.world is not None and bool(self.world.model.finished)
                  and self.world.adapter.redelivery != "caller_guarantees_once")
    @rule()
    def redeliver(self) -> None:
        self._do("redeliver")


def store_machine(factory: Callable[..., BlockStoreAdapter], *, variants: Sequence[dict] = ({},),
                  name: str = "BlockStoreMachine") -> type[BlockStoreMachine]:
    """A machine class bound to ``factory(**variant)``; its ``TestCase`` runs under pytest."""
    sub = type(name, (BlockStoreMachine,), {"factory": staticmethod(factory), "variants": tuple(variants)})
    sub.__module__ = BlockStoreMachine.__module__
    return sub


def run_store_fuzz(factory: Callable[..., BlockStoreAdapter], *, variants: Sequence[dict] = ({},), examples: int = 100,
                   steps: int = 40, seed: int = 0, progress: TextIO | None = None, shrink: bool = True,
                   machine_import: str | None = None):
    """``run_fuzz`` for a block store (the same ``FuzzResult``, regression test included)."""
    from hicache_fsm.testing.stateful import run_fuzz

    machine = store_machine(factory, variants=variants)
    machine.coverage = None
    return run_fuzz(machine, examples=examples, steps=steps, seed=seed, progress=progress, shrink=shrink,
                    machine_import=machine_import)
