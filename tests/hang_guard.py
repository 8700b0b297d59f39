"""Run a call that must be refused in a daemon thread, so a regression that hangs fails instead of stalling the suite."""

from __future__ import annotations

import threading
from collections.abc import Callable

HANG_GUARD_S = 60  # not a speed assertion: only stops a regression from hanging the suite


def raised_by(fn: Callable[..., object], *args: object) -> BaseException:
    """The exception ``fn(*args)`` raised in a guarded thread; fails the test if it returned or never finished."""
    outcome: list[BaseException | None] = []

    def target() -> None:
        try:
            fn(*args)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            outcome.append(exc)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(HANG_GUARD_S)
    assert outcome, f"still running after {HANG_GUARD_S} s"
    assert outcome[0] is not None, "accepted"
    return outcome[0]
