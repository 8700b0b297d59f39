"""Executors: run D2H / H2D job batches between a device and a host pool.

``TorchExecutor`` is the real one. On CUDA it copies on a write stream (D2H)
and a load stream (H2D); a load records one event per layer in one of a small
ring of producer slots, so the forward pass can wait for layer i only while
later layers keep arriving, and consecutive loads overlap. ``poll`` reports a
batch once its finish event has been reached. On the CPU it copies
synchronously inside ``submit`` and reports on the next ``poll``.

``ManualExecutor`` holds jobs until a test completes or fails them one by one,
in any order, so every interleaving of acknowledgements can be exercised.

Draft pools: a batch's ``draft_host_indices`` are copied between the draft
device pool (at the batch's device indices; draft and target device pools share
slot indices) and the draft host pool. A job with ``draft=True`` names the draft
pools with its own host/device indices (CP per-layer writes of the draft model).
Storage kinds (H2S, S2H) are not run here: submitting one raises ConfigError.
"""

from __future__ import annotations

from typing import Callable, Sequence

import attrs
import torch

from hicache_fsm.copy import Run, backup_to_host, load_all_layers, load_to_device, plan_runs
from hicache_fsm.errors import BadIndices, ConfigError, HiCacheError, UnknownJob
from hicache_fsm.jobs import D2H, H2D, Completion, JobBatch, JobKind, TransferJob, completed_all
from hicache_fsm.pools import DeviceKVPool, HostKVPool
from hicache_fsm.sole_user import SoleUser


class LoadNotFinished(HiCacheError):
    """``wait(layer)`` on a ManualExecutor load whose jobs were not all completed or failed."""


@attrs.frozen
class _Copy:
    """One planned pool-to-pool copy (target or draft) of a batch or job."""

    device_pool: DeviceKVPool
    host_pool: HostKVPool
    runs: list[Run]
    layer: int | None  # D2H: one layer or None for all; H2D: always None (all layers)

    @property
    def layers(self) -> int:
        return self.device_pool.layers


