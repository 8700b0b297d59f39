"""What the storage tier's threads run: the work queues, the query and I/O loops, health probes.

Seam. Everything here runs on a storage thread (or, for deterministic tests,
on the caller's through ``run_queued`` / ``probe_now``) and touches only what
a thread may: the queues and counters under the condition ``_cv``, the
backend, host pages the residency machine keeps pinned or a prefetch
reserved. It never changes the tree, an allocator or a machine state; it
posts events (``_post``) that the scheduler's thread drains in
``StorageTier.poll``. ``StorageTier`` (:mod:`hicache_fsm.storage.tier`) keeps
the bookkeeping on the scheduler's side and inherits this class.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import weakref
from collections import Counter, OrderedDict, deque
from typing import Any, Callable

from hicache_fsm.errors import StorageError, StorageFull, StorageKeyError
from hicache_fsm.jobs import TransferJob
from hicache_fsm.storage.base import StorageBackend
from hicache_fsm.storage.link import StorageLink
from hicache_fsm.storage.options import TierOptions
from hicache_fsm.storage.prefetch import PrefetchOp, page_ids

log = logging.getLogger("hicache_fsm.storage.tier")

PROBE_KEY = "0" * 64  # a key no page has: asking for it checks the backend answers, end to end
FOREIGN_KEYS_KEPT = 1 << 16  # page keys remembered as stored in another page format (oldest forgotten first)


class StorageThreads:
    """The thread side of ``StorageTier``: queues of work for the query and I/O threads, and what they run."""

    page_size: int
    options: TierOptions
    link: StorageLink
    host_pool: Any  # the pool pages are read from (backups) and written into (prefetches)
    _cv: threading.Condition
    _query_q: deque[tuple[int, PrefetchOp]]
    _transfer_q: deque[tuple[int, TransferJob, PrefetchOp]]
    _backup_q: deque[tuple[int, TransferJob]]
    _events: deque[tuple]
    _busy: int
    _gen: int
    _winding_down: threading.Event  # set while a detach or reset winds transfers down: a running backup ends
    _link_down: str
    _last_probe: float
    _epoch_read_at: float = float("-inf")  # when the I/O thread last read the data epoch (``_read_epoch``)
    _thread_counts: Counter[str]
    _foreign_keys: OrderedDict[str, None]  # page keys stored in another page format (under _cv), until the next attach
    _confine: Callable[[], None]  # the scheduler's calls here refuse a thread that does not drive the cache

    def start_workers(self) -> None:
        """Start the query and I/O threads over the attached backend.

        The one seam for deterministic tests: a subclass may start nothing and run the
        queued work itself (``queued_work``, ``run_queued``, ``probe_now``: one item at a
        time, in any order; see ``hicache_fsm.testing.storage.ManualStorageTier``).
        """
        tier = weakref.ref(self)  # held weakly: see ``_serve``
        io_queues = (self._transfer_q, self._backup_q)
        self.link.start_threads({"query": functools.partial(_serve, tier, self._cv, (self._query_q,), False),
                                 "io": functools.partial(_serve, tier, self._cv, io_queues, True)})

    def run_queued(self, kind: str, index: int) -> None:
        """Run the ``index``-th item of ``queued_work()[kind]`` now, on this thread, as a storage thread would.

        ``kind`` is ``query``, ``s2h`` or ``h2s``; ``KeyError`` (nothing changed)
        for an unknown kind, a missing item or no backend. The outcome reaches
        the cache at its next ``poll``, as a thread's does.
        """
        self._confine()
        runners = {"query": (self._query_q, self._run_query), "s2h": (self._transfer_q, self._run_transfer),
                   "h2s": (self._backup_q, self._run_backup)}
        if kind not in runners:
            raise KeyError(kind)
        queue, runner = runners[kind]
        backend = self.link.backend
        with self._cv:
            if backend is None or not 0 <= index < len(queue):
                raise KeyError(f"{kind}[{index}]")
            item = queue[index]
            del queue[index]
            self._busy += 1
        try:
            runner(self.link.stop_event, backend, *item)
        finally:
            self._done()

    def probe_now(self) -> None:
        """Probe the backend's health now, on this thread (not rate-limited); ``KeyError`` without a backend."""
        self._confine()
        backend = self.link.backend
        if backend is None:
            raise KeyError("probe: no backend attached")
        self._last_probe = float("-inf")
        self._probe(backend)

    def _done(self) -> None:
        with self._cv:
            self._busy -= 1
            self._cv.notify_all()

    def _post(self, *event: object) -> None:
        self._events.append(event)

    def _mark_link(self, error: str) -> None:
        """Storage threads' verdict on the link ("" = up); the scheduler hears it as a health event.

        The verdict and its event change together under ``_cv``, so two
        threads' verdicts reach the scheduler in the order they were made
        (posted apart, the last event could contradict the last verdict: a
        tier left unhealthy with threads that saw no reason to probe). The
        event carries the generation current then, not the one of the work
        that gave the verdict: a verdict on the link holds across a
        ``reset`` (a probe that began before it and answered after it was
        dropped as stale, and no probe came again).
        """
        with self._cv:
            self._link_down = error
            self._post(self._gen, "health", not error, error)

    def _down(self) -> str:
        """Why the link is down ("" when up); a queued job then fails at once instead of timing out."""
        with self._cv:
            if self._link_down:
                self._thread_counts["jobs_failed_fast"] += 1
            return self._link_down

    def _failed(self, exc: BaseException) -> str:
        text = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, (StorageFull, StorageKeyError)):
            # reachable, but refusing writes (full) or a bad request: failed backups back off per node
            log.warning("storage I/O failed: %s", text)
        elif isinstance(exc, StorageError):
            self._mark_link(text)
        else:
            log.error("storage thread: unexpected error", exc_info=exc)
        with self._cv:
            self._thread_counts["storage_errors"] += 1
        return text

    def _run_item(self, io: bool, stop: threading.Event, backend: StorageBackend, item: tuple) -> None:
        """Run an item a storage thread took: a query, or on the I/O thread a prefetch read or a backup."""
        if not io:
            self._run_taken("query", self._run_query, stop, backend, item)
        else:  # a prefetch read (gen, job, op) or a backup (gen, job)
            runner = self._run_transfer if len(item) == 3 else self._run_backup
            self._run_taken("I/O", runner, stop, backend, item)

    def _run_taken(self, thread: str, runner: Callable[..., None], stop: threading.Event, backend: StorageBackend,
                   item: tuple) -> None:
        """Run a taken item on a storage thread: an unexpected error is logged (the thread lives on), then _done."""
        try:
            runner(stop, backend, *item)
        except BaseException as exc:
            log.error("storage %s thread: unexpected error", thread, exc_info=exc)
        finally:
            self._done()

    def _run_query(self, stop: threading.Event, backend: StorageBackend, gen: int, op: PrefetchOp) -> None:
        if op.terminated or gen != self._gen:
            return
        self._post(gen, "query_start", op)
        down = self._down()
        if down:
            self._post(gen, "query_failed", op, f"storage unavailable: {down}")
            return
        step = self.options.batch_pages
        hits: list[str] = []
        try:
            for start in range(0, len(op.keys), step):
                if stop.is_set() or op.terminated:
                    self._post(gen, "query_failed", op, "cancelled")
                    return
                keys = list(op.keys[start: start + step])
                n = self._readable(keys, leading_hits(backend.batch_exists(keys), len(keys)))
                hits.extend(keys[:n])
                if n < len(keys):
                    break
        except Exception as exc:  # noqa: BLE001 - reported as a failed query
            self._post(gen, "query_failed", op, self._failed(exc))
            return
        self._mark_link("")
        self._post(gen, "query_done", op, tuple(hits))

    def _probe(self, backend: StorageBackend) -> None:
        now = time.monotonic()
        if now - self._last_probe < self.options.probe_interval:
            return
        self._last_probe = now
        with self._cv:
            self._thread_counts["health_probes"] += 1
        try:
            backend.batch_exists([PROBE_KEY])
        except Exception as exc:  # noqa: BLE001 - still down
            self._mark_link(f"{type(exc).__name__}: {exc}")
            return
        self._mark_link("")

    def _read_epoch(self, backend: StorageBackend) -> None:
        """Every ``retry_interval`` while the link is up: read the backend's data epoch for the scheduler.

        On this thread, never the scheduler's: the read is a round trip to a
        server that may have stopped answering (the scheduler would wait out
        its socket timeout in ``poll``). A failed read is a failed call: a
        ``StorageError`` takes the link down, as a failed backup does.
        """
        read = getattr(backend, "data_epoch", None)  # a duck-typed backend may not have one
        now = time.monotonic()
        if not callable(read) or now - self._epoch_read_at < self.options.retry_interval:
            return
        self._epoch_read_at = now
        try:
            epoch = read()
        except StorageError as exc:  # the store did not answer: as any failed storage call
            self._failed(exc)
            return
        except Exception as exc:  # noqa: BLE001 - a backend of our protocol's shape, whose epoch tells nothing
            log.debug("storage data epoch unavailable: %s", exc)
            return
        with self._cv:
            self._post(self._gen, "epoch", epoch)

    def _run_transfer(self, stop: threading.Event, backend: StorageBackend, gen: int, job: TransferJob,
                      op: PrefetchOp) -> None:
        ps = self.page_size
        keys = job.keys
        pages = page_ids(job.host_indices, ps)
        pool = self.host_pool
        step = self.options.batch_pages
        ok, error = True, ""
        down = self._down()
        if down:  # fail fast: end the transfer as partial with nothing landed
            self._post(gen, "batch", op, 0, True, f"storage unavailable: {down}")
            self._post(gen, "done", job, False, f"storage unavailable: {down}", op)
            return
        for start in range(0, len(keys), step):
            if stop.is_set() or op.terminated or gen != self._gen:
                ok, error = False, "prefetch ended" if op.terminated else "storage threads stopping"
                if not op.terminated:  # end the transfer as partial, so no stop policy waits forever
                    self._post(gen, "batch", op, 0, True, error)
                break
            batch_keys = list(keys[start: start + step])
            batch_pages = pages[start: start + step]
            got, error = 0, ""
            mismatches = _format_mismatches(backend)
            try:
                if hasattr(backend, "batch_get_into"):
                    results = one_per_page(backend.batch_get_into(batch_keys, pool, batch_pages), len(batch_keys),
                                           "batch_get_into")
                else:  # a duck-typed backend without the zero-copy call
                    results = []
                    for data, page in zip(backend.batch_get(batch_keys), batch_pages):
                        if data is None:
                            results.append(False)
                            break
                        pool.write_page(page, data)
                        results.append(True)
                for r in results:
                    if not r:
                        break
                    got += 1
                if got == len(batch_keys):
                    self._mark_link("")
            except Exception as exc:  # noqa: BLE001 - the batch failed: keep what arrived before it
                error = self._failed(exc)
            short = got < len(batch_keys)
            if short and not error:
                if _format_mismatches(backend) > mismatches:  # stored in a page format this pool cannot read
                    self._mark_foreign(batch_keys[got])
                    error = f"page {start + got} stored in another page format"
                else:
                    error = f"page {start + got} missing or corrupt"
            accepted = op.add_landed(got * ps)
            self._post(gen, "batch", op, got * ps, short, error)
            if short or not accepted:
                ok = False
                break
        self._post(gen, "done", job, ok, error, op)

    def _run_backup(self, stop: threading.Event, backend: StorageBackend, gen: int, job: TransferJob) -> None:
        if gen != self._gen:
            return
        ps = self.page_size
        pages = page_ids(job.host_indices, ps)
        keys = job.keys
        step = self.options.batch_pages
        ok, error = True, ""
        down = self._down()
        if down:
            self._post(gen, "done", job, False, f"storage unavailable: {down}", None)
            return
        for start in range(0, len(keys), step):
            if stop.is_set() or self._winding_down.is_set():  # a detach or reset waits for this backup: it ends here
                ok, error = False, "storage is detaching"
                break
            try:
                batch_keys = list(keys[start: start + step])
                stored = one_per_page(backend.batch_set_from(batch_keys, self.host_pool, pages[start: start + step]),
                                      len(batch_keys), "batch_set_from")
            except Exception as exc:  # noqa: BLE001 - the backup failed; retried later
                ok, error = False, self._failed(exc)
                break
            if not all(stored):
                ok, error = False, f"storage refused {stored.count(False)} of {len(stored)} pages"
                break
        else:
            self._mark_link("")
        self._post(gen, "done", job, ok, error, None)

    def _readable(self, keys: list[str], found: int) -> int:
        """How many of the ``found`` leading keys can be read in this pool's page format (as far as is known)."""
        with self._cv:
            foreign = self._foreign_keys
            if foreign:
                for i in range(found):
                    if keys[i] in foreign:
                        return i
        return found

    def _mark_foreign(self, key: str) -> None:
        """Remember ``key`` as stored in another page format: hit queries stop before it until the next attach."""
        with self._cv:
            self._foreign_keys[key] = None
            while len(self._foreign_keys) > FOREIGN_KEYS_KEPT:
                self._foreign_keys.popitem(last=False)  # the oldest: O(1), unlike a plain dict's first key

    def _wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._busy:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    log.error("storage threads still busy after %.1fs", timeout)
                    return False
                self._cv.wait(remaining)
        return True

    def queued_work(self) -> dict[str, tuple]:
        """Work waiting for a storage thread, oldest first: ``query`` ops, ``s2h`` (job, op), ``h2s`` jobs."""
        with self._cv:
            return {"query": tuple(op for _, op in self._query_q),
                    "s2h": tuple((job, op) for _, job, op in self._transfer_q),
                    "h2s": tuple(job for _, job in self._backup_q)}


