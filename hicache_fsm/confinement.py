"""Thread confinement: a cache is driven by one thread at a time.

The first thread that calls a cache adopts it and stays its owner until it
ends or releases it; a call from any other thread raises ``WrongThread`` and
changes nothing. The owner's ident is a plain attribute, so the check on the
hot path is one integer comparison; adopting takes a lock.
"""

from __future__ import annotations

import threading
import weakref

from hicache_fsm.errors import WrongThread

_ADOPT = threading.Lock()  # taken only when a thread that does not own a cache calls it


class ThreadOwner:
    """Which thread drives a cache; ``ident`` is None until one adopts it."""

    __slots__ = ("ident", "thread")

    def __init__(self) -> None:
        self.ident: int | None = None
        self.thread: weakref.ref | None = None

    def adopt(self) -> None:
        """The calling thread adopts the cache if nobody (alive) owns it, else ``WrongThread``."""
        with _ADOPT:
            owner = self.thread() if self.thread is not None else None
            if owner is None or not owner.is_alive():  # no owner, or it ended: this thread adopts the cache
                self.thread = weakref.ref(threading.current_thread())
                self.ident = threading.get_ident()
                return
        raise WrongThread(
            f"this cache belongs to thread {owner.name!r}; call it from that thread only, or have that thread "
            f"call release_thread() first (called from {threading.current_thread().name!r}; nothing changed)"
        )

    def release(self) -> None:
        """The next thread that calls adopts the cache."""
        with _ADOPT:
            self.ident = None
            self.thread = None


__all__ = ["ThreadOwner"]