class _PoolSet:
    def __init__(self, device_pool, host_pool, draft_device_pool, draft_host_pool) -> None:
        if not isinstance(device_pool, DeviceKVPool) or not isinstance(host_pool, HostKVPool):
            raise ConfigError("an executor needs a DeviceKVPool and a HostKVPool")
        if (draft_device_pool is None) != (draft_host_pool is None):
            raise ConfigError("give both draft pools or neither")
        for dev, host, what in ((device_pool, host_pool, "target"), (draft_device_pool, draft_host_pool, "draft")):
            if dev is None:
                continue
            if dev.shape != host.shape or dev.page_size != host.page_size:
                raise ConfigError(f"{what} device and host pools differ in shape or page size")
        if draft_device_pool is not None and draft_device_pool.page_size != device_pool.page_size:
            raise ConfigError("draft pools must use the target's page size")
        if draft_device_pool is not None and draft_device_pool.device != device_pool.device:
            raise ConfigError(f"the draft device pool is on {draft_device_pool.device} and the target's on "
                              f"{device_pool.device}: one executor's streams serve one device")
        self.device = device_pool
        self.host = host_pool
        self.draft_device = draft_device_pool
        self.draft_host = draft_host_pool

    def check_same(self, pools: tuple) -> None:
        """Refuse a cache over other pools (device, host, draft device, draft host): its copies would miss them."""
        mine = (self.device, self.host, self.draft_device, self.draft_host)
        if any(a is not b for a, b in zip(mine, pools)):
            raise ConfigError("the executor copies between other pools than the cache's: build it over the "
                              "cache's pools (or let HiCache build it)")

    def _runs(self, device_pool, host_pool, device_indices, host_indices, what: str) -> list[Run]:
        if device_indices is None:
            raise BadIndices(f"{what}: device indices are required")
        runs = plan_runs(device_indices, host_indices, device_pool.page_size)
        if runs:
            if max(d + n for d, _, n in runs) > device_pool.size_tokens:
                raise BadIndices(f"{what}: device index out of range [0, {device_pool.size_tokens})")
            if max(h + n for _, h, n in runs) > host_pool.size_tokens:
                raise BadIndices(f"{what}: host index out of range [0, {host_pool.size_tokens})")
        return runs

    def plan(self, kind: JobKind, host_indices, device_indices, draft_host_indices, draft: bool,
             layer: int | None) -> list[_Copy]:
        """Validated copies for one group of indices; raises before anything moves."""
        if kind not in (D2H, H2D):
            raise ConfigError(f"{kind.value} jobs are storage transfers; this executor runs only d2h and h2d")
        if kind is H2D and layer is not None:
            raise BadIndices("h2d batches load every layer; layer must be None")
        copies = []
        if draft:
            if self.draft_device is None:
                raise ConfigError("a draft job was submitted but no draft pools are registered")
            pairs = [(self.draft_device, self.draft_host, host_indices, "draft")]
        else:
            pairs = [(self.device, self.host, host_indices, "target")]
            if draft_host_indices is not None:
                if self.draft_device is None:
                    raise ConfigError("batch has draft_host_indices but no draft pools are registered")
                pairs.append((self.draft_device, self.draft_host, draft_host_indices, "draft"))
        for dev, host, hidx, what in pairs:
            if layer is not None:
                if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
                    raise BadIndices(f"layer must be a non-negative int or None, got {layer!r}")
                if layer >= dev.layers:
                    if what == "draft" and not draft:
                        continue  # a target layer the (shallower) draft model does not have
                    raise BadIndices(f"{what} layer {layer} out of range [0, {dev.layers})")
            copies.append(_Copy(dev, host, self._runs(dev, host, device_indices, hidx, what), layer))
        return copies

    def plan_batch(self, batch: JobBatch) -> list[_Copy]:
        if len({j.id for j in batch.jobs}) != len(batch.jobs):  # each would be reported, the second an unknown job
            raise BadIndices(f"a job appears twice in one batch: {list(batch.job_ids)}")
        flags = {j.draft for j in batch.jobs}
        if len(flags) <= 1:
            return self.plan(batch.kind, batch.host_indices, batch.device_indices, batch.draft_host_indices,
                             flags == {True}, batch.layer)
        copies = []
        for flag in (False, True):
            members = [j for j in batch.jobs if j.draft == flag]
            host = torch.cat([j.host_indices for j in members])
            devs = [j.device_indices for j in members]
            device = torch.cat(devs) if all(d is not None for d in devs) else None
            drafts = [j.draft_host_indices for j in members if j.draft_host_indices is not None]
            draft_host = torch.cat(drafts) if drafts and len(drafts) == len(members) else None
            copies += self.plan(batch.kind, host, device, draft_host, flag, batch.layer)
        return copies

    def plan_job(self, job: TransferJob) -> list[_Copy]:
        return self.plan(job.kind, job.host_indices, job.device_indices, job.draft_host_indices, job.draft, job.layer)


def _num_layers(copies: Sequence[_Copy], default: int) -> int:
    return max((c.layers for c in copies), default=default)


def _run_copies_sync(kind: JobKind, copies: Sequence[_Copy]) -> None:
    for c in copies:
        if kind is D2H:
            backup_to_host(c.device_pool, c.host_pool, layer=c.layer, runs=c.runs)
        else:
            load_all_layers(c.device_pool, c.host_pool, runs=c.runs)


def _check_layer(layer: int, layers: int) -> None:
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < layers:
        raise BadIndices(f"layer {layer!r} out of range [0, {layers})")


class DoneWait:
    """A LayerWait that is already done (CPU executors, finished transfers)."""

    def __init__(self, layers: int) -> None:
        self.layers = layers

    def wait(self, layer: int) -> None:
        _check_layer(layer, self.layers)

    def done(self) -> bool:
        return True


class ServesOneCache:
    """An executor's completions go to one cache (``poll`` hands them out once), over the executor's own pools."""

    pools: _PoolSet | None = None  # an executor that copies nothing has none
    serving: SoleUser

    def bind_cache(self, cache: object, pools: tuple) -> None:
        """Serve ``cache`` alone; ``pools`` are its device, host, draft device and draft host pools."""
        if self.pools is not None:
            self.pools.check_same(pools)
        self.serving.take(cache, ConfigError("this executor already serves another HiCache: give each cache its "
                                             "own (a poll hands each completion to one cache)"))

    def unbind_cache(self, cache: object) -> None:
        self.serving.give_up(cache)


