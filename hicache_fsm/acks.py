"""Agreement on acknowledgements: a completion is applied only when every rank has it.

With more than one rank, the completions an executor (or the storage tier)
reports on this rank are held here instead of being applied. Each step the
pending jobs, in emission order (the same on every rank, because emission is
deterministic), are reduced with MIN over the group as one status each:
0 = not finished here, 1 = failed here, 2 = ok here. A job whose MIN is
non-zero has finished on every rank; it is applied as ok only if it was ok
everywhere (a page counts as stored only when every rank stored its shard),
and the agreed jobs are applied in emission order, so every rank fires the
same transitions in the same order. See ``hicache_fsm.tp``.

The ranks' pending jobs are also compared, as a digest of what each has alike
on every rank (``tp.job_identities``: under context parallelism, a CP runtime
attached, not its size).
"""

from __future__ import annotations

from typing import Iterable, Sequence

from hicache_fsm.interfaces import Attached, Jobs
from hicache_fsm.jobs import Completion, TransferJob
from hicache_fsm.tp import digest, job_identities

NOT_DONE, FAILED, OK = 0, 1, 2


class AckAgreement:
    """The ``acks`` section of a ``StepAgreement``: holds local completions until the group agrees.

    Built with the cache's outbox (``interfaces.Jobs``): which jobs are pending, in emission order; and
    the attached runtimes (whether a CP runtime makes job sizes differ by rank).
    """

    name = "acks"
    width = 1

    def __init__(self, outbox: Jobs, attached: Attached) -> None:
        self.outbox = outbox
        self.attached = attached
        self.arrived: dict[int, Completion] = {}  # pending job id -> this rank's completion
        self._window: list[TransferJob] = []
        self._agreed: list[Completion] = []

    def hold(self, completions: Iterable[Completion]) -> list[Completion]:
        """Keep completions of pending jobs for agreement; return the others (cancelled, unknown) to apply now."""
        is_pending = self.outbox.is_pending
        direct = []
        for c in completions:
            if isinstance(c, Completion) and is_pending(c.job_id) and c.job_id not in self.arrived:
                self.arrived[c.job_id] = c
            else:
                direct.append(c)
        return direct

    def collect(self) -> tuple[list[Sequence[int]], int]:
        jobs = self.outbox.pending_jobs()
        self._window = jobs
        arrived = self.arrived
        items = []
        for job in jobs:
            c = arrived.get(job.id)
            items.append((NOT_DONE if c is None else OK if c.ok else FAILED,))
        return items, digest(job_identities(jobs, self.attached.cp is not None))

    def apply(self, items: list[list[int]]) -> None:
        for job, (status,) in zip(self._window, items):
            if status == NOT_DONE:
                continue
            local = self.arrived.pop(job.id)  # MIN > 0: this rank has it too
            if status == OK or not local.ok:
                self._agreed.append(local)
            else:
                self._agreed.append(Completion(job.id, False, "failed on another rank"))
        self._window = []

    def take(self) -> list[Completion]:
        """The agreed completions of the last step, in emission order."""
        out, self._agreed = self._agreed, []
        return out

    def reset(self) -> None:
        self.arrived.clear()
        self._agreed.clear()
        self._window = []


__all__ = ["AckAgreement"]
