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
- after a successful ``insert`` the whole prompt can be read back, and a
  ``match`` never reports more tokens than can be read back;
- any other exception is a bug.

``catalogue`` is the invariant catalogue checked after every step: the
adapter's invariants (for HiCache: the residency spec's invariants plus tree,
job and engine-reference checks) and the KV read back from every valid copy
of every prompt against what was written.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from hicache_fsm.testing.adapter import (
    CacheAdapter,
    JobInfo,
    NotSupported,
    Rejected,
    kv_fingerprint,
)
from hicache_fsm.testing.interface import REQUIRED_OPS

__all__ = ["INDEXED_OPS", "Outcome", "Step", "catalogue", "job_lock_problems", "kv_check", "kv_problems", "perform",
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
}
MUST_SUCCEED = frozenset({"unlock", "unpin_host", "complete_job", "fail_job", "prefetch_ready", "abort",
                          "complete_storage", "fail_storage", "partial_storage"})
MUST_REJECT = frozenset({"redeliver"})
JOB_ENDING = frozenset({"complete_job", "fail_job"})  # steps after which ``job_lock_problems`` runs
SNAPSHOT_OPS = frozenset({"unlock", "unpin_host", "redeliver"})


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
    if step.op in SNAPSHOT_OPS and adapter.supports("snapshot"):
        snap = before if before is not None else adapter.snapshot()
    occ = adapter.occupancy() if step.op in ("evict", "evict_host") and adapter.supports("occupancy") else None
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
    if step.op in MUST_REJECT:
        out.problems.append(f"{step}: an acknowledgement of finished job {args[0]} was accepted again")
    if occ is not None:
        after = adapter.occupancy()
        delta = (occ.device_tokens - after.device_tokens) if step.op == "evict" else (occ.host_tokens - after.host_tokens)
        if result != delta:
            out.problems.append(f"{step}: reported {result} tokens freed, occupancy went down by {delta}")
    if ending is not None:
        out.problems += job_lock_problems(adapter, step, ending)
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


def catalogue(adapter: CacheAdapter, prompts: Iterable[Sequence[int]]) -> list[str]:
    """Every invariant violation now, KV read-back of ``prompts`` included."""
    return list(adapter.invariant_violations()) + kv_check(adapter, prompts)


def replay_steps(adapter: CacheAdapter, steps: Iterable[Step], prompts: Iterable[Sequence[int]] = ()) -> list[str]:
    """Run ``steps`` in order, checking after each; the problems of the first failing step."""
    prompts = [tuple(p) for p in prompts]
    for n, step in enumerate(steps):
        out = perform(adapter, step)
        if step.op == "insert" and step.args and tuple(step.args[0]) not in prompts:
            prompts.append(tuple(step.args[0]))
        problems = out.problems or catalogue(adapter, prompts)
        if problems:
            return [f"after step {n + 1} {step}: {p}" for p in problems]
    return []