class AckExecutor(ServesOneCache):
    """Completes each D2H or H2D batch at the next ``poll`` without moving a byte.

    For runs where the KV bytes mean nothing: trace replay in metadata mode
    (a pool's KV without a model) and the controller benchmarks (whose figure
    is the controller's own time). Everything the cache decides and counts is
    as with ``TorchExecutor`` on the CPU, which also reports a batch at the
    next ``poll``.
    """

    manual = False

    def __init__(self, layers: int = 1) -> None:
        self.serving = SoleUser()
        self.layers = layers
        self._ready: list[Completion] = []
        self._done = DoneWait(layers)  # stateless: one handle serves every batch
        self._closed = False

    def submit(self, batch: JobBatch) -> DoneWait:
        if self._closed:
            raise ConfigError("executor is closed")
        if batch.kind not in (D2H, H2D):
            raise ConfigError(f"{batch.kind.value} jobs are storage transfers; this executor runs only d2h and h2d")
        self._ready.extend(completed_all(batch.jobs))
        return self._done

    def poll(self) -> list[Completion]:
        out, self._ready = self._ready, []
        return out

    def synchronize(self) -> None:
        return None

    def close(self) -> None:
        self._closed = True


class _EventWait:
    """CUDA: wait for one finish event (a D2H batch)."""

    def __init__(self, event, layers: int, device: torch.device) -> None:
        self.event = event
        self.layers = layers
        self.device = device

    def wait(self, layer: int) -> None:
        _check_layer(layer, self.layers)
        torch.cuda.current_stream(self.device).wait_event(self.event)

    def done(self) -> bool:
        return self.event.query()


class _LoadSlot:
    """One producer slot: a start event and one event per layer, reused round robin."""

    def __init__(self, layers: int) -> None:
        self.start = torch.cuda.Event()
        self.events = [torch.cuda.Event() for _ in range(layers)]
        self.generation = 0
        self.used = False

    @property
    def finish(self):
        return self.events[-1]


class SlotWait:
    """CUDA LayerWait of one load: ``wait(i)`` makes the current stream wait for layer i only.

    A slot is reused only after its previous load finished, so a handle whose
    slot moved on to a later load is simply done.
    """

    def __init__(self, slot: _LoadSlot, layers: int, device: torch.device) -> None:
        self.slot = slot
        self.generation = slot.generation
        self.layers = layers
        self.device = device

    def wait(self, layer: int) -> None:
        _check_layer(layer, self.layers)
        if self.slot.generation != self.generation:
            return
        torch.cuda.current_stream(self.device).wait_event(self.slot.events[layer])

    def done(self) -> bool:
        return self.slot.generation != self.generation or self.slot.finish.query()


@attrs.define
class _InFlight:
    batch: JobBatch
    is_done: object  # () -> bool
    sync: object  # () -> None
    keep: tuple = ()


