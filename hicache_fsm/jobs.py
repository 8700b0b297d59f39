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

from hicache_fsm.records import slot_setters

if TYPE_CHECKING:
    import torch  # only expanding or joining indices needs torch at run time: importing jobs stays cheap


class JobKind(str, enum.Enum):
    """Direction of a transfer. Values are the names specs use in ``emits``."""

    D2H = "d2h"  # device -> host backup, all layers (or one layer for CP writes)
    H2D = "h2d"  # host -> device load, layer by layer
    H2S = "h2s"  # host -> storage backup
    S2H = "s2h"  # storage -> host prefetch


JOB_KIND_NAMES = frozenset(k.value for k in JobKind)

# The kinds as module names for the per-job code paths: on Python 3.11 a member read from its class
# (``JobKind.D2H``) goes through the enum's descriptor, about ten times the cost of a global.
D2H, H2D, H2S, S2H = JobKind.D2H, JobKind.H2D, JobKind.H2S, JobKind.S2H

_job_ids = itertools.count(1)


def next_job_id() -> int:
    """Process-wide unique, increasing job id (ids are never reused)."""
    return next(_job_ids)


class PageSlots:
    """Slot indices of whole pages of ``allocator``, kept as the page ids until a reader wants the tensor.

    ``pages`` are native int64 page ids as ``bytes`` (what a tree node keeps).
    A job built from a node carries these instead of index tensors: many
    executors (and every completion's byte count) never read the indices,
    and a batch of several jobs expands its joined pages once.
    """

    __slots__ = ("pages", "allocator")

    def __init__(self, pages: bytes, allocator: object) -> None:
        self.pages = pages
        self.allocator = allocator

    @property
    def num_tokens(self) -> int:
        return (len(self.pages) >> 3) * self.allocator.page_size

    def tensor(self) -> torch.Tensor:
        from hicache_fsm.radix import slot_tensor  # needs torch: importing jobs stays cheap

        return slot_tensor(self.pages, self.allocator)

    def __repr__(self) -> str:
        return f"PageSlots({len(self.pages) >> 3} pages)"


def _indices(holder: object, name: str) -> "torch.Tensor | None":
    """The index tensor in ``holder``'s slot ``name``, expanded (once, then kept) from ``PageSlots``."""
    value = object.__getattribute__(holder, name)
    if type(value) is PageSlots:
        value = value.tensor()
        object.__setattr__(holder, name, value)  # same indices, expanded: the record stays what it was
    return value


@attrs.frozen(slots=True, eq=False, init=False)
class TransferJob:
    """One node's (or one prefetch's) transfer, described, not performed.

    ``device_indices`` and ``host_indices`` are token-slot indices (int64, page
    aligned) of equal length, paired element by element; they may be given
    as ``PageSlots`` and are then expanded when first read. ``layer`` is None for
    an all-layer job, or the single layer of a per-layer (CP) write. ``keys``
    are storage keys, one per page, for storage jobs. ``draft`` marks a job on
    the draft model's pools. ``id`` None (the default) takes the next job id.
    """

    kind: JobKind
    node_ids: tuple[int, ...]
    _host: "torch.Tensor | PageSlots" = attrs.field(alias="host_indices")
    _device: "torch.Tensor | PageSlots | None" = attrs.field(default=None, alias="device_indices")
    layer: int | None = None
    keys: tuple[str, ...] = ()
    draft: bool = False
    _draft_host: "torch.Tensor | PageSlots | None" = attrs.field(default=None, alias="draft_host_indices")
    id: int = attrs.field(factory=next_job_id)

    def __init__(self, kind: JobKind, node_ids: tuple[int, ...], host_indices: "torch.Tensor | PageSlots",
                 device_indices: "torch.Tensor | PageSlots | None" = None, layer: int | None = None,
                 keys: tuple[str, ...] = (), draft: bool = False,
                 draft_host_indices: "torch.Tensor | PageSlots | None" = None, id: int | None = None) -> None:
        set_kind, set_nodes, set_host, set_device, set_layer, set_keys, set_draft, set_draft_host, set_id = \
            _TRANSFER_JOB_FIELDS  # the slots' setters (hicache_fsm.records)
        set_kind(self, kind)
        set_nodes(self, node_ids)
        set_host(self, host_indices)
        set_device(self, device_indices)
        set_layer(self, layer)
        set_keys(self, keys)
        set_draft(self, draft)
        set_draft_host(self, draft_host_indices)
        set_id(self, next_job_id() if id is None else id)

    host_indices = property(lambda self: _indices(self, "_host"), doc="Host slot indices (int64 tensor).")
    device_indices = property(lambda self: _indices(self, "_device"), doc="Device slot indices, or None.")
    draft_host_indices = property(lambda self: _indices(self, "_draft_host"),
                                  doc="Draft host slot indices, or None.")

    @property
    def num_tokens(self) -> int:
        host = self._host
        return host.num_tokens if type(host) is PageSlots else int(host.numel())


