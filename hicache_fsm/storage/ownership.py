"""Who completes a job: each transfer job's completion has exactly one owner.

The storage tier runs h2s (backup) and s2h (prefetch) jobs on its own threads
and alone reports their end; the engine's executor runs every other kind. A
completion from anyone else (say an engine acking a backup whose I/O thread is
still reading the host pages) is refused before anything changes: accepting it
would let the host copy be evicted and reused while the backup still reads it,
storing another prompt's KV under this prompt's keys.
"""

from __future__ import annotations

from hicache_fsm.errors import JobOwnerError
from hicache_fsm.jobs import TransferJob
from hicache_fsm.outbox import STORAGE_KINDS

__all__ = ["check_completion_owner"]


def check_completion_owner(job: TransferJob | None, owner: object, storage: object) -> None:
    """Raise JobOwnerError unless ``owner`` runs ``job``: ``storage`` for storage kinds, the engine (None) otherwise.

    ``job`` None (no longer pending) is left to the pending-job check.
    """
    if job is None:
        return
    if job.kind in STORAGE_KINDS:
        if owner is None or owner is not storage:
            raise JobOwnerError(
                f"job {job.id} ({job.kind.value}) is run by the storage tier; only it completes or fails it")
    elif owner is not None:
        raise JobOwnerError(f"job {job.id} ({job.kind.value}) is completed by the engine's executor, not {owner!r}")