def waker(cv: threading.Condition) -> Callable[[], None]:
    """What wakes the storage threads waiting on ``cv``: a link holds it without holding the tier."""
    def wake() -> None:
        with cv:
            cv.notify_all()
    return wake


def _serve(tier: "weakref.ref[StorageThreads]", cv: threading.Condition, queues: tuple[deque, ...], io: bool,
           stop: threading.Event, backend: StorageBackend) -> None:
    """A storage thread's loop over ``queues``: run what is queued until ``stop``, or until the tier is gone.

    The thread holds its tier weakly and waits on the condition alone, so a
    cache dropped without ``close`` (and its host pool) is collected rather
    than kept alive by its own threads; the tier's finalizer then stops the
    link and closes its backend (``StorageLink.abandon``). The I/O thread probes a
    link that is down whenever its wait ends with nothing queued, and reads the
    data epoch of a link that is up between its items.
    """
    while not stop.is_set():
        threads = tier()
        if threads is None:
            return
        down = io and bool(threads._link_down)  # then queued jobs fail at once; probe only once none is left
        timeout = threads.options.probe_interval if down else 0.5
        threads = None  # not held while waiting
        threads, item = _take(tier, cv, queues, stop, timeout)
        if threads is None:
            continue
        if item is not None:
            threads._run_item(io, stop, backend, item)
        elif down and not stop.is_set():
            threads._probe(backend)
        if io and not stop.is_set() and not threads._link_down:
            threads._read_epoch(backend)
        threads = item = None  # nothing of the tier outlives the step in this frame


