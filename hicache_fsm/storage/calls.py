"""The storage tier's engine-facing calls on the facade: thin delegations to ``cache.storage``.

``HiCache`` inherits these; each checks the cache is open and driven by the
calling thread, then hands the call to the ``StorageTier`` (see
docs/storage.md), or answers for a cache without one.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from hicache_fsm.outbox import STORAGE_KINDS
from hicache_fsm.storage.tier import StorageTier, attach_storage, drain_seconds


class StorageCalls:
    """``attach_storage`` ... ``abort_prefetch``: what an engine calls for L3 (mixed into ``HiCache``)."""

    storage: StorageTier | None
    outbox: Any
    check_open: Callable[[], None]  # the facade's: refuses a closed cache or a foreign thread

    def attach_storage(self, url_or_backend, **options) -> None:
        """Attach an L3 backend at run time (URL or open backend); rolls back fully and raises StorageLinkError on failure."""
        self.check_open()
        attach_storage(self, url_or_backend, **options)

    def detach_storage(self) -> None:
        """Detach the backend; a no-op when detached; StorageLinkError while storage transfers are in flight."""
        self.check_open()
        if self.storage is not None:
            self.storage.detach()

    def prefetch(self, request_id: Hashable, tokens: Sequence[int], match: Any, namespace: Hashable = None) -> bool:
        """Start fetching the tokens after ``match``'s in-memory hit from storage into host memory; False if not admitted."""
        self.check_open()
        return self.storage is not None and self.storage.prefetch(request_id, tokens, match, namespace)

    def prefetch_ready(self, request_id: Hashable) -> bool:
        """Per-step check: True once the request may proceed (fetched pages inserted, the rest released)."""
        self.check_open()
        return self.storage is None or self.storage.prefetch_ready(request_id)

    def abort_prefetch(self, request_id: Hashable) -> bool:
        """End an aborted request's prefetch and release everything it holds; False if it had none."""
        self.check_open()
        return self.storage is not None and self.storage.abort_prefetch(request_id)

    def storage_transfers_in_flight(self) -> int:
        if self.storage is None:
            return self.outbox.count(STORAGE_KINDS)
        return self.storage.transfers_in_flight()


__all__ = ["StorageCalls", "drain_seconds"]
