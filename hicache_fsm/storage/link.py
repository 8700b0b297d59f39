"""The attachment of one storage backend: its handle and the threads that use it.

A ``StorageLink`` is the object the ``storage_link`` machine moves
(``detached -> attaching -> attached -> detaching -> detached``). It holds
what an attach opened, so the machine's effects can undo exactly that:
``rollback`` (attach failed), ``signal_stop`` (detach began) and
``close_backend`` (every thread exited). Each attach gets a fresh stop event:
a thread that outlived an earlier detach keeps seeing its own event set and
never touches the new backend.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable

from hicache_fsm.storage.base import StorageBackend

log = logging.getLogger("hicache_fsm.storage.tier")

THREAD_PREFIX = "hicache-storage"

_STARTED: "weakref.WeakSet[StorageLink]" = weakref.WeakSet()  # every link that started threads, while it lives
LATE_CLOSE_AT_EXIT = 120.0  # seconds the exit waits for a backend call that ``close`` left running (see ``close_late``)


@atexit.register
def _stop_at_exit() -> None:
    """Stop every link's threads and wait for them (``join_timeout`` at most, ``LATE_CLOSE_AT_EXIT`` for a call
    that ``close`` left running) before the interpreter finalizes.

    The threads are daemons so that a cache never closed cannot keep the
    process alive, but one still inside a torch or backend call while the
    interpreter finalizes aborts the process (``std::terminate``: SIGABRT):
    a backup running when a script ends without ``close``.
    """
    links = list(_STARTED)
    for link in links:
        link.signal_stop()
    if links:  # one deadline for all: a process with many hung backends waits the longest timeout once
        late = [link for link in links if link.closing_late and link.threads_alive()]
        if late:
            log.warning("waiting up to %.0fs for %d storage call(s) that close left running (a server that stopped "
                        "answering) before the interpreter exits", LATE_CLOSE_AT_EXIT, len(late))
        deadline = time.monotonic() + max(LATE_CLOSE_AT_EXIT if link in late else link.join_timeout for link in links)
        for link in links:
            link.join(max(0.0, deadline - time.monotonic()))


class StorageLink:
    """Backend handle, threads and stop event of one attachment (see module docstring)."""

    def __init__(self, wake: Callable[[], None], join_timeout: float = 10.0) -> None:
        self.state = "detached"
        self.backend = None
        self.threads: list[threading.Thread] = []
        self.stop_event = threading.Event()
        self.join_timeout = join_timeout
        self.closing_late = False  # ``close_late``: a thread inside a backend call closes the backend as it leaves
        self._wake = wake
        self.last_backend_stats: dict = {}
        self.closed_totals: Counter[str] = Counter()  # counters of every backend closed so far, summed
        self._totals = threading.Lock()  # a scrape (any thread) finds a closing backend's counts live or closed
        self._exits = threading.Lock()  # guards the two below: a thread leaves while the cache closes
        self._running = 0  # threads still in their loop (one past ``join`` may still touch the host pool)
        self._after_stop: list[Callable[[], None]] = []

    def totals(self) -> dict[str, float]:
        """Every backend counter summed over all backends this link attached, the open one included.

        A backend counts from 0, so its own counters restart after detach + attach;
        these never decrease (what Prometheus counters need), even for a backend
        attached, used and closed between two reads.
        """
        with self._totals:
            backend = self.backend
            live = backend.stats() if backend is not None else {}
            out = Counter(self.closed_totals)
        out.update({key: value for key, value in live.items() if is_count(value)})
        return dict(out)

    def fork(self, wake: Callable[[], None], memo: dict) -> "StorageLink":
        """A copy for a forked tier (no threads: only a link whose threads never started can be forked)."""
        if self.threads:
            raise NotImplementedError("cannot fork a storage link whose threads run")
        new = StorageLink(wake, self.join_timeout)
        new.state = self.state
        new.backend = None if self.backend is None else self.backend.fork(memo)
        if self.stop_event.is_set():
            new.stop_event.set()
        new.last_backend_stats = dict(self.last_backend_stats)
        new.closed_totals = Counter(self.closed_totals)
        return new

    # ------------------------------------------------------------------ used by attach

    def start_threads(self, targets: dict[str, Callable[[threading.Event, object], None]]) -> None:
        """Start one thread per target, each called as ``fn(stop_event, backend)``."""
        self.stop_event = threading.Event()
        _STARTED.add(self)
        for name, fn in targets.items():
            thread = threading.Thread(
                target=self._run, args=(fn, self.stop_event, self.backend), name=f"{THREAD_PREFIX}-{name}",
                daemon=True,
            )
            with self._exits:
                self._running += 1
            self.threads.append(thread)
            try:
                thread.start()
            except BaseException:
                self._left()
                raise

    def _run(self, fn: Callable[[threading.Event, object], None], stop: threading.Event, backend: object) -> None:
        try:
            fn(stop, backend)
        finally:
            self._left()

    def _left(self) -> None:
        """A thread left its loop; the last one out runs what waited for every thread to stop."""
        with self._exits:
            self._running -= 1
            callbacks, self._after_stop = (self._after_stop, []) if self._running == 0 else ([], self._after_stop)
        for fn in callbacks:
            try:
                fn()
            except Exception:  # noqa: BLE001 - a thread's exit must not fail on a callback
                log.exception("storage: a callback after the threads stopped failed")

    def when_stopped(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once no thread of this link runs: now, or when the last one that outlived ``join`` leaves.

        A thread still inside a backend call after ``join_timeout`` may yet
        write into the host pool (a prefetch) or read it (a backup): what
        frees that pool for another user waits for it.
        """
        with self._exits:
            if self._running:
                self._after_stop.append(fn)
                return
        fn()

    def close_late(self) -> None:
        """Close the backend now if no thread runs, else when the last one leaves its backend call.

        ``close`` does not wait on a call to a server that stopped answering;
        the interpreter's exit does (``LATE_CLOSE_AT_EXIT``): a native client
        torn down in the middle of a call aborts the process.
        """
        self.closing_late = self.threads_alive()
        self.when_stopped(self.close_backend)

    def join(self, timeout: float | None = None) -> bool:
        """Wait (bounded) for every thread to exit; True when none is alive."""
        wait = self.join_timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self.threads if t.is_alive()]
        if alive and wait > 0:
            log.error("storage threads still running after %.1fs: %s", wait, alive)
        return not alive

    # ------------------------------------------------------------------ machine effects / guards

    def threads_alive(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def signal_stop(self) -> None:
        self.stop_event.set()
        self._wake()

    def abandon(self) -> None:
        """Its tier was collected without ``close``: stop the threads, close the backend once the last one leaves."""
        self.signal_stop()
        self.when_stopped(self.close_backend)

    def rollback(self) -> None:
        """Undo a failed attach: stop the threads it started, close the backend it opened."""
        self.signal_stop()
        self.join()
        self.close_backend()

    def close_backend(self) -> None:
        with self._totals:  # the backend leaves and its counts join the closed totals in one step
            backend, self.backend = self.backend, None
            if backend is not None:
                try:
                    self.last_backend_stats = dict(backend.stats())
                    self.closed_totals.update({k: v for k, v in self.last_backend_stats.items() if is_count(v)})
                except Exception as exc:  # noqa: BLE001 - stats of a broken backend are not worth failing a close
                    log.debug("storage backend stats unavailable at close: %s", exc)
        self.threads = [t for t in self.threads if t.is_alive()]
        if backend is None:
            return
        try:
            backend.close()
        except Exception:
            log.exception("closing storage backend %r failed", backend)
        finally:
            if isinstance(backend, StorageBackend):
                backend.attached_to.give_up(self)


def is_count(value: object) -> bool:
    """A counter value (a number, not a flag)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


__all__ = ["THREAD_PREFIX", "StorageLink", "is_count"]
