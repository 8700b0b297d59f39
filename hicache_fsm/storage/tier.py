"""The storage tier (L3) of a running cache: ``cache.storage``.

Theory of operation. ``StorageTier`` joins three things:

* the ``storage_link`` machine over a :class:`~hicache_fsm.storage.link.StorageLink`
  (attach / detach at run time, rollback of a failed attach);
* two background threads per attachment: the *query* thread answers prefetch
  hit queries (``batch_exists`` in batches, stopping at the first miss), the
  *I/O* thread runs transfers (prefetch pages into reserved host slots first,
  then host-to-storage backups);
* the ``prefetch`` machine's runtime (:mod:`hicache_fsm.storage.prefetch`).

This module keeps the tier's bookkeeping on the scheduler's thread: the link,
jobs from the cache, draining thread events, backups and their retries,
accounting, lifecycle and forks. Two pieces live apart, inherited by
``StorageTier``: what the threads run (:mod:`hicache_fsm.storage.threads`)
and prefetch admission and lifecycle (:mod:`hicache_fsm.storage.admission`).

Threads never change the tree, a pool allocator or a machine state. They read
host pages the residency machine keeps pinned (``*_storing`` states) or write
host pages a prefetch reserved, and post events to a queue. The scheduler's
thread drains that queue in ``poll`` (and in the prefetch calls), fires the
prefetch triggers and hands ``Completion`` records of H2S / S2H jobs to the
cache, which fires ``store_done`` / ``store_failed``.

Failures. Any ``StorageError`` marks storage unhealthy: backups are not
started (the residency guard ``storage_attached`` says no), prefetches are not
admitted, jobs already queued fail at once without touching the backend (no
per-job timeout), and the I/O thread probes the backend every
``probe_interval`` seconds. Once it answers, ``poll`` re-fires ``store`` for
nodes whose host copy is not in storage yet (failed or skipped backups),
rate-limited; those nodes are kept in a set the residency driver's reports
maintain (:mod:`hicache_fsm.storage.retry`), so a retry never scans the tree.
Failed prefetch batches end the prefetch with the pages that arrived.

Ownership. Only this tier completes the h2s / s2h jobs it runs
(``cache.complete(c, owner=tier)``); an engine acking one gets
``JobOwnerError`` (see :mod:`hicache_fsm.storage.ownership`).

Ending. ``drain(timeout)`` lets queued backups finish; ``detach`` and
``close`` end every transfer within ``join_timeout`` (queued jobs fail, running
ones stop at their next batch, prefetches are aborted).
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
import weakref
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

from hicache_fsm.config import check_seconds
from hicache_fsm.errors import (
    GroupError, GuardRejected, HiCacheError, InvalidTransition, StorageLinkError, UnknownStorageOption,
)
from hicache_fsm.interfaces import TierContext
from hicache_fsm.jobs import Completion, JobKind, TransferJob
from hicache_fsm.machine import compile_machine
from hicache_fsm.outbox import STORAGE_KINDS
from hicache_fsm.spec import load_builtin
from hicache_fsm.storage import open_backend
from hicache_fsm.storage.evictions import EvictionTracker
from hicache_fsm.storage.admission import PrefetchCalls
from hicache_fsm.storage.agreement import TierAgreement
from hicache_fsm.storage.base import STAT_FIELDS, StorageBackend
from hicache_fsm.storage.keys import PageKeyChain, page_keys
from hicache_fsm.storage.link import StorageLink
from hicache_fsm.storage.lost_pages import LostPages
from hicache_fsm.storage.options import TierOptions, check_backend_keys
from hicache_fsm.storage.prefetch import PrefetchOp, PrefetchRuntime
from hicache_fsm.storage.retry import UNSTORED, BackupRetries
from hicache_fsm.storage.threads import PROBE_KEY, StorageThreads, waker
from hicache_fsm.tokens import TokenIds
from hicache_fsm.tp import PURPOSE_ATTACH, PURPOSE_ATTACH_COMMIT

if TYPE_CHECKING:  # pragma: no cover
    from hicache_fsm.interfaces import TierHost
    from hicache_fsm.radix import TreeNode

log = logging.getLogger("hicache_fsm.storage.tier")

STORING = frozenset({"device_host_storing", "host_storing", "loading_storing"})
REJECT_REASONS = ("detached", "unhealthy", "below_threshold", "capacity", "host_full", "format_mismatch")
# every counter stats() reports, present (as 0) before it first counts; documented in docs/storage.md
COUNTERS = (
    "attaches", "attach_failures", "detaches",
    "backups_submitted", "backups_stored", "backup_tokens_stored", "backup_failures", "backup_retries",
    "backups_skipped_mla", "jobs_failed_fast", "storage_outages", "storage_recoveries", "storage_errors",
    "health_probes", "data_epoch_changes", "storage_lost_nodes",
    "prefetch_admitted", "prefetch_requested_tokens", *(f"prefetch_rejected_{r}" for r in REJECT_REASONS),
    "prefetch_revoked", "prefetch_query_failures", "prefetch_short_batches", "prefetch_completed",
    "prefetch_partial", "prefetch_empty", "prefetch_aborted", "prefetch_found_tokens", "prefetch_hit_tokens",
    "prefetch_fetched_tokens",
    "prefetch_inserted_tokens", "prefetch_duplicate_tokens", "prefetch_released_tokens", "prefetch_trimmed_tokens",
    "prefetch_unstored_tokens",
)
_HANDLERS = {"query_start": "query_started", "query_done": "query_answered", "query_failed": "query_failed",
             "batch": "batch_landed"}  # thread event -> the method that acts on it


def namespace_seed(namespace: Hashable) -> str | None:
    """The prior of a tree namespace's first page: None for none (SGLang's keys).

    A str is SGLang's ``extra_key`` (a LoRA id) and a pair of str or None is
    its ``(extra_key, cache_salt)``: seeded as SGLang's
    ``storage_namespace_seed`` does (a tag, then each part as presence, UTF-8
    length and bytes), so their page hashes are SGLang's too. Any other
    namespace is seeded from its ``repr``.
    """
    if namespace is None:
        return None
    parts = (namespace, None) if isinstance(namespace, str) else namespace
    if type(parts) is tuple and len(parts) == 2 and all(p is None or isinstance(p, str) for p in parts) \
            and parts != (None, None):
        digest = hashlib.sha256(b"sglang-cache-namespace-v1")
        for part in parts:
            if part is None:
                digest.update(b"\x00")
            else:
                encoded = part.encode("utf-8", "surrogatepass")
                digest.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
        return digest.hexdigest()
    return hashlib.sha256(b"hicache-fsm-namespace\0" + repr(namespace).encode()).hexdigest()


class StorageTier(PrefetchCalls, StorageThreads, LostPages):
    """``cache.storage``: backend link, storage threads, backups and prefetches (see module docstring).

    Built with a ``TierContext`` (``TierContext.of(cache)``): the tree, the
    driver, the outbox, the rank group and the few calls it makes on the
    cache's behalf; never the cache itself.
    """

    def __init__(self, ctx: TierContext) -> None:
        self.ctx = ctx
        self.page_size = ctx.page_size
        self.host_pool = ctx.host_pool
        self.options = TierOptions()
        self.link_machine = compile_machine(load_builtin("storage_link"))
        self._cv = threading.Condition()
        self.link = StorageLink(waker(self._cv))
        weakref.finalize(self, self.link.abandon).atexit = False  # dropped unclosed: the threads hold it weakly
        self.runtime = PrefetchRuntime(ctx, self._submit_transfer, self._store_again)
        self._query_q: deque[tuple[int, PrefetchOp]] = deque()
        self._transfer_q: deque[tuple[int, TransferJob, PrefetchOp]] = deque()
        self._backup_q: deque[tuple[int, TransferJob]] = deque()
        self._busy = 0
        self._gen = 0
        self._winding_down = threading.Event()
        self._events: deque[tuple] = deque()
        self._completions: list[Completion] = []
        self._pending_transfer: dict[int, PrefetchOp] = {}  # S2H job id -> op, between emit and submit
        self._recent_chains: deque[PageKeyChain] = deque(maxlen=4)  # the last prefetches' keys (keys_for reuses)
        self._skip_writes = False
        self.healthy = True
        self.last_error = ""
        self._link_down = ""  # storage threads' view: why the backend is down ("" = up); under _cv
        self._last_probe = 0.0
        self._sweep_due = False
        self._last_sweep = float("-inf")
        self.retries = BackupRetries()  # unstored nodes, kept current by the driver's reports
        self.counters: Counter[str] = Counter()
        self._thread_counts: Counter[str] = Counter()  # written by storage threads under _cv
        self._foreign_keys: OrderedDict[str, None] = OrderedDict()  # keys in another page format, until re-attach
        self.closed = False
        self.agreement: TierAgreement | None = None
        if not ctx.group.solo:  # tensor parallelism: ranks act on what every rank observed
            self.agreement = TierAgreement(self)
            ctx.agreement.register(self.agreement)
            self.runtime.clock = self.agreement.now
        ctx.register_host_owner(self.runtime.host_owners)
        ctx.register_invariants(self.violations)
        ctx.driver.add_listener(self.retries)
        self.evictions = EvictionTracker(self.keys_for)  # pages the backend evicted -> storage_lost
        ctx.driver.add_listener(self.evictions)
        for node in ctx.tree.nodes():  # host copies made before the tier existed
            if node.parent is not None and node.state in UNSTORED:
                self.retries.ready[node.id] = node

    # ================================================================== link: attach / detach

    @property
    def state(self) -> str:
        return self.link.state

    @property
    def backend(self) -> StorageBackend | None:
        return self.link.backend

    def attach(self, url_or_backend: str | StorageBackend, **options: Any) -> None:
        """Open the backend, start the threads; on any failure undo all of it and raise StorageLinkError.

        With a rank group, every rank ends its attach in one vote
        (``PURPOSE_ATTACH_COMMIT``), whatever refused it: a rank refused
        before it opened anything votes no, so no rank attaches alone.
        """
        try:
            self._check_open()
            tier_options, backend_options = TierOptions.split(options)
            if not isinstance(url_or_backend, str):
                tier_options = tier_options.keyed_like(url_or_backend, options)
            tier_options = tier_options.ranked_in(self.ctx.group, options)
            namespace = tier_options.key_namespace()  # validates model / tenant / ranks
            if isinstance(url_or_backend, str):
                pass
            elif isinstance(url_or_backend, StorageBackend) or hasattr(url_or_backend, "batch_exists"):
                if backend_options:
                    raise StorageLinkError(f"backend options {sorted(backend_options)} need a URL, not an open backend")
                check_backend_keys(url_or_backend, namespace, options)
            else:
                raise StorageLinkError(
                    f"attach_storage wants a storage URL or a backend, got {type(url_or_backend).__name__}")
            self._drain()
            if self.link.state == "detaching":
                raise StorageLinkError(
                    "the previous detach has not finished (storage threads alive); call detach again")
            old_options = self.options
            try:
                self.link_machine.fire(self.link, "attach", self)
            except GuardRejected:
                raise StorageLinkError(
                    f"cannot attach storage: {self.transfers_in_flight()} storage transfers in flight"
                ) from None
            except InvalidTransition:
                raise StorageLinkError(f"cannot attach storage: the link is {self.link.state}") from None
        except Exception:
            self._vote_no()
            raise
        voted = False
        try:
            if isinstance(url_or_backend, str):
                self.link.backend = open_backend(url_or_backend, namespace=namespace, **backend_options)
            else:
                if isinstance(url_or_backend, StorageBackend):  # a tier closes its backend when it detaches
                    url_or_backend.attached_to.take(self.link, StorageLinkError(
                        "this backend object is attached to another cache's storage: open one per cache "
                        "(they may share a store: memory://NAME, one directory, one server)"))
                self.link.backend = url_or_backend
            self.options = tier_options
            self.link.join_timeout = tier_options.join_timeout
            self.runtime.configure(tier_options)
            self._skip_writes = tier_options.skip_writes
            self.healthy, self.last_error = True, ""
            self._link_down = ""
            with self._cv:  # another backend (or the same one, rewritten): formats are learnt again
                self._foreign_keys.clear()
            if self.agreement is not None:
                self.agreement.local_health = (True, "")
            self.start_workers()
            self.link.backend.batch_exists([PROBE_KEY])  # the backend answers, end to end
            voted = True
            if not self.ctx.group.all_true(True, PURPOSE_ATTACH_COMMIT):  # attached everywhere or nowhere
                raise StorageLinkError("attaching storage failed on another rank")
        except BaseException as exc:  # anything, even KeyboardInterrupt: undo the attach first
            if not voted and isinstance(exc, Exception):
                self._vote_no()
            self.link_machine.fire(self.link, "attach_failed", self)
            self.options = old_options
            self.runtime.configure(old_options)
            self._skip_writes = old_options.skip_writes
            self.counters["attach_failures"] += 1
            log.info("attaching storage %s failed: %s; rolled back", self._describe(url_or_backend), exc)
            if isinstance(exc, UnknownStorageOption):  # a misspelt tier option lands here too: name both lists
                raise StorageLinkError(
                    f"attaching storage failed: unknown option(s) {', '.join(exc.names)}; attach_storage takes the "
                    f"tier's {', '.join(TierOptions.names())} and the {exc.scheme}:// "
                    f"backend's {', '.join(exc.known)}") from exc
            if isinstance(exc, (HiCacheError, OSError, ValueError, TypeError)):
                raise StorageLinkError(f"attaching storage failed: {exc}") from exc
            raise
        self.link_machine.fire(self.link, "attach_ok", self)
        self.evictions.watch(self.link.backend, self.ctx.tree.nodes())
        self._read_epoch_at_attach()  # lost pages show as a change; an earlier attachment's marks may not hold
        self._sweep_due = True  # host copies made before the attach get stored too
        self.counters["attaches"] += 1
        log.info("storage attached: %s (namespace %s)", self._describe(url_or_backend), namespace.prefix)

    @staticmethod
    def _describe(url_or_backend: object) -> str:
        if isinstance(url_or_backend, str):
            return re.sub(r"//[^@/]*@", "//***@", url_or_backend)
        return repr(url_or_backend)

    def detach(self) -> None:
        """Stop the threads and close the backend; no-op when detached.

        Storage jobs that already finished are applied first (as ``poll`` would),
        then ``wind_down`` ends the rest: prefetches are aborted, queued backups
        fail (their nodes keep their host copies and are backed up again after a
        later attach), and a transfer already running gets ``join_timeout``.
        Only if one still runs then is the detach refused (StorageLinkError,
        nothing else changed). If a thread does not exit within ``join_timeout``
        the link stays ``detaching`` and StorageLinkError is raised: call again.
        """
        self._confine()
        self._apply_finished()
        if self.link.state == "attached":
            self.wind_down("storage is detaching")
        if self.link.state in ("detached", "attached"):
            try:
                self.link_machine.fire(self.link, "detach", self)
            except GuardRejected:
                raise StorageLinkError(
                    f"cannot detach storage: {self.transfers_in_flight()} storage transfers in flight"
                ) from None
            if self.link.state == "detached":
                return
        elif self.link.state != "detaching":
            raise StorageLinkError(f"cannot detach storage while the link is {self.link.state}")
        self.link.join()
        try:
            self.link_machine.fire(self.link, "threads_stopped", self)
        except GuardRejected:
            raise StorageLinkError("storage threads did not stop in time; detach again to retry") from None
        with self._cv:
            self._gen += 1  # whatever the stopped threads posted last (a probe's verdict) is stale now
        self._events.clear()
        self.evictions.unwatch()
        self.healthy, self.last_error = True, ""
        self._link_down = ""
        self.counters["detaches"] += 1
        log.info("storage detached")

    def wind_down(self, reason: str) -> None:
        """End every storage transfer within ``join_timeout``: abort prefetches, fail queued jobs, await the rest."""
        self._confine()
        for rid in list(self.runtime.active):
            self.abort_prefetch(rid)
        self._fail_queued(reason)
        self._winding_down.set()  # a running backup ends at its next batch (it failed: stored again later)
        try:
            deadline = time.monotonic() + self.options.join_timeout
            while self.transfers_in_flight() and time.monotonic() < deadline:
                with self._cv:  # woken when a storage thread finishes an item
                    self._cv.wait(min(0.05, max(0.0, deadline - time.monotonic())))
                self._apply_finished()
        finally:
            self._winding_down.clear()

    def _fail_queued(self, reason: str) -> None:
        """Every queued backup and transfer ends as failed (``reason``) without touching the backend."""
        with self._cv:
            queued = [(g, job, None) for g, job in self._backup_q] + list(self._transfer_q)
            self._backup_q.clear()
            self._transfer_q.clear()
            self._query_q.clear()
        for g, job, op in queued:
            self._post(g, "done", job, False, reason, op)

    def drain(self, timeout: float) -> bool:
        """Let queued and running backups finish, for at most ``timeout`` seconds; True when none is left.

        Starts no new backup (retries wait for the next ``poll``). While storage is
        unhealthy queued backups fail at once, so this returns quickly then too.
        """
        self._check_open()
        deadline = time.monotonic() + drain_seconds(timeout, "drain(timeout)")
        while True:
            self._apply_finished()
            if not self.ctx.outbox.has_pending(JobKind.H2S):
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            with self._cv:
                self._cv.wait(min(remaining, 0.05))

    def _apply_finished(self) -> None:
        """Hand finished storage jobs to the cache now instead of at its next poll."""
        self._drain()
        done, self._completions = self._completions, []
        for c in done:
            self.ctx.complete(c, owner=self)

    def accepting_backups(self) -> bool:
        return self.link.state == "attached" and self.healthy and not self.closed

    # ================================================================== jobs from the cache

    def keys_for(self, node: TreeNode) -> tuple[str, ...]:
        """Chained page keys of ``node`` (cached on the node; a split slices them)."""
        ps = self.page_size
        if node.storage_keys is not None and len(node.storage_keys) == node.num_tokens // ps:
            return node.storage_keys
        chain = []
        n = node
        while not n.is_root and (n.storage_keys is None or len(n.storage_keys) != n.num_tokens // ps):
            chain.append(n)
            n = n.parent
        prior = None if n.is_root else n.storage_keys[-1]
        for m in reversed(chain):
            if m.parent.is_root:
                prior = namespace_seed(m.namespace)
            tokens = m.token_ids
            m.storage_keys = self._hashed_keys(prior, tokens) or tuple(page_keys(tokens, ps, prior))
            prior = m.storage_keys[-1]
        return node.storage_keys

    def remember_chain(self, chain: PageKeyChain) -> None:
        """Keep a prefetch's key chain a while: the pages it missed are inserted next and backed up."""
        self._recent_chains.append(chain)

    def _hashed_keys(self, prior: str | None, tokens: TokenIds) -> tuple[str, ...] | None:
        for chain in reversed(self._recent_chains):
            keys = chain.keys_following(prior, tokens)
            if keys is not None:
                return keys
        return None

    def prior_key(self, node: TreeNode, namespace: Hashable) -> str | None:
        return namespace_seed(namespace) if node.is_root else self.keys_for(node)[-1]

    def submit(self, job: TransferJob) -> None:
        """The cache emitted an H2S (or, through the prefetch runtime, an S2H) job."""
        self._confine()
        if job.kind is JobKind.H2S:
            self.counters["backups_submitted"] += 1
            if self.link.state != "attached":
                self._events.append((self._gen, "done", job, False, "storage is not attached", None))
                return
            if self._skip_writes:  # MLA: rank 0 writes the shared copy
                self.counters["backups_skipped_mla"] += 1
                self._events.append((self._gen, "done", job, True, "", None))
                return
            with self._cv:
                self._backup_q.append((self._gen, job))
                self._cv.notify_all()
            return
        if job.kind is JobKind.S2H:
            op = self._pending_transfer.pop(job.id)
            with self._cv:
                self._transfer_q.append((self._gen, job, op))
                self._cv.notify_all()
            return
        raise HiCacheError(f"the storage tier runs h2s and s2h jobs, not {job.kind.value}")

    def _submit_transfer(self, op: PrefetchOp, job: TransferJob) -> None:
        self._pending_transfer[job.id] = op
        self.ctx.outbox.emit(job)

    # ================================================================== poll

    def poll(self) -> list[Completion]:
        """Drain thread events, retry failed backups when due; completions for the cache."""
        self._confine()
        self._drain()
        self._apply_evictions()
        self._maybe_sweep()
        done, self._completions = self._completions, []
        return done

    def _vote_no(self) -> None:
        """This rank's attach failed before its vote: vote no, so that no other rank attaches alone."""
        try:
            self.ctx.group.all_true(False, PURPOSE_ATTACH_COMMIT)
        except GroupError as exc:  # the attach's own error is the one raised
            log.info("storage attach: the ranks' vote failed too: %s", exc)

    def _drain(self) -> None:
        events = self._events
        rt = self.runtime
        agreement = self.agreement
        while events:
            ev = events.popleft()
            if ev[0] != self._gen:
                continue
            kind = ev[1]
            if kind == "done":
                _, _, job, ok, error, op = ev
                self._completions.append(Completion(job.id, ok, error))  # the cache applies it (agreed)
                if op is not None and job.kind is JobKind.S2H:
                    if agreement is None:
                        rt.transfer_finished(op)
                    else:
                        agreement.transfer_ended(op)
            elif kind == "epoch":
                self.epoch_read(ev[2])
            elif kind != "health" and rt.active.get(ev[2].request_id) is not ev[2]:
                continue  # ended (aborted, stopped) meanwhile
            elif agreement is not None:  # a rank group: act only on what every rank saw
                agreement.observe(ev)
            elif kind == "health":
                _, _, healthy, error = ev
                self.set_health(healthy, error)
            else:
                getattr(self, _HANDLERS[kind])(ev[2], *ev[3:])

    def backup_finished(self, job: TransferJob, ok: bool, error: str) -> None:
        """The cache applied an H2S job's (agreed) completion: count it; a failure backs the nodes off."""
        if ok:
            self.counters["backups_stored"] += 1
            self.counters["backup_tokens_stored"] += job.num_tokens
            self.retries.stored(job.node_ids)
        else:
            self.counters["backup_failures"] += 1
            self._sweep_due = True
            self.retries.back_off(job.node_ids, self.options.retry_interval, self.now())
            log.warning("storage backup of %d tokens (job %d) failed: %s", job.num_tokens, job.id, error)

    def set_health(self, healthy: bool, error: str) -> None:
        if healthy == self.healthy:
            return
        self.healthy = healthy
        if healthy:
            self.counters["storage_recoveries"] += 1
            self._sweep_due = True
            self.retries.forgive()  # storage is back: retry everything at once
            log.warning("storage answers again; pending backups will be retried")
        else:
            self.last_error = error
            self.counters["storage_outages"] += 1
            log.warning("storage is unavailable (%s); backups paused, prefetches refused", error)

    # ------------------------------------------------------------------ retry of backups

    def now(self) -> float:
        """Seconds for prefetch timeouts and backup retries (agreed across ranks with a rank group)."""
        return time.monotonic() if self.agreement is None else self.agreement.now()

    def _maybe_sweep(self) -> None:
        """Start backups of unstored nodes, ``retry_batch_tokens`` every ``retry_interval`` seconds at most."""
        if not self._sweep_due or not self.accepting_backups():
            return
        now = self.now()
        if now - self._last_sweep < self.options.retry_interval:
            return
        self._last_sweep = now
        driver = self.ctx.driver

        def start(node: TreeNode) -> bool:
            if not driver.can_fire(node, "store"):
                return False
            driver.fire(node, "store")
            return True

        started, more = self.retries.sweep(start, self.options.retry_batch_tokens, now)
        # a backup still running may fail: look again later
        self._sweep_due = more or self.ctx.outbox.has_pending(JobKind.H2S)
        if started:
            self.counters["backup_retries"] += started
            log.info("retrying storage backup of %d nodes", started)

    # ================================================================== accounting

    def transfers_in_flight(self) -> int:
        """Storage jobs not yet acknowledged plus prefetches a storage thread may still pick up."""
        pending = self.ctx.outbox.count(STORAGE_KINDS)
        waiting = sum(1 for op in self.runtime.active.values() if op.state in ("admitted", "querying"))
        return pending + waiting

    def stats(self) -> dict:
        """Every counter of COUNTERS (0 until it counts), the link's state and the backend's counters."""
        out: dict[str, Any] = dict.fromkeys(COUNTERS, 0)
        out.update(self.counters)
        with self._cv:
            out.update(self._thread_counts)
        rt = self.runtime
        out.update(rt.counters)
        backend = self.link.backend
        out.update(
            link=self.link.state,
            healthy=self.healthy,
            last_error=self.last_error,
            backend=(getattr(backend, "scheme", None) or type(backend).__name__) if backend is not None else None,
            backend_stats={**dict.fromkeys(STAT_FIELDS, 0),
                           **(backend.stats() if backend is not None else self.link.last_backend_stats)},
            backend_totals={**dict.fromkeys(STAT_FIELDS, 0), **self.link.totals()},
            prefetch_running=len(rt.active),
            prefetch_tokens_held=rt.occupied_tokens,
            prefetch_capacity_tokens=rt.capacity_tokens,
            transfers_in_flight=self.transfers_in_flight(),
        )
        return out

    def link_violations(self) -> list[str]:
        """``no_transfer_while_detached``: nothing moves to or from storage unless attached."""
        problems = []
        state = self.link.state
        if state == "attached":
            dead = [t.name for t in self.link.threads if not t.is_alive()]
            if dead:
                problems.append(f"storage threads died while attached: {dead}")
            return problems
        if state != "detached":
            return problems
        pending = [j.id for j in self.ctx.outbox.pending_jobs() if j.kind in (JobKind.H2S, JobKind.S2H)]
        if pending:
            problems.append(f"storage jobs {pending[:8]} pending while detached")
        storing = [n.id for n in self.ctx.tree.nodes() if n.state in STORING]
        if storing:
            problems.append(f"nodes {storing[:8]} are storing while detached")
        if self.link.threads_alive():
            problems.append("storage threads alive while detached")
        if self.link.backend is not None:
            problems.append("a backend is open while detached")
        moving = [op.request_id for op in self.runtime.active.values() if op.state in ("admitted", "querying", "transferring")]
        if moving:
            problems.append(f"prefetches {moving[:8]} in flight while detached")
        return problems

    def violations(self) -> list[str]:
        reg = self.link_machine.registry
        out = []
        for name in self.link_machine.spec.invariants:
            out += [f"{name}: {p}" for p in reg.invariants[name](self)]
        if self.ctx.check_candidates():  # O(N), like the eviction sets' check: for tests
            out += [f"backup_retries: {p}" for p in self.retries.violations(self.ctx.tree)]
        return out + self.runtime.violations()

    # ================================================================== lifecycle

    def reset(self) -> None:
        """The cache is dropping everything: end every storage transfer (as a detach does), forget all prefetches.

        A transfer still running after ``join_timeout`` (a backend call that
        has not returned) would later write into host slots the cache frees
        now, or store what they hold next under this transfer's keys. The
        reset is refused then (``StorageLinkError``): prefetches are aborted
        and queued backups failed, as ``wind_down`` does, and the cached KV
        is kept; call ``reset`` again once the backend answers.
        """
        self._confine()
        self.wind_down("the cache is resetting")
        if self.ctx.outbox.count(STORAGE_KINDS):
            raise StorageLinkError(f"cannot reset the cache: a storage transfer still runs after "
                                   f"{self.options.join_timeout:g}s (join_timeout); nothing was dropped, "
                                   f"reset again once the backend answers")
        with self._cv:  # wind_down emptied the queues: what a thread still posts is stale from here
            self._gen += 1
            self._cv.notify_all()
        for op in self.runtime.ops():
            op.mark_terminated()
        self._wait_idle(self.options.join_timeout)
        self._events.clear()
        self._completions.clear()
        self.runtime.clear()
        if self.agreement is not None:
            self.agreement.reset()
        with self._cv:  # the threads' verdict on the link: its event may have been one of those dropped
            down = self._link_down
        if self.agreement is None:
            self.set_health(not down, down)
        else:
            self.agreement.local_health = (not down, down)
        self._sweep_due = False  # the retries forget their nodes when the tree is cleared (a residency listener)

    def close(self, drain: float = 0.0) -> None:
        """Engine shutdown: let queued backups finish for up to ``drain`` seconds, then abort
        prefetches, fail what is still queued, stop the threads and close the backend.

        A bad ``drain`` is refused (``ConfigError``) before anything changes. Once
        past that, the threads are stopped and the backend closed whatever fails
        on the way (the failure is logged), so a closed tier never leaks either:
        a thread still inside a backend call after ``join_timeout`` (a server
        that stopped answering) closes the backend itself when the call returns,
        instead of ``close`` waiting on that call.
        """
        drain = drain_seconds(drain)
        if self.closed:
            return
        self._confine()
        rt = self.runtime
        try:
            if drain > 0 and self.link.state == "attached":
                if not self.drain(drain):
                    log.warning("storage close: backups still queued after draining %.1fs; failing them", drain)
            self._drain()
            for rid in list(rt.active):
                self.abort_prefetch(rid)
            self._fail_queued("storage closed")
            self._wait_idle(self.options.join_timeout)
            self._apply_finished()
            if self.link.state in ("attached", "detaching"):
                self.detach()
        except Exception as exc:  # noqa: BLE001 - closing goes on: stop the threads, close the backend
            log.error("closing the storage tier: %s", exc)
        finally:
            link = self.link
            if link.backend is not None or link.threads_alive():
                link.signal_stop()
                link.join(0.0 if link.state == "detaching" else None)  # a refused detach has waited already
                link.close_late()  # a thread still in a backend call closes it as it leaves
            self.closed = True

    def when_threads_stopped(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once none of this tier's threads runs: at once, unless one outlived ``close``'s join
        (a backend call that has not returned), which may still touch the host pool."""
        self.link.when_stopped(fn)

    # ================================================================== forks and observation (the explorer)

    def fork(self, ctx: TierContext, memo: dict) -> "StorageTier":
        """A copy of this tier for the cache of ``ctx``, a fork of ours whose nodes are in ``memo`` (``id(node)`` -> copy).

        Only a tier whose threads never started (``ManualStorageTier``) over a
        backend that can be forked (private ``memory://``, maybe behind a
        ``FaultyBackend``) can be copied. The copy listens to the fork's driver
        and registers nothing else: the caller re-binds host owners and invariants.
        """
        if self.link.threads:
            raise NotImplementedError("cannot fork a storage tier whose threads run")
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        memo[id(self)] = new
        new.ctx = ctx
        new.host_pool = ctx.host_pool
        new._cv = threading.Condition()
        new.link = self.link.fork(waker(new._cv), memo)
        weakref.finalize(new, new.link.abandon).atexit = False

        def op_of(op: PrefetchOp) -> PrefetchOp:
            if id(op) not in memo:
                memo[id(op)] = op.fork(memo.get(id(op.anchor), op.anchor))
            return memo[id(op)]

        def item(x: tuple) -> tuple:
            return tuple(op_of(v) if isinstance(v, PrefetchOp) else v for v in x)

        new.runtime = self.runtime.fork(ctx, new._submit_transfer, new._store_again, op_of)
        new._query_q = deque(item(x) for x in self._query_q)
        new._transfer_q = deque(item(x) for x in self._transfer_q)
        new._backup_q = deque(self._backup_q)
        new._events = deque(item(x) for x in self._events)
        new._completions = list(self._completions)
        new._pending_transfer = {k: op_of(op) for k, op in self._pending_transfer.items()}
        new._recent_chains = deque(self._recent_chains, maxlen=self._recent_chains.maxlen)
        new.retries = self.retries.fork(lambda n: memo[id(n)])
        new.counters = Counter(self.counters)
        with self._cv:
            new._thread_counts = Counter(self._thread_counts)
            new._foreign_keys = OrderedDict(self._foreign_keys)
        ctx.driver.add_listener(new.retries)
        new.evictions = self.evictions.fork(new.keys_for, new.link.backend, lambda n: memo[id(n)])
        ctx.driver.add_listener(new.evictions)
        return new

    @property
    def sweep_due(self) -> bool:
        """Whether the next ``poll`` (once ``retry_interval`` passed) looks for backups to retry."""
        return self._sweep_due

    def unapplied(self) -> tuple[int, int]:
        """(thread events not drained yet, completions not handed to the cache yet)."""
        return len(self._events), len(self._completions)

    def _check_open(self) -> None:
        """Refuse a call on a closed tier, or from a thread that does not drive the cache (``WrongThread``)."""
        if self.closed:
            raise HiCacheError("this storage tier is closed")
        self.ctx.check_open()

    def _confine(self) -> None:
        """Refuse a call from a thread that does not drive the cache: the tier is confined with it."""
        self.ctx.check_open()


def drain_seconds(drain: object, name: str = "close(drain=...)") -> float:
    """Seconds to drain backups, checked before anything changes: a finite number >= 0, else ``ConfigError``."""
    return check_seconds(name, drain, zero_ok=True)


def attach_storage(cache: TierHost, url_or_backend: str | StorageBackend, **options: Any) -> StorageTier:
    """Create ``cache.storage`` on first use and attach ``url_or_backend`` (HiCache.attach_storage).

    With a rank group, the ranks first agree that every one of them is attaching
    (a collective of its own): a rank that attaches alone gets StorageLinkError
    (and the others, in another collective, RanksDiverged) before anything changes.
    """
    if not cache.group.solo:
        try:
            cache.group.all_true(True, PURPOSE_ATTACH)
        except GroupError as exc:
            raise StorageLinkError(f"attaching storage needs every rank of the group to attach: {exc}") from exc
    if cache.storage is None:
        cache.storage = StorageTier(TierContext.of(cache))
    cache.storage.attach(url_or_backend, **options)
    return cache.storage


__all__ = ["StorageTier", "attach_storage", "drain_seconds", "namespace_seed"]
