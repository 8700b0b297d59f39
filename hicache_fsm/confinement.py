"""Thread confinement: a cache is driven by one thread at a time.

The first thread that calls a cache adopts it and stays its owner until it
ends or releases it; a call from any other thread raises ``WrongThread`` and
changes nothing. A thread that adopts a cache gets a token of its own, kept in
thread-local storage (``THIS_THREAD``), and the check on the hot path compares
it with the owner's: one attribute read and one comparison; adopting takes a
lock. A token, unlike a thread ident, is never handed to a later thread: the
ident of a thread that ended is soon reused, and a thread that inherited its
owner's ident passed the check without adopting the cache, so a third thread
could then adopt it while that one still drove it.
"""

from __future__ import annotations

import itertools
import threading
import weakref

from hicache_fsm.errors import WrongThread

_ADOPT = threading.Lock()  # taken only when a thread that does not own a cache calls it
_TOKENS = itertools.count(1)  # 0: no owner, which no thread's token equals


class ThisThread(threading.local):
    """The calling thread's token: None until it first adopts a cache, then its own for as long as it runs."""

    token: int | None = None


THIS_THREAD = ThisThread()


class ThreadOwner:
    """Which thread drives a cache; ``token`` is 0 until one adopts it (compare ``THIS_THREAD.token``)."""

    __slots__ = ("token", "thread")

    def __init__(self) -> None:
        self.token = 0
        self.thread: weakref.ref | None = None

    def adopt(self) -> None:
        """The calling thread adopts the cache if nobody (alive) owns it, else ``WrongThread``."""
        with _ADOPT:
            owner = self.thread() if self.thread is not None else None
            if owner is None or not owner.is_alive():  # no owner, or it ended: this thread adopts the cache
                token = THIS_THREAD.token
                if token is None:
                    token = THIS_THREAD.token = next(_TOKENS)
                self.thread = weakref.ref(threading.current_thread())
                self.token = token
                return
        raise WrongThread(
            f"this cache belongs to thread {owner.name!r}; call it from that thread only, or have that thread "
            f"call release_thread() first (called from {threading.current_thread().name!r}; nothing changed)"
        )

    def release(self) -> None:
        """The next thread that calls adopts the cache."""
        with _ADOPT:
            self.token = 0
            self.thread = None


__all__ = ["THIS_THREAD", "ThisThread", "ThreadOwner"]