def _take(tier: "weakref.ref[StorageThreads]", cv: threading.Condition, queues: tuple[deque, ...],
          stop: threading.Event, timeout: float) -> tuple["StorageThreads | None", tuple | None]:
    """(tier, next item of the first non-empty queue), counted busy until ``_done``; (tier, None) on timeout.

    The tier is looked up under ``cv`` as the item leaves its queue, so an
    item is never out of its queue without counting as busy (what
    ``_wait_idle`` relies on). (None, None) on stop or once the tier is gone.
    """
    with cv:
        deadline = time.monotonic() + timeout
        while not stop.is_set():
            for q in queues:
                if q:
                    threads = tier()
                    if threads is None:
                        return None, None
                    threads._busy += 1
                    return threads, q.popleft()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return tier(), None
            cv.wait(remaining)
    return None, None


def one_per_page(results: object, asked: int, call: str) -> list:
    """A backend's answers to a batch call, checked to be one per page asked.

    A backend that answers for more or fewer pages than it was asked about
    cannot be trusted with any of them: an extra ``True`` would count a page
    that never landed, a short list of ``True`` a backup that stored part of
    its pages. ``StorageError`` (the batch failed) otherwise.
    """
    if not isinstance(results, list) or len(results) != asked:
        got = f"{len(results)} answers" if isinstance(results, list) else f"a {type(results).__name__}"
        raise StorageError(f"the backend's {call} gave {got} for {asked} pages")
    return results


def leading_hits(found: object, asked: int) -> int:
    """A backend's ``batch_exists`` answer, checked: an int from 0 to the keys asked (else ``StorageError``)."""
    if type(found) is not int or not 0 <= found <= asked:
        raise StorageError(f"the backend's batch_exists gave {found!r} for {asked} keys")
    return found


def _format_mismatches(backend: StorageBackend) -> int:
    """The backend's count of pages read as misses because they were stored in another page format."""
    try:
        return int(backend.stats().get("format_mismatch", 0))
    except Exception:  # noqa: BLE001 - a duck-typed backend without stats: mismatches are not told apart
        return 0


__all__ = ["FOREIGN_KEYS_KEPT", "PROBE_KEY", "StorageThreads", "waker"]
