"""Transfer jobs: the only way KV data moves.

A state-machine transition never touches a tensor. It names the job kinds it
emits; the cache turns each into an immutable ``TransferJob`` (what to copy,
from which slots to which, for which nodes) and hands batches of them to an
executor. Executors report ``Completion`` records, which come back to the
machines as events through ``HiCache.poll()``. Keeping jobs plain data is what
lets tests complete or fail them one by one, in any order.
"""

from __future__ import annotations

import enum
import itertools
from typing import TYPE_CHECKING, Iterable, Protocol, Sequence

import attrs

if TYPE_CHECKING:
    import torch  # only ``merge_jobs`` needs torch at run time: importing jobs stays cheap


class JobKind(str, enum.Enum):
    """Direction of a transfer. Values are the names specs use in ``emits``."""

    D2H = "d2h"  # device -> host backup, all layers (or one layer for CP writes)
    H2D = "h2d"  # host -> device load, layer by layer
    H2S = "h2s"  # host -> storage backup
    S2H = "s2h"  # storage -> host prefetch


JOB_KIND_NAMES = frozenset(k.value for k in JobKind)

_job_ids = itertools.count(1)


def next_job_id() -> int:
    """Process-wide unique, increasing job id (ids are never reused)."""
    return next(_job_ids)


@attrs.frozen(slots=True, eq=False)
class TransferJob:
    """One node's (or one prefetch's) transfer, described, not performed.

    ``device_indices`` and ``host_indices`` are token-slot indices (int64, page
    aligned) of equal length, paired element by element. ``layer`` is None for
    an all-layer job, or the single layer of a per-layer (CP) write. ``keys``
    are storage keys, one per page, for storage jobs. ``draft`` marks a job on
    the draft model's pools.
    """

    kind: JobKind
    node_ids: tuple[int, ...]
    host_indices: torch.Tensor
    device_indices: torch.Tensor | None = None
    layer: int | None = None
    keys: tuple[str, ...] = ()
    draft: bool = False
    draft_host_indices: torch.Tensor | None = None
    id: int = attrs.field(factory=next_job_id)

    @property
    def num_tokens(self) -> int:
        return int(self.host_indices.numel())


@attrs.frozen(slots=True, eq=False)
class JobBatch:
    """Jobs of one kind (and layer) merged into one transfer for one step."""

    kind: JobKind
    jobs: tuple[TransferJob, ...]
    host_indices: torch.Tensor
    device_indices: torch.Tensor | None
    layer: int | None = None
    draft_host_indices: torch.Tensor | None = None

    @property
    def job_ids(self) -> tuple[int, ...]:
        return tuple(j.id for j in self.jobs)

    @property
    def num_tokens(self) -> int:
        return int(self.host_indices.numel())


def merge_jobs(jobs: Sequence[TransferJob]) -> list[JobBatch]:
    """Merge pending jobs into one batch per (kind, layer), keeping submit order."""
    import torch

    groups: dict[tuple[JobKind, int | None], list[TransferJob]] = {}
    for job in jobs:
        groups.setdefault((job.kind, job.layer), []).append(job)
    batches = []
    for (kind, layer), members in groups.items():
        host = torch.cat([j.host_indices for j in members]) if members else torch.empty(0, dtype=torch.int64)
        devs = [j.device_indices for j in members if j.device_indices is not None]
        device = torch.cat(devs) if len(devs) == len(members) else None
        drafts = [j.draft_host_indices for j in members if j.draft_host_indices is not None]
        draft = torch.cat(drafts) if drafts and len(drafts) == len(members) else None
        batches.append(JobBatch(kind, tuple(members), host, device, layer, draft))
    return batches


@attrs.frozen(slots=True)
class Completion:
    """An executor's report that a job finished (``ok``) or failed (with ``error``)."""

    job_id: int
    ok: bool = True
    error: str = ""


class LayerWait(Protocol):
    """Handle returned by a load: the forward pass calls ``wait(layer)`` before reading it."""

    def wait(self, layer: int) -> None: ...

    def done(self) -> bool: ...


class Executor(Protocol):
    """Runs job batches and reports completions; never decides anything."""

    def submit(self, batch: JobBatch) -> LayerWait:
        """Start the batch; return a per-layer wait handle (loads use it)."""

    def poll(self) -> list[Completion]:
        """Completions that are ready now, without blocking."""

    def synchronize(self) -> None:
        """Block until every submitted batch has finished."""

    def close(self) -> None:
        """Release streams and threads; further submits are errors."""


def completed_all(jobs: Iterable[TransferJob], ok: bool = True, error: str = "") -> list[Completion]:
    """Completions for every job of a batch (executors finish batches as a whole)."""
    return [Completion(j.id, ok, error) for j in jobs]
