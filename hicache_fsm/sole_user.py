"""One user at a time for a resource two users would corrupt: a pool's slots, an executor, a storage backend.

Two open caches over one allocator each free the other's slots (``reset``)
and hand them out again; two caches over one executor each take completions
the other is waiting for; two storage tiers over one backend object each close
it when they detach, under the other. The resource keeps a weak reference to
its user, so a user dropped without closing frees it too.
"""

from __future__ import annotations

import threading
import weakref

from hicache_fsm.errors import HiCacheError


class SoleUser:
    """Who uses a resource now: ``take`` refuses a second user until the first ``give_up``."""

    __slots__ = ("_user", "_lock", "_used")

    def __init__(self) -> None:
        self._user: weakref.ref | None = None
        self._lock = threading.Lock()  # two caches built at once on two threads: one of them is refused
        self._used = False  # some user has taken it (what it left behind is stale for the next)

    def __deepcopy__(self, memo: dict) -> "SoleUser":
        """A copied resource (the explorer forks caches) is another resource: nobody uses it yet."""
        return SoleUser()

    def take(self, user: object, refusal: HiCacheError) -> bool:
        """Make ``user`` the resource's user; raise ``refusal`` while another is (taking it again is fine).

        True when the resource passes from an earlier user (given up, or dropped) to ``user``.
        """
        with self._lock:
            current = self._user() if self._user is not None else None
            if current is not None and current is not user:
                raise refusal
            handed_over = self._used and current is None
            self._user = weakref.ref(user)
            self._used = True
            return handed_over

    def give_up(self, user: object) -> None:
        """``user`` is done with the resource; another user's hold is left as it is."""
        with self._lock:
            if self._user is not None and self._user() is user:
                self._user = None


__all__ = ["SoleUser"]
