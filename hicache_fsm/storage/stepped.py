"""A storage tier without threads: its queued work runs when the caller says, on a clock the caller moves.

``SteppedStorageTier`` is a ``StorageTier`` that starts no threads at attach
(the ``start_workers`` seam). What the query and I/O threads would pick up
stays queued (``queued_work()``: prefetch hit queries, S2H transfers, H2S
backups) until the caller runs it (``run_queued(kind, index)``, or
``run_all()`` for everything queued), on its own thread; the cache learns the
outcome at its next ``poll`` exactly as it learns a thread's. Prefetch
timeouts read ``seconds``, which only ``advance`` moves, never the wall
clock. Everything else (admission, the prefetch machine, backups, retries) is
the production code.

Trace replay uses it to run storage on a simulated clock (nothing waits on
wall time), and ``hicache_fsm.testing.storage.ManualStorageTier`` builds its
step-by-step exploration on it.

    tier = SteppedStorageTier.attach_to(cache, "memory://", prefetch_threshold=cache.page_size)
    cache.prefetch("r1", tokens, cache.match_prefix(tokens))
    tier.run_all(); cache.poll()          # the hit query ran -> the S2H transfer is queued
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from hicache_fsm.interfaces import TierContext
from hicache_fsm.storage.tier import StorageTier

if TYPE_CHECKING:  # pragma: no cover
    from hicache_fsm.interfaces import TierHost

__all__ = ["WORK_KINDS", "SteppedStorageTier"]

WORK_KINDS = ("query", "s2h", "h2s")  # the order run_all runs queued work in


class SteppedStorageTier(StorageTier):
    """``StorageTier`` whose queued work runs only when the caller says (see the module docstring)."""

    @classmethod
    def attach_to(cls, cache: TierHost, url_or_backend: Any, **options: Any) -> SteppedStorageTier:
        """Install a tier of this class as ``cache.storage`` (replacing none) and attach ``url_or_backend``."""
        if cache.storage is not None and not isinstance(cache.storage, cls):
            raise ValueError("the cache already has a threaded storage tier")
        if cache.storage is None:
            cache.storage = cls(TierContext.of(cache))
        cache.storage.attach(url_or_backend, **options)
        return cache.storage

    def start_workers(self) -> None:
        self.link.stop_event = threading.Event()  # what the threads would get: a fresh one per attach
        self.use_manual_clock()

    def use_manual_clock(self) -> None:
        """Prefetch timeouts read ``seconds`` (moved by ``advance`` only), never the wall clock."""
        if not hasattr(self, "seconds"):
            self.seconds = 0.0
        self.runtime.clock = self.manual_now

    def manual_now(self) -> float:
        return self.seconds

    def advance(self, seconds: float) -> None:
        """Time passes for the prefetch timeouts (``stop_policy: timeout``)."""
        self.seconds += seconds

    def run_all(self) -> int:
        """Run every item queued now (queries, then transfers, then backups), oldest first; how many ran.

        Work that these runs queue in turn (a query's transfer) waits for the
        cache's next ``poll`` and the next ``run_all``.
        """
        work = self.queued_work()
        ran = 0
        for kind in WORK_KINDS:
            for _ in work[kind]:
                self.run_queued(kind, 0)
                ran += 1
        return ran
