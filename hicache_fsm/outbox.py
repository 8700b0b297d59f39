"""Jobs between emission and acknowledgement: the outbox, the pending table and the ledger.

A transition names job kinds; the residency driver builds the jobs and hands
them to ``Outbox.emit``. Executor jobs (D2H, H2D) wait in the queue until
``flush`` merges them into one batch per kind; storage jobs (H2S, S2H) go
straight to the storage tier. Every emitted job stays pending until its
completion is applied by ``apply``, which fires ``*_done`` / ``*_failed`` on
the nodes it covers. ``JobLedger`` counts how every job ended.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from typing import TYPE_CHECKING, Any, Iterable

import attrs

from hicache_fsm.errors import CompletionFailure, UnknownJob
from hicache_fsm.jobs import D2H, H2D, H2S, S2H, Completion, JobKind, TransferJob, merge_jobs
from hicache_fsm.radix import RadixTree, TreeNode
from hicache_fsm.results import LoadHandle

if TYPE_CHECKING:
    from hicache_fsm.interfaces import Attached, Driver, Loads

log = logging.getLogger("hicache_fsm.cache")

STORAGE_KINDS = frozenset({JobKind.H2S, JobKind.S2H})  # run by the storage tier, not the executor
_DONE_TRIGGER = {JobKind.D2H: "write_done", JobKind.H2D: "load_done", JobKind.H2S: "store_done"}
_FAIL_TRIGGER = {JobKind.D2H: "write_failed", JobKind.H2D: "load_failed", JobKind.H2S: "store_failed"}
JOBS_KEY = {k: f"jobs_{k.value}" for k in JobKind}  # the counter of jobs emitted, by kind
_BYTES_KEY = {k: f"bytes_{k.value}" for k in JobKind}
_FAILED_KEY = {k: f"failed_{k.value}" for k in JobKind}


@attrs.define(on_setattr=attrs.setters.NO_OP)  # counters bumped per job: no converter hook on every ``+= 1``
class JobLedger:
    """How every emitted job ended, in memory that stays bounded on a long-running server.

    The counts cover the cache's whole life, so "every emitted job is pending
    or ended exactly once" is an equation. Ids are remembered for the last
    ``window`` ended jobs only: enough to tell a re-delivered ack (an error) or
    a late ack of a job ``reset`` cancelled (ignored) from an unknown job.
    """

    window: int = 65536
    emitted: int = 0
    acked: int = 0
    failed: int = 0
    cancelled: int = 0
    # job id -> "acked" | "failed" | "cancelled", oldest first; ordered so that dropping the oldest is O(1)
    # (deleting a plain dict's first key leaves a hole every later ``next(iter())`` scans: ~100 us a job)
    recent: OrderedDict[int, str] = attrs.field(factory=OrderedDict, converter=OrderedDict)

    def ended(self, job_id: int, how: str) -> None:
        """Record that ``job_id`` ended ``how``: "acked", "failed" or "cancelled"."""
        if how == "acked":
            self.acked += 1
        elif how == "failed":
            self.failed += 1
        elif how == "cancelled":
            self.cancelled += 1
        else:
            raise ValueError(f"a job ends acked, failed or cancelled, not {how!r}")
        recent = self.recent
        recent[job_id] = how
        if len(recent) > self.window:
            recent.popitem(last=False)

    def copy(self) -> "JobLedger":
        return JobLedger(self.window, self.emitted, self.acked, self.failed, self.cancelled, self.recent)  # copied by the converter


class Outbox:
    """Pending jobs of one cache, from ``emit`` to the completion that ends them.

    Interface: ``emit`` / ``emit_load`` (register and queue), ``flush`` (start
    queued jobs), ``check`` / ``apply`` (completions), ``enrol_split`` (a node
    split mid-transfer), ``cancel_all`` (reset); read-only views
    ``pending_ids``, ``pending_jobs``, ``queued_jobs``, ``nodes_of``,
    ``handles_of``, ``has_pending``, ``is_pending``.

    Built with the tree (nodes of a job), the driver (transitions of a
    completion), the executor (batches), the attached runtimes (storage jobs,
    CP layer jobs), the counters, the bytes of one token and the step
    agreement of a rank group; ``connect`` gives it the parts built after
    it: the load-backs (failed loads) and the ack agreement (None on one rank).
    """

    def __init__(self, tree: RadixTree, driver: "Driver", executor: Any, attached: "Attached",
                 counters: Counter[str], token_bytes: int, agreement: Any) -> None:
        self.tree = tree
        self.driver = driver
        self.executor = executor
        self.attached = attached
        self.counters = counters
        self.token_bytes = token_bytes
        self.agreement = agreement
        self.loads: Loads | None = None
        self.acks: Any = None  # acks.AckAgreement with a rank group
        self._queued: list[TransferJob] = []
        self._pending: dict[int, TransferJob] = {}
        self._kind_count: Counter[JobKind] = Counter()  # pending jobs per kind: has_pending / count in O(1)
        self._job_nodes: dict[int, list[TreeNode]] = {}
        self._load_handles: list[LoadHandle] = []  # handles whose load is still queued
        self._job_handle: dict[int, LoadHandle] = {}  # pending h2d job -> the handle waiting on it
        self.ledger = JobLedger()
        self._deferred: list[CompletionFailure] = []  # failures of completions applied outside poll

    def connect(self, loads: "Loads", acks: Any) -> None:
        """Wire the parts built after the outbox: the load-backs and the ack agreement (None on one rank)."""
        self.loads, self.acks = loads, acks

    # ------------------------------------------------------------------ read-only views

    def pending_ids(self) -> list[int]:
        """Ids of jobs emitted and not yet acknowledged (queued or running), oldest first."""
        return list(self._pending)

    def pending_jobs(self) -> list[TransferJob]:
        return list(self._pending.values())

    def queued_jobs(self) -> list[TransferJob]:
        """Jobs emitted but not yet handed to the executor (``flush`` starts them)."""
        return list(self._queued)

    def is_pending(self, job_id: int) -> bool:
        return job_id in self._pending

    def pending_job(self, job_id: int) -> TransferJob | None:
        """The pending job with this id, or None (never pending, acked, or cancelled)."""
        return self._pending.get(job_id)

    def has_pending(self, kind: JobKind) -> bool:
        return self._kind_count[kind] > 0

    def count(self, kinds: frozenset[JobKind] | None = None) -> int:
        if kinds is None:
            return len(self._pending)
        return sum(self._kind_count[k] for k in kinds)

    def nodes_of(self, job_id: int) -> tuple[TreeNode, ...]:
        """The nodes a pending job covers (halves of a split node included)."""
        return tuple(self._job_nodes.get(job_id, ()))

    def handles_of(self, node: TreeNode) -> list[LoadHandle]:
        """Load handles of the pending loads covering ``node``."""
        return [self._job_handle[j] for j in node.pending_jobs if j in self._job_handle]

    # ------------------------------------------------------------------ emission

    def emit(self, job: TransferJob, nodes: list[TreeNode] | None = None) -> None:
        """Register ``job`` as pending on its nodes (``nodes``: those of ``job.node_ids``, when at hand) and queue it."""
        if nodes is None:
            tree = self.tree
            nodes = [tree.get(n) for n in job.node_ids]
        job_id, kind = job.id, job.kind
        for n in nodes:
            n.add_job(job_id)
        self._job_nodes[job_id] = nodes
        self._pending[job_id] = job
        self._kind_count[kind] += 1
        self.ledger.emitted += 1
        if kind is H2S or kind is S2H:  # STORAGE_KINDS
            self.attached.storage.submit(job)
        else:
            self._queued.append(job)
        self.counters[JOBS_KEY[kind]] += 1
        driver = self.driver
        if driver.observed:
            event = {"event": "job", "job": job_id, "kind": kind.value, "nodes": list(job.node_ids),
                     "tokens": job.num_tokens}
            if job.layer is not None:
                event["layer"] = job.layer
            driver.notify(event)

    def emit_load(self, job: TransferJob, handle: LoadHandle) -> None:
        """``emit`` an H2D job whose executor wait ``handle`` binds to when it is started."""
        self.emit(job)
        self._job_handle[job.id] = handle
        self._load_handles.append(handle)

    def enrol_split(self, upper: TreeNode) -> None:
        """A node split mid-transfer: its new upper half is covered by the same jobs."""
        for job_id in upper.pending_jobs:
            nodes = self._job_nodes.get(job_id)
            if nodes is not None:
                nodes.append(upper)

    def flush(self) -> None:
        """Merge queued jobs into one batch per kind and start them; a refused batch stays queued."""
        if not self._queued:
            return
        jobs, self._queued = self._queued, []
        handles, self._load_handles = self._load_handles, []
        groups = merge_jobs(jobs)
        executor = self.executor
        for i, batch in enumerate(groups):
            try:
                wait = executor.submit(batch)
            except BaseException:
                self._queued = [j for b in groups[i:] for j in b.jobs] + self._queued
                if any(b.kind is H2D for b in groups[i:]):
                    self._load_handles = handles + self._load_handles
                raise
            if batch.kind is H2D:
                for h in handles:
                    h.bind(wait)

    # ------------------------------------------------------------------ completions

    def check(self, c: object) -> None:
        """Raise ``UnknownJob`` unless ``c`` is a completion of a pending (or reset-cancelled) job."""
        if not isinstance(c, Completion):
            raise UnknownJob(f"expected a Completion, got {type(c).__name__}")
        if isinstance(c.job_id, bool) or not isinstance(c.job_id, int):
            raise UnknownJob(f"job ids are ints, got {type(c.job_id).__name__}: {c.job_id!r}")
        if type(c.ok) is not bool:  # "no" would count as a success, None as a failure: neither is said
            raise UnknownJob(f"Completion.ok is True or False, got {type(c.ok).__name__}: {c.ok!r} (job {c.job_id})")
        if c.job_id in self._pending:
            return
        how = self.ledger.recent.get(c.job_id)
        if how == "cancelled":
            return
        if how is not None:
            raise UnknownJob(f"job {c.job_id} was already acknowledged ({how})")
        raise UnknownJob(f"job {c.job_id!r} is not a job of this cache")

    def apply(self, completions: Iterable[Completion], late: list[Completion] | None = None) -> list[CompletionFailure]:
        """Apply each completion: fire ``*_done`` / ``*_failed`` on its nodes; returns those that could not be.

        ``late``, when given, receives the completions of jobs ``reset`` cancelled (ignored here).

        One completion that cannot be applied never stops the others: an
        unknown job changes nothing, and a completion whose transitions raise
        still ends its job (it left the executor) while the error is returned.
        Observers hear of every job that ended here, storage and CP layer jobs
        included.
        """
        driver = self.driver
        failures: list[CompletionFailure] = []
        pending, job_nodes, job_handle = self._pending, self._job_nodes, self._job_handle
        for c in completions:
            try:
                self.check(c)
            except UnknownJob as exc:
                failures.append(CompletionFailure(c, exc))
                continue
            job_id = c.job_id
            job = pending.pop(job_id, None)
            if job is None:  # cancelled by reset
                self.counters["late_cancelled_completions"] += 1
                if late is not None:
                    late.append(c)
                continue
            self._kind_count[job.kind] -= 1
            self.ledger.ended(job_id, "acked" if c.ok else "failed")
            nodes = job_nodes.pop(job_id)
            for node in nodes:
                node.drop_job(job_id)
            handle = job_handle.pop(job_id, None) if job_handle else None
            try:
                self._finish(job, c, nodes, handle)
            except Exception as exc:
                log.error("completion of job %d (%s) could not be applied: %s", job_id, job.kind.value, exc)
                failures.append(CompletionFailure(c, exc))
            if driver.observed:
                driver.notify({"event": "completion", "job": job_id, "ok": c.ok})
        return failures

    def defer(self, failures: list[CompletionFailure]) -> None:
        """Keep ``apply``'s failures for the next ``poll`` to report (completions applied inside another call)."""
        self._deferred.extend(failures)

    def take_deferred(self) -> list[CompletionFailure]:
        failures, self._deferred = self._deferred, []
        return failures

    def _finish(self, job: TransferJob, c: Completion, nodes: list[TreeNode], handle: LoadHandle | None) -> None:
        """The transitions a completion of ``job`` causes; every node is tried, the first error raised after."""
        attached = self.attached
        storage = attached.storage
        kind = job.kind
        if kind is H2S and storage is not None:
            storage.backup_finished(job, c.ok, c.error)
        if kind is S2H:  # the prefetch runtime already took the pages
            return
        if job.layer is not None and attached.cp is not None:  # a CP per-layer copy: the runtime acks once
            attached.cp.layer_job_finished(job, c.ok)
            return
        errors: list[Exception] = []
        if c.ok:
            self._fire_each(nodes, _DONE_TRIGGER[kind], errors)
            self.counters[_BYTES_KEY[kind]] += job.num_tokens * self.token_bytes
            if kind is D2H and storage is not None and attached.storage_attached():
                self._fire_each(nodes, "store", errors, only_if_able=True)
        else:
            self.counters[_FAILED_KEY[kind]] += 1
            log.warning("job %d (%s) failed: %s", c.job_id, kind.value, c.error)
            if kind is H2D:
                self.loads.load_failed(nodes, handle)
            else:
                self._fire_each(nodes, _FAIL_TRIGGER[kind], errors)
        if errors:
            raise errors[0]

    def _fire_each(self, nodes: list[TreeNode], trigger: str, errors: list[Exception],
                   only_if_able: bool = False) -> None:
        """Fire ``trigger`` on every node (``only_if_able``: where it can fire); errors are collected, not raised."""
        driver = self.driver
        for node in nodes:
            try:
                if not only_if_able or driver.can_fire(node, trigger):
                    driver.fire(node, trigger)
            except Exception as exc:
                errors.append(exc)

    def apply_agreed(self, done: list[Completion]) -> tuple[list[Completion], list[CompletionFailure]]:
        """``apply`` the completions every rank has; returns those applied (not those of jobs ``reset`` cancelled)
        and ``apply``'s failures (see ``hicache_fsm.acks``).

        One rank: ``done`` itself. With a rank group, ``done`` is held and the
        step's agreement (one collective) decides which held completions apply now.
        """
        acks = self.acks
        if acks is not None:
            direct = acks.hold(done)
            self.agreement.step()
            done = direct + acks.take()
        late: list[Completion] = []
        failures = self.apply(done, late)
        if late:  # completions of jobs ``reset`` cancelled: ignored, so not reported applied
            cancelled = {id(c) for c in late}
            done = [c for c in done if id(c) not in cancelled]
        return done, failures

    def forget(self, job_id: int) -> None:
        """Drop a pending job without ending it in the ledger (tests that break the ledger on purpose)."""
        self._kind_count[self._pending.pop(job_id).kind] -= 1

    # ------------------------------------------------------------------ lifecycle

    def cancel_all(self) -> None:
        """``reset``: every pending job ends cancelled; queued loads' handles report ``LoadCancelled``."""
        for job_id in self._pending:
            self.ledger.ended(job_id, "cancelled")
        for h in self._load_handles:
            h.cancelled = True
        self._queued.clear()
        self._pending.clear()
        self._kind_count.clear()
        self._job_nodes.clear()
        self._load_handles.clear()
        self._job_handle.clear()

    def fork(self, tree: RadixTree, driver: "Driver", executor: Any, attached: "Attached", counters: Counter[str],
             agreement: Any, memo: dict, fork_handle) -> "Outbox":
        """A copy over a fork's collaborators: nodes and handles through ``memo`` / ``fork_handle``, jobs shared.

        Connect it as a new outbox.
        """
        new = Outbox(tree, driver, executor, attached, counters, self.token_bytes, agreement)
        new._queued = list(self._queued)
        new._pending = dict(self._pending)
        new._kind_count = Counter(self._kind_count)
        new._job_nodes = {j: [memo[id(n)] for n in nodes] for j, nodes in self._job_nodes.items()}
        new._load_handles = [fork_handle(h) for h in self._load_handles]
        new._job_handle = {k: fork_handle(h) for k, h in self._job_handle.items()}
        new.ledger = self.ledger.copy()
        new._deferred = list(self._deferred)
        return new