_TRANSFER_JOB_FIELDS = slot_setters(TransferJob, "kind", "node_ids", "_host", "_device", "layer", "keys", "draft",
                                    "_draft_host", "id")


@attrs.frozen(slots=True, eq=False, init=False)
class JobBatch:
    """Jobs of one kind (and layer) merged into one transfer for one step (indices as ``TransferJob``'s)."""

    kind: JobKind
    jobs: tuple[TransferJob, ...]
    _host: "torch.Tensor | PageSlots" = attrs.field(alias="host_indices")
    _device: "torch.Tensor | PageSlots | None" = attrs.field(alias="device_indices")
    layer: int | None = None
    _draft_host: "torch.Tensor | PageSlots | None" = attrs.field(default=None, alias="draft_host_indices")

    def __init__(self, kind: JobKind, jobs: tuple[TransferJob, ...], host_indices: "torch.Tensor | PageSlots",
                 device_indices: "torch.Tensor | PageSlots | None", layer: int | None = None,
                 draft_host_indices: "torch.Tensor | PageSlots | None" = None) -> None:
        set_kind, set_jobs, set_host, set_device, set_layer, set_draft_host = _JOB_BATCH_FIELDS
        set_kind(self, kind)
        set_jobs(self, jobs)
        set_host(self, host_indices)
        set_device(self, device_indices)
        set_layer(self, layer)
        set_draft_host(self, draft_host_indices)

    host_indices = property(lambda self: _indices(self, "_host"), doc="Host slot indices (int64 tensor).")
    device_indices = property(lambda self: _indices(self, "_device"), doc="Device slot indices, or None.")
    draft_host_indices = property(lambda self: _indices(self, "_draft_host"),
                                  doc="Draft host slot indices, or None.")

    @property
    def job_ids(self) -> tuple[int, ...]:
        return tuple(j.id for j in self.jobs)

    @property
    def num_tokens(self) -> int:
        host = self._host
        return host.num_tokens if type(host) is PageSlots else int(host.numel())


_JOB_BATCH_FIELDS = slot_setters(JobBatch, "kind", "jobs", "_host", "_device", "layer", "_draft_host")


def _joined(parts: list) -> "torch.Tensor | PageSlots":
    """Indices of several jobs one after another: page ids of one allocator stay page ids (joined bytes)."""
    first = parts[0]
    if type(first) is PageSlots and all(type(p) is PageSlots and p.allocator is first.allocator for p in parts):
        return PageSlots(b"".join(p.pages for p in parts), first.allocator)
    import torch

    return torch.cat([p.tensor() if type(p) is PageSlots else p for p in parts])


def merge_jobs(jobs: Sequence[TransferJob]) -> list[JobBatch]:
    """Merge pending jobs into one batch per (kind, layer), keeping submit order (no copy for a lone job)."""
    if len(jobs) == 1:
        j = jobs[0]
        return [JobBatch(j.kind, (j,), j._host, j._device, j.layer, j._draft_host)]
    groups: dict[tuple[JobKind, int | None], list[TransferJob]] = {}
    for job in jobs:
        groups.setdefault((job.kind, job.layer), []).append(job)
    batches = []
    for (kind, layer), members in groups.items():
        if len(members) == 1:
            j = members[0]
            batches.append(JobBatch(kind, (j,), j._host, j._device, layer, j._draft_host))
            continue
        host = _joined([j._host for j in members])
        devs = [j._device for j in members if j._device is not None]
        device = _joined(devs) if len(devs) == len(members) else None
        drafts = [j._draft_host for j in members if j._draft_host is not None]
        draft = _joined(drafts) if drafts and len(drafts) == len(members) else None
        batches.append(JobBatch(kind, tuple(members), host, device, layer, draft))
    return batches


@attrs.frozen(slots=True, init=False)
class Completion:
    """An executor's report that a job finished (``ok``) or failed (with ``error``)."""

    job_id: int
    ok: bool = True
    error: str = ""

    def __init__(self, job_id: int, ok: bool = True, error: str = "") -> None:
        set_job_id, set_ok, set_error = _COMPLETION_FIELDS
        set_job_id(self, job_id)
        set_ok(self, ok)
        set_error(self, error)


_COMPLETION_FIELDS = slot_setters(Completion, "job_id", "ok", "error")


class LayerWait(Protocol):
    """Handle returned by a load: the forward pass calls ``wait(layer)`` before reading it."""

    def wait(self, layer: int) -> None: ...

    def done(self) -> bool: ...


EXECUTOR_METHODS = ("submit", "poll", "synchronize", "close")  # what the cache calls on its executor


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
