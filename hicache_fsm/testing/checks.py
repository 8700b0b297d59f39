"""Steps and the checks run around them, shared by the stateful machine and the explorer.

A ``Step`` names one adapter operation with plain arguments. Arguments that
would name a run-time object (a job, a lock, a pin) are *positions* in the
adapter's current list (``pending_jobs()``, ``held_locks()``, ...), so a list
of steps replays on a fresh cache even though job ids differ between runs.

``perform`` runs a step and checks its contract:

- an operation the engine is entitled to (unlock a held lock, complete a
  pending job) must not be refused;
- an operation that is refused (``Rejected``) must leave the cache exactly
  as it was;
- acknowledging a finished job again must be refused;
- once ``complete_job`` / ``fail_job`` ended a job, none of its entries holds a
  lock or pin nobody owns (``job_keeps_no_lock``, when the adapter has
  ``unowned_refs``);
- ``evict`` / ``evict_host`` must free exactly the tokens they report;
- a lock held through the step keeps its prefix on the device
  (``lock_kept_on_device``, when the adapter has ``locked_device_tokens``);
- after a successful ``insert`` the whole prompt can be read back, and a
  ``match`` never reports more tokens than can be read back;
- any other exception is a bug.

``UseOrder`` judges the victims of every step for an adapter that declares
``eviction_policy() == "lru"``: from the operations the fuzzers ran (not from
the cache's own bookkeeping), no page that left the cache may have been used
more recently than a page that stayed.

``catalogue`` is the invariant catalogue checked after every step: the
adapter's invariants (for HiCache: the residency spec's invariants plus tree,
job and engine-reference checks), the declared ``capacity`` against ``occupancy``,
and the KV read back from every valid copy of every prompt against what was written.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from hicache_fsm.errors import ConfigError
from hicache_fsm.testing.adapter import (
    CacheAdapter,
    JobInfo,
    NotSupported,
    Rejected,
    kv_fingerprint,
)
from hicache_fsm.testing.interface import REQUIRED_OPS, MatchInfo

__all__ = ["INDEXED_OPS", "ORDERED_POLICIES", "Outcome", "Step", "UseOrder", "capacity_problems", "catalogue",
           "job_lock_problems", "judged", "kv_check", "kv_problems", "lock_problems", "perform", "readable_pages",
           "replay_steps"]

# op -> the adapter list its (first) argument indexes
INDEXED_OPS = {
    "complete_job": "pending_jobs",
    "fail_job": "pending_jobs",
    "unlock": "held_locks",
    "unpin_host": "held_pins",
    "redeliver": "finished_jobs",
    "prefetch_ready": "prefetching",
    "abort": "prefetching",
    "complete_storage": "storage_steps",
    "fail_storage": "storage_steps",
    "partial_storage": "storage_steps",
    "partial_backup": "storage_steps",
}
MUST_SUCCEED = frozenset({"unlock", "unpin_host", "complete_job", "fail_job", "prefetch_ready", "abort",
                          "complete_storage", "fail_storage", "partial_storage", "partial_backup"})
MUST_REJECT = frozenset({"redeliver"})
JOB_ENDING = frozenset({"complete_job", "fail_job"})  # steps after which ``job_lock_problems`` runs
RESULT_TYPES = {"insert": bool, "match": MatchInfo, "read_kv": list, "evict": int, "evict_host": int}
RESULT_NAMES = {"insert": "a bool", "match": "a MatchInfo", "read_kv": "a list of fingerprint tuples",
                "evict": "an int of tokens freed", "evict_host": "an int of tokens freed"}
QUERY_OPS = frozenset({"match", "read_kv"})  # never refused: a match may touch the use order, a read may load


@attrs.frozen
class Step:
    """One operation: ``op`` with ``args`` (indices for the ops in ``INDEXED_OPS``)."""

    op: str
    args: tuple = ()

    def __str__(self) -> str:
        if self.op in INDEXED_OPS:
            return f"{self.op}(#{self.args[0]})"
        return f"{self.op}({', '.join(repr(a) for a in self.args)})"

    def to_json(self) -> list:
        return [self.op, *[list(a) if isinstance(a, tuple) else a for a in self.args]]


@attrs.define
class Outcome:
    result: Any = None
    problems: list[str] = attrs.Factory(list)
    rejected: str | None = None
    skipped: bool = False
    error: BaseException | None = None


def _resolve(adapter: CacheAdapter, step: Step) -> tuple | None:
    listing = INDEXED_OPS.get(step.op)
    if listing is None:
        return step.args
    items = getattr(adapter, listing)()
    pos = step.args[0]
    if not items or not 0 <= pos < len(items):
        return None
    item = items[pos]
    return (getattr(item, "id", item), *step.args[1:])


def _aligned(adapter: CacheAdapter, tokens: Sequence[int]) -> tuple[int, ...]:
    tokens = tuple(tokens)
    return tokens[: len(tokens) - len(tokens) % adapter.page_size]


def perform(adapter: CacheAdapter, step: Step, *, catch: bool = True,
            before: Callable[[], Any] | None = None) -> Outcome:
    """Run ``step`` on ``adapter`` and check its contract (see the module docstring).

    ``skipped`` when the adapter lacks the operation or the indexed object does
    not exist; ``NotSupported`` from an operation every adapter has
    (``REQUIRED_OPS``) is a problem. With ``catch=False`` an unexpected exception propagates (so a
    test runner shows its traceback); otherwise it becomes a problem.
    ``before`` returns the snapshot of the state before the step, on demand
    (the explorer passes the untouched parent state's); by default the
    snapshot is taken eagerly for steps that may be refused.
    """
    if not adapter.supports(step.op) and step.op not in ("insert", "match", "poll"):
        return Outcome(skipped=True)
    args = _resolve(adapter, step)
    if args is None:
        return Outcome(skipped=True)
    fn = getattr(adapter, step.op)
    ending = _job_of(adapter, step)
    snap = None
    if adapter.supports("snapshot") and step.op not in QUERY_OPS:  # any other step may be refused: unchanged then
        snap = before if before is not None else adapter.snapshot()
    occ = adapter.occupancy() if step.op in ("evict", "evict_host") and adapter.supports("occupancy") else None
    locked = _locked_device_tokens(adapter)
    try:
        result = fn(*args)
    except NotSupported:
        if step.op in REQUIRED_OPS:  # skipping it would let a do-nothing adapter pass every check
            return Outcome(problems=[f"required_op: {step}: raised NotSupported, but every adapter implements "
                                     f"{step.op}"])
        return Outcome(skipped=True)
    except Rejected as exc:
        out = Outcome(rejected=str(exc))
        if step.op in MUST_SUCCEED:
            out.problems.append(f"{step}: refused although the engine is entitled to it: {exc}")
        if snap is None and before is not None and adapter.supports("snapshot"):
            snap = before
        if callable(snap):
            snap = snap()
        if snap is not None and adapter.snapshot() != snap:
            out.problems.append(f"{step}: refused ({exc}) but the cache changed")
        return out
    except Exception as exc:
        if not catch:
            raise
        tb = traceback.extract_tb(exc.__traceback__)
        where = f" at {tb[-1].name}:{tb[-1].lineno}" if tb else ""
        return Outcome(problems=[f"{step}: raised {type(exc).__name__}: {exc}{where}"], error=exc)
    out = Outcome(result=result)
    wanted = RESULT_TYPES.get(step.op)
    if wanted is not None and (not isinstance(result, wanted) or (wanted is int and isinstance(result, bool))):
        out.problems.append(f"{step}: returned {_shown(result)}, not {RESULT_NAMES[step.op]}")
        return out
    if step.op in MUST_REJECT:
        out.problems.append(f"{step}: an acknowledgement of finished job {args[0]} was accepted again")
    if occ is not None:
        after = adapter.occupancy()
        delta = (occ.device_tokens - after.device_tokens) if step.op == "evict" else (occ.host_tokens - after.host_tokens)
        if result != delta:
            out.problems.append(f"{step}: reported {result} tokens freed, occupancy went down by {delta}")
    if ending is not None:
        out.problems += job_lock_problems(adapter, step, ending)
    if locked:
        out.problems += lock_problems(step, locked, _locked_device_tokens(adapter))
    if step.op == "insert" and result:
        want = len(_aligned(adapter, args[0]))
        got = len(adapter.read_kv(args[0]))
        if got < want:
            out.problems.append(f"{step}: inserted, but only {got} of {want} tokens can be read back")
    if step.op == "match":
        want = len(_aligned(adapter, args[0]))
        got = len(adapter.read_kv(args[0]))
        if result.total > want or result.total > got:
            out.problems.append(f"{step}: matched {result.device_tokens}+{result.host_tokens} tokens, "
                                f"{got} readable of {want}")
    return out


def _job_of(adapter: CacheAdapter, step: Step) -> JobInfo | None:
    """The job a ``complete_job`` / ``fail_job`` step ends, when the adapter can tell who owns its locks."""
    if step.op not in JOB_ENDING or not adapter.supports("unowned_refs"):
        return None
    jobs = adapter.pending_jobs()
    return jobs[step.args[0]] if 0 <= step.args[0] < len(jobs) else None


def job_lock_problems(adapter: CacheAdapter, step: Step, job: JobInfo) -> list[str]:
    """``job_keeps_no_lock``: once ``step`` ended ``job`` (it left ``pending_jobs``; a retry runs under a new
    id), no entry the job moved holds a lock or pin that neither the engine nor a running operation owns."""
    if any(j.id == job.id for j in adapter.pending_jobs()):
        return []
    extra = adapter.unowned_refs()
    return [f"job_keeps_no_lock: {step} ended job {job.id} ({job.kind}), yet node {n} still holds "
            f"{extra[n][0]} lock(s) and {extra[n][1]} pin(s) nobody owns" for n in job.detail if n in extra]


def _locked_device_tokens(adapter: CacheAdapter) -> dict[int, int]:
    """``adapter.locked_device_tokens()`` while a lock is held and the adapter can tell; else empty."""
    if not adapter.supports("locked_device_tokens") or not adapter.held_locks():
        return {}
    return adapter.locked_device_tokens()


def lock_problems(step: Step, before: dict[int, int], after: dict[int, int]) -> list[str]:
    """``lock_kept_on_device``: every lock held before and after ``step`` still has at least the device tokens
    it had (a lock may gain some, as a load-back brings its tail up; it may never lose one)."""
    return [f"lock_kept_on_device: {step} took a locked prefix off the device: lock {lid} had {had} tokens "
            f"on the device, now {after[lid]}" for lid, had in before.items() if lid in after and after[lid] < had]


def kv_problems(reads: dict[tuple, list[tuple[int, ...]]]) -> list[str]:
    problems = []
    for prompt, copies in reads.items():
        for i, got in enumerate(copies):
            want = kv_fingerprint(prompt[: i + 1])
            if not got or any(c != want for c in got):
                problems.append(f"kv_readback: token {i} of prompt {list(prompt)} reads {list(got)} from its "
                                f"copies, {want} was written")
                break
    return problems


def kv_check(adapter: CacheAdapter, prompts: Iterable[Sequence[int]]) -> list[str]:
    """KV read back from every valid copy equals what was written (``adapter.kv_violations`` when the
    adapter checks all its entries at once, plus ``read_kv`` of ``prompts``)."""
    prompts = [tuple(p) for p in prompts]
    try:
        problems = adapter.kv_violations()
    except NotSupported:
        problems = []
    if prompts and not problems:
        problems = kv_problems(adapter.read_kv_many(prompts))
    return problems


def capacity_problems(adapter: CacheAdapter) -> list[str]:
    """``capacity``: an adapter that declares its tiers' capacity never holds more than that (``occupancy``),
    whatever its own invariants say; a cache that overflows silently still serves correct KV, so nothing else
    would notice."""
    if not adapter.supports("capacity"):
        return []
    if not adapter.supports("occupancy"):
        return ["capacity: the adapter declares capacity() but has no occupancy() to compare it with"]
    cap, occ = adapter.capacity(), adapter.occupancy()
    return [f"capacity: the {tier} tier holds {used} tokens, its declared capacity is {most}"
            for tier, used, most in (("device", occ.device_tokens, cap.device_tokens),
                                     ("host", occ.host_tokens, cap.host_tokens)) if used > most]


def catalogue(adapter: CacheAdapter, prompts: Iterable[Sequence[int]]) -> list[str]:
    """Every invariant violation now, declared capacity and KV read-back of ``prompts`` included."""
    return declared_violations(adapter) + capacity_problems(adapter) + kv_check(adapter, prompts)


def declared_violations(adapter: CacheAdapter) -> list[str]:
    """``adapter.invariant_violations()``; a value that is not a list of strings is itself the problem (a string
    was read as one violation a letter)."""
    found = adapter.invariant_violations()
    if isinstance(found, (list, tuple)) and all(isinstance(p, str) for p in found):
        return list(found)
    return [f"adapter_error: invariant_violations() returned {_shown(found)}, not a list of strings"]


def _shown(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def readable_pages(adapter: CacheAdapter, prompts: Iterable[Sequence[int]]) -> set[tuple[int, ...]]:
    """Every whole page some tier can serve now, named by the token prefix it ends (no side effects)."""
    ps = adapter.page_size
    out: set[tuple[int, ...]] = set()
    for prompt, copies in adapter.read_kv_many(prompts).items():
        n = len(copies) - len(copies) % ps
        out.update(prompt[:i] for i in range(ps, n + 1, ps))
    return out


ORDERED_POLICIES = ("lru",)  # what ``eviction_policy()`` may declare (None: victims are not judged)
USING_OPS = frozenset({"insert", "match", "lock"})


@attrs.define
class UseOrder:
    """Per readable page, the step that last used it, as the engine's operations imply (why: a match that
    forgets to refresh recency keeps the cache's own lists consistent and evicts the wrong page).

    Uses: ``insert`` uses every page of its prompt, ``match`` the pages it matched, ``lock`` the prefix it
    leaves readable; nothing else uses a page. A page that leaves the cache (no tier serves it) must not
    have been used more recently than one that stays. Pages used in one step tie; a page that came back
    on its own (no use) has no record and is never judged; nothing is judged while a lock, pin or job is
    held (a held page is no candidate, and the toolkit cannot tell which pages a handle holds).
    """

    clock: int = 0
    last: dict[tuple[int, ...], int] = attrs.Factory(dict)

    @classmethod
    def of(cls, adapter: CacheAdapter) -> UseOrder | None:
        """A fresh order for an adapter declaring a policy it can judge; None when it declares none."""
        if not adapter.supports("eviction_policy"):
            return None
        policy = adapter.eviction_policy()
        if policy is None:
            return None
        if policy not in ORDERED_POLICIES:
            raise ConfigError(f"{adapter.describe()}: eviction_policy() returned {policy!r}; "
                              f"the toolkit judges {', '.join(ORDERED_POLICIES)} (or None: not judged)")
        return cls()

    def copy(self) -> UseOrder:
        return UseOrder(self.clock, dict(self.last))

    def rank(self) -> tuple:
        """The pages grouped by last use, oldest first (the explorer's key: paths that used pages in another
        order are other states)."""
        groups: dict[int, list] = {}
        for page, t in self.last.items():
            groups.setdefault(t, []).append(page)
        return tuple(tuple(sorted(groups[t])) for t in sorted(groups))

    def judge(self, adapter: CacheAdapter, step: Step, out: Outcome, before: set[tuple[int, ...]],
              prompts: Iterable[Sequence[int]]) -> list[str]:
        """Record ``step``'s uses (it ran as ``out`` on a cache whose readable pages were ``before``) and
        check its victims against the pages it kept."""
        after = readable_pages(adapter, prompts)
        self.clock += 1
        for page in self._used(adapter, step, out):
            self.last[page] = self.clock
        problems: list[str] = []
        if not _holds_anything(adapter):
            kept = [(self.last[p], p) for p in before & after if p in self.last]
            oldest = min(kept, default=None)
            for page in sorted(before - after):
                if oldest is not None and self.last.get(page, -1) > oldest[0]:
                    problems.append(f"lru_order: {step} dropped page {list(page)} (last used at step "
                                    f"{self.last[page]}) but kept {list(oldest[1])} (last used at step "
                                    f"{oldest[0]}): LRU drops the least recently used page first")
        self.last = {p: t for p, t in self.last.items() if p in after}
        return problems

    def _used(self, adapter: CacheAdapter, step: Step, out: Outcome) -> list[tuple[int, ...]]:
        if step.op not in USING_OPS or out.skipped or out.rejected is not None or out.error is not None:
            return []
        tokens = _aligned(adapter, step.args[0])
        if step.op == "match":
            tokens = tokens[: out.result.total]
        elif step.op == "lock":
            tokens = tokens[: len(adapter.read_kv(tokens))]
        ps = adapter.page_size
        return [tokens[:i] for i in range(ps, len(tokens) - len(tokens) % ps + 1, ps)]


def _holds_anything(adapter: CacheAdapter) -> bool:
    """Whether a lock, pin or job holds some page now (then no victim is judged)."""
    return bool(adapter.pending_jobs()
                or (adapter.supports("held_locks") and adapter.held_locks())
                or (adapter.supports("held_pins") and adapter.held_pins()))


def judged(adapter: CacheAdapter, step: Step, order: UseOrder | None, prompts: Sequence[tuple[int, ...]],
           **kw: Any) -> Outcome:
    """``perform`` plus, with a ``UseOrder``, the victim order of the step (its problems join the outcome's)."""
    if order is None:
        return perform(adapter, step, **kw)
    held = _holds_anything(adapter)
    before = readable_pages(adapter, prompts)
    out = perform(adapter, step, **kw)
    if not out.problems and not out.skipped:
        problems = order.judge(adapter, step, out, before, prompts)
        out.problems += [] if held else problems
    return out


def replay_steps(adapter: CacheAdapter, steps: Iterable[Step], prompts: Iterable[Sequence[int]] = ()) -> list[str]:
    """Run ``steps`` in order, checking after each; the problems of the first failing step."""
    prompts = [tuple(p) for p in prompts]
    order = UseOrder.of(adapter)
    for n, step in enumerate(steps):
        if step.op == "insert" and step.args and tuple(step.args[0]) not in prompts:
            prompts.append(tuple(step.args[0]))
        out = judged(adapter, step, order, prompts)
        problems = out.problems or catalogue(adapter, prompts)
        if problems:
            return [f"after step {n + 1} {step}: {p}" for p in problems]
    return []