class TorchExecutor(ServesOneCache):
    """Runs D2H and H2D batches with torch copies (streams and events on CUDA).

    On CUDA a batch's copies run on the executor's own streams after the
    stream current on the pool's GPU when the batch is submitted (by
    ``HiCache.poll``, ``flush`` or a first ``wait``), and ``wait(layer)``
    makes the stream current then wait: the engine calls them with its
    compute stream current on that GPU.
    """

    def __init__(self, device_pool: DeviceKVPool, host_pool: HostKVPool,
                 draft_device_pool: DeviceKVPool | None = None, draft_host_pool: HostKVPool | None = None,
                 producer_slots: int = 3) -> None:
        if isinstance(producer_slots, bool) or not isinstance(producer_slots, int) or producer_slots < 1:
            raise ConfigError(f"producer_slots must be a positive int, got {producer_slots!r}")
        self.pools = _PoolSet(device_pool, host_pool, draft_device_pool, draft_host_pool)
        self.serving = SoleUser()
        self.device = device_pool.device  # indexed (``pools.indexed_device``): events go to that GPU's streams
        self.cuda = self.device.type == "cuda"
        self._ready: list[Completion] = []
        self._inflight: list[_InFlight] = []
        self._closed = False
        self.producer_slots = producer_slots
        if self.cuda:
            with torch.cuda.device(device_pool.device):
                self.write_stream = torch.cuda.Stream(device_pool.device)
                self.load_stream = torch.cuda.Stream(device_pool.device)
            layers = max(device_pool.layers, draft_device_pool.layers if draft_device_pool is not None else 0)
            self._slots = [_LoadSlot(layers) for _ in range(producer_slots)]
            self._producer = -1
        else:
            self.write_stream = self.load_stream = None
            self._slots = []

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, batch: JobBatch) -> DoneWait | _EventWait | SlotWait:
        if self._closed:
            raise ConfigError("executor is closed")
        copies = self.pools.plan_batch(batch)
        layers = _num_layers(copies, self.pools.device.layers)
        if not self.cuda:
            try:
                _run_copies_sync(batch.kind, copies)
            except HiCacheError:
                raise
            except Exception as exc:  # a failed copy fails the batch's jobs, it does not crash the engine
                self._ready.extend(completed_all(batch.jobs, ok=False, error=f"{type(exc).__name__}: {exc}"))
                return DoneWait(layers)
            self._ready.extend(completed_all(batch.jobs))
            return DoneWait(layers)
        stream = self.write_stream if batch.kind is D2H else self.load_stream
        try:
            if batch.kind is D2H:
                return self._submit_write(batch, copies, layers)
            return self._submit_load(batch, copies, layers)
        except HiCacheError:
            raise
        except Exception as exc:  # out of memory, a driver error: the batch fails, the engine goes on
            stream.synchronize()  # the copies queued before the failure end before their slots can be reused
            self._ready.extend(completed_all(batch.jobs, ok=False, error=f"{type(exc).__name__}: {exc}"))
            return DoneWait(layers)

    def _keep(self, batch: JobBatch, stream) -> tuple:
        tensors = tuple(t for t in (batch.host_indices, batch.device_indices, batch.draft_host_indices) if t is not None)
        for t in tensors:
            if t.is_cuda:
                t.record_stream(stream)
        return tensors

    def _submit_write(self, batch: JobBatch, copies: list[_Copy], layers: int) -> _EventWait:
        start, finish = torch.cuda.Event(), torch.cuda.Event()
        start.record(torch.cuda.current_stream(self.device))  # after the engine's writes of this KV
        with torch.cuda.stream(self.write_stream):
            self.write_stream.wait_event(start)
            for c in copies:
                backup_to_host(c.device_pool, c.host_pool, layer=c.layer, runs=c.runs, non_blocking=True)
            finish.record()
            keep = self._keep(batch, self.write_stream)
        self._inflight.append(_InFlight(batch, finish.query, finish.synchronize, keep))
        return _EventWait(finish, layers, self.device)

    def _next_slot(self) -> _LoadSlot:
        self._producer = (self._producer + 1) % len(self._slots)
        slot = self._slots[self._producer]
        if slot.used and not slot.finish.query():
            slot.finish.synchronize()  # ring full: the oldest load must end before its slot is reused
        slot.generation += 1
        slot.used = True
        return slot

    def _submit_load(self, batch: JobBatch, copies: list[_Copy], layers: int) -> SlotWait:
        slot = self._next_slot()
        slot.start.record(torch.cuda.current_stream(self.device))  # after the reads of the slots it fills
        with torch.cuda.stream(self.load_stream):
            self.load_stream.wait_event(slot.start)
            stagings = [{} for _ in copies]
            for layer in range(len(slot.events)):
                for c, staging in zip(copies, stagings):
                    if layer < c.layers:
                        load_to_device(c.device_pool, c.host_pool, layer=layer, runs=c.runs,
                                       non_blocking=True, staging=staging)
                slot.events[layer].record()
            # The staging blocks are not kept: allocated on the load stream, they are reused only by later
            # allocations on that stream, which run after these copies.
            keep = self._keep(batch, self.load_stream)
        handle = SlotWait(slot, layers, self.device)
        self._inflight.append(_InFlight(batch, handle.done, slot.finish.synchronize, keep))
        return handle

    def poll(self) -> list[Completion]:
        out, self._ready = self._ready, []
        still = []
        for item in self._inflight:
            if item.is_done():
                out.extend(completed_all(item.batch.jobs))
            else:
                still.append(item)
        self._inflight = still
        return out

    def synchronize(self) -> None:
        for item in list(self._inflight):
            if not item.is_done():
                item.sync()

    def close(self) -> None:
        if not self._closed:
            self.synchronize()
            self._closed = True

    def __enter__(self) -> "TorchExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ManualWait:
    """LayerWait of a ManualExecutor batch: done once each of its jobs was completed or failed."""

    def __init__(self, executor: "ManualExecutor", job_ids: tuple[int, ...], layers: int, load: bool) -> None:
        self._executor = executor
        self.job_ids = job_ids
        self.layers = layers
        self.load = load

    def done(self) -> bool:
        return not any(self._executor.is_pending(j) for j in self.job_ids)

    def wait(self, layer: int) -> None:
        _check_layer(layer, self.layers)
        if not self.done():
            left = [j for j in self.job_ids if self._executor.is_pending(j)]
            raise LoadNotFinished(f"layer {layer} waited on before jobs {left} were completed or failed")


