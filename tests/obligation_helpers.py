"""Shared by the tests of the protocol adapter's obligations (``hicache_fsm.testing.obligations``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hicache_fsm.testing.mutants import mutant
from hicache_fsm.testing.protocol import ProtocolAdapter

Steps = Callable[[Any], Any] | Sequence[Callable[[Any], Any]]


def flagged_only_when_planted(steps: Steps, bugs: tuple[str, ...], check: str, **adapter: Any) -> None:
    """``steps`` (one callable, or several with the checks run after each, as the explorer runs them after
    each step) drive a fresh ``ProtocolAdapter(**adapter)``: on the real cache the checks report nothing; with
    each of ``bugs`` planted they report ``check``."""
    each = list(steps) if isinstance(steps, Sequence) else [steps]

    def problems() -> list[str]:
        a = ProtocolAdapter(**adapter)
        found: list[str] = []
        try:
            for step in each:
                step(a)
                found += a.kv_violations() + a.invariant_violations()
            return found
        finally:
            a.close()

    assert problems() == []
    for bug in bugs:
        with mutant(bug):
            assert any(p.startswith(f"{check}:") for p in problems()), bug


def backed_up(a: Any, *prompts: tuple[int, ...]) -> None:
    """Insert ``prompts`` and complete every pending job (their host backups land)."""
    for prompt in prompts:
        a.insert(prompt)
    for job in a.pending_jobs():
        a.complete_job(job.id)