class ManualExecutor(ServesOneCache):
    """Holds submitted jobs until ``complete(job_id)`` (real copy, ok) or ``fail(job_id)``."""

    def __init__(self, device_pool: DeviceKVPool, host_pool: HostKVPool,
                 draft_device_pool: DeviceKVPool | None = None, draft_host_pool: HostKVPool | None = None) -> None:
        self.pools = _PoolSet(device_pool, host_pool, draft_device_pool, draft_host_pool)
        self.serving = SoleUser()
        self._pending: dict[int, tuple[TransferJob, list[_Copy]]] = {}
        self._queue: list[Completion] = []
        self._closed = False
        self.submitted: list[JobBatch] = []  # every accepted batch, in order (for tests)

    @property
    def completions_waiting(self) -> int:
        """Completions reported but not yet taken by ``poll``."""
        return len(self._queue)

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, batch: JobBatch) -> ManualWait:
        if self._closed:
            raise ConfigError("executor is closed")
        self.pools.plan_batch(batch)  # validate the batch as a whole first
        planned = []
        for job in batch.jobs:
            if job.id in self._pending:
                raise BadIndices(f"job {job.id} is already pending")
            planned.append((job, self.pools.plan_job(job)))
        for job, copies in planned:
            self._pending[job.id] = (job, copies)
        self.submitted.append(batch)
        layers = _num_layers([c for _, cs in planned for c in cs], self.pools.device.layers)
        return ManualWait(self, batch.job_ids, layers, batch.kind is H2D)

    def pending_job_ids(self) -> list[int]:
        """Ids of jobs neither completed nor failed, in submit order."""
        return list(self._pending)

    def is_pending(self, job_id: int) -> bool:
        return job_id in self._pending

    def fork(self, pools: "_PoolSet", repoint: Callable[["_Copy"], "_Copy"]) -> "ManualExecutor":
        """An independent copy over ``pools`` (forked pools); ``repoint`` re-makes each planned copy for them."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.pools = pools
        new._pending = {jid: (job, [repoint(c) for c in copies]) for jid, (job, copies) in self._pending.items()}
        new._queue = list(self._queue)
        new.submitted = list(self.submitted)
        return new

    def pending_jobs(self) -> list[TransferJob]:
        return [job for job, _ in self._pending.values()]

    def _lookup(self, job_id: int) -> tuple[TransferJob, list[_Copy]]:
        """The pending job and its copies; ``UnknownJob`` for anything else (an unhashable id included)."""
        try:
            if isinstance(job_id, bool):  # True would name job 1
                raise TypeError
            return self._pending[job_id]
        except (KeyError, TypeError):
            raise UnknownJob(f"job {job_id!r} is not pending (unknown, or already completed/failed)") from None

    def _take(self, job_id: int) -> tuple[TransferJob, list[_Copy]]:
        entry = self._lookup(job_id)
        del self._pending[job_id]
        return entry

    def complete(self, job_id: int) -> Completion:
        """Perform this job's copy now and queue an ok completion."""
        job, copies = self._lookup(job_id)
        _run_copies_sync(job.kind, copies)  # raises before the job leaves pending
        del self._pending[job_id]
        done = Completion(job_id, True)
        self._queue.append(done)
        return done

    def fail(self, job_id: int, error: str = "failed by test") -> Completion:
        """Queue a failed completion without copying anything."""
        self._take(job_id)
        done = Completion(job_id, False, error)
        self._queue.append(done)
        return done

    def complete_all(self) -> list[Completion]:
        """Complete every pending job in submit order."""
        return [self.complete(j) for j in self.pending_job_ids()]

    def poll(self) -> list[Completion]:
        out, self._queue = self._queue, []
        return out

    def synchronize(self) -> None:
        """Nothing runs by itself here; pending jobs stay pending until a test acts."""

    def close(self) -> None:
        self._closed = True


__all__ = ["TorchExecutor", "ManualExecutor", "LoadNotFinished", "DoneWait", "SlotWait", "ManualWait"]
