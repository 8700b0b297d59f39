"""Page-copy kernels between a DeviceKVPool and a HostKVPool.

Index tensors name token slots and must be page aligned. ``coalesce_runs``
turns a pair of index tensors into runs where both sides' pages are
consecutive; every run is then moved with slice copies (``dst[a:b].copy_``),
never per-token indexing on the CPU (on CUDA, indexed kernels gather and scatter pages).

A device pool that owns its memory keeps every part and layer in one buffer;
one adopted from an engine (``DeviceKVPool.adopt``) has a buffer per layer (or
per layer and part) in the engine's own strides, and is copied through
``layer_pages`` views (on the CPU, one copy per run, part and layer).

Two strategies, picked by the device pool's device:

* CPU: one strided copy per run covering K and V (and all layers for a full
  backup, or a full load) when the device pool owns one buffer; the CPU copy
  kernel handles the strides (and ATen spreads a large one over its
  intra-op threads).
* CUDA: indexed kernels, one gather and one scatter per layer and part,
  read and write the host pages through a GPU view of the pinned host pool
  (``zero_copy``), whatever the number of runs; a load's layer is ready as
  soon as its own pages arrived. Where the platform does not map pinned
  memory (or the pool is not pinned), copies fall back to memcpys whose host
  side is one contiguous block: for the page_first layouts a run's every
  layer, staged on the GPU and gathered or scattered there
  (``copy_staged``); for ``layer_first`` one memcpy per run, layer and part;
  a single-layer backup of a page_first pool goes through a host temporary
  (synchronous).

All functions take ``runs`` in the (device_start, host_start, length) token
form that ``plan_runs(device_indices, host_indices, page_size)`` returns, so
a caller computes runs once per batch and reuses them for every layer.
"""

from __future__ import annotations

import numpy as np
import torch

from hicache_fsm.allocator import page_ids_array
from hicache_fsm.copy_staged import STAGED_LAYOUTS, backup_staged, load_staged
from hicache_fsm.page_index import Run, as_bits, run_positions
from hicache_fsm.errors import BadIndices, ConfigError
from hicache_fsm.pools import DeviceKVPool, HostKVPool
from hicache_fsm.zero_copy import backup_mapped, host_view, load_mapped



class PlannedRuns(list):
    """Runs that ``coalesce_runs`` built from checked indices: the copy functions take them unchecked."""


def coalesce_runs(src_idx, dst_idx, page_size: int) -> list[Run]:
    """Maximal runs where src and dst pages are both consecutive.

    Returns ``(src_start, dst_start, length)`` in tokens, in index order.
    Raises BadIndices unless both tensors are page aligned and of equal length.
    """
    src_pages = page_ids_array(src_idx, page_size, what="src indices")
    dst_pages = page_ids_array(dst_idx, page_size, what="dst indices")
    if src_pages.size != dst_pages.size:
        raise BadIndices(f"src and dst lengths differ: {src_pages.size * page_size} vs {dst_pages.size * page_size}")
    n = src_pages.size
    if n == 0:
        return PlannedRuns()
    if n == 1:
        return PlannedRuns([(int(src_pages[0]) * page_size, int(dst_pages[0]) * page_size, page_size)])
    breaks = np.flatnonzero((np.diff(src_pages) != 1) | (np.diff(dst_pages) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [n]))
    src_starts = (src_pages[starts] * page_size).tolist()
    dst_starts = (dst_pages[starts] * page_size).tolist()
    lengths = ((ends - starts) * page_size).tolist()
    return PlannedRuns(zip(src_starts, dst_starts, lengths))


def plan_runs(device_indices, host_indices, page_size: int) -> list[Run]:
    """Runs as ``(device_start, host_start, length)`` for the copy functions."""
    return coalesce_runs(device_indices, host_indices, page_size)


def _check(device_pool: DeviceKVPool, host_pool: HostKVPool, runs: list[Run], layer: int | None) -> None:
    if device_pool.shape != host_pool.shape:
        raise ConfigError(f"device pool shape {device_pool.shape} differs from host pool shape {host_pool.shape}")
    if device_pool.page_size != host_pool.page_size:
        raise ConfigError("device and host pools have different page sizes")
    if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int)
                              or not 0 <= layer < device_pool.layers):
        raise BadIndices(f"layer {layer!r} out of range [0, {device_pool.layers})")
    dev_end = max((d + n for d, _, n in runs), default=0)
    host_end = max((h + n for _, h, n in runs), default=0)
    if dev_end > device_pool.size_tokens:
        raise BadIndices(f"device index {dev_end - 1} out of range (pool has {device_pool.size_tokens} slots)")
    if host_end > host_pool.size_tokens:
        raise BadIndices(f"host index {host_end - 1} out of range (pool has {host_pool.size_tokens} slots)")


def _runs_for(device_pool, host_pool, device_indices, host_indices, runs):
    if runs is None:
        return plan_runs(device_indices, host_indices, device_pool.page_size)
    if type(runs) is not PlannedRuns:
        _check_runs(runs, device_pool.page_size)
    return runs


def _check_runs(runs, page_size: int) -> None:
    """Refuse runs given by hand that are not (start, start, length) triples of whole pages.

    ``narrow`` would take a negative start from the end of the pool, and a
    partial page would copy half of one: wrong KV bytes, no error.
    """
    try:
        arr = np.asarray(runs)
    except (TypeError, ValueError):
        arr = None
    if arr is None or (arr.size and (arr.ndim != 2 or arr.shape[1] != 3 or arr.dtype.kind not in "iu")):
        raise BadIndices("runs must be (device_start, host_start, length) triples of ints")
    if arr.size and ((arr < 0).any() or (arr[:, 2] == 0).any() or (arr % page_size).any()):
        raise BadIndices(f"runs must cover whole pages of {page_size} tokens from starts >= 0 with lengths > 0")


def _wait_unless(non_blocking: bool, device_pool: DeviceKVPool) -> None:
    """A blocking copy returns when it is done: kernels that read or write host memory must have run."""
    if not non_blocking:
        torch.cuda.current_stream(device_pool.device).synchronize()


# ---------------------------------------------------------------- device -> host


def backup_to_host(device_pool: DeviceKVPool, host_pool: HostKVPool, device_indices=None, host_indices=None,
                   layer: int | None = None, *, runs: list[Run] | None = None, non_blocking: bool = False) -> None:
    """Copy device slots to host slots: all layers, or only ``layer``."""
    runs = _runs_for(device_pool, host_pool, device_indices, host_indices, runs)
    _check(device_pool, host_pool, runs, layer)
    if not runs:
        return
    if device_pool.device.type == "cpu":
        _d2h_cpu(device_pool, host_pool, runs, layer)
    elif (view := host_view(host_pool, device_pool.device)) is not None:
        backup_mapped(device_pool, view, host_pool.layout, runs, layer)
        _wait_unless(non_blocking, device_pool)
    elif layer is None and host_pool.layout in STAGED_LAYOUTS:
        backup_staged(device_pool, host_pool, runs, non_blocking)
    else:
        _d2h_cuda_memcpy(device_pool, host_pool, runs, layer, non_blocking)


def _cpu_pairs(dev: DeviceKVPool, host: HostKVPool, runs: list[Run], layer: int | None):
    """(device view, host view) pairs of equal shape, one per run, for the CPU path.

    Views are built with ``narrow`` on views prepared once per call: creating a
    view by multi-dimensional indexing costs a few microseconds, a sizeable
    share of copying one 100 KB run.
    """
    ps, layout = dev.page_size, host.layout
    P, L, H, D = dev.shape.parts, dev.shape.layers, dev.shape.heads, dev.shape.head_dim
    if layer is None:
        dkv = dev.kv
        if layout == "layer_first":
            hkv = host.kv
            return [(dkv.narrow(2, d, n), hkv.narrow(2, h, n)) for d, h, n in runs]
        if layout == "page_first":
            dt = dkv.transpose(1, 2)  # (2, T, L, H, D) view of the device buffer
            hkv = host.kv
            return [(dt.narrow(1, d, n), hkv.narrow(1, h, n)) for d, h, n in runs]
        hkv = host.kv
        return [(dkv.narrow(2, d, n).view(P, L, n // ps, ps, H, D).transpose(1, 2), hkv.narrow(1, h // ps, n // ps))
                for d, h, n in runs]
    dl = dev.kv.select(1, layer)  # (P, T, H, D)
    if layout == "layer_first":
        hl = host.kv.select(1, layer)
        return [(dl.narrow(1, d, n), hl.narrow(1, h, n)) for d, h, n in runs]
    if layout == "page_first":
        hl = host.kv.select(2, layer)  # (P, T, H, D), strided
        return [(dl.narrow(1, d, n), hl.narrow(1, h, n)) for d, h, n in runs]
    hl = host.kv.select(2, layer)  # (P, pages, ps, H, D)
    return [(dl.narrow(1, d, n).view(P, n // ps, ps, H, D), hl.narrow(1, h // ps, n // ps)) for d, h, n in runs]


def _copy_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for each (dst, src) pair, one after another.

    Each copy uses ATen's intra-op threads. A pool of Python worker threads
    copying runs side by side measured slower in ``hicache-fsm bench copy`` on
    a two-core machine, for both host layouts at pages of 16 and 64 tokens.
    """
    for dst, src in pairs:
        dst.copy_(src)


def _paged_pairs(dev: DeviceKVPool, host: HostKVPool, runs: list[Run], layer: int | None):
    """(device view, host view) pairs of (pages, page_size, heads, head_dim), one per run, part and layer.

    Works for any device pool (the adopted ones have no single buffer) and any
    host layout; the views keep each side's strides.
    """
    ps = dev.page_size
    pairs = []
    for li in range(dev.layers) if layer is None else (layer,):
        for dev_pages, host_pages in zip(dev.layer_pages(li), host.layer_pages(li)):
            pairs.extend((dev_pages.narrow(0, d // ps, n // ps), host_pages.narrow(0, h // ps, n // ps))
                         for d, h, n in runs)
    return pairs


# From this many runs on, one gather + one scatter over token indices beats a copy per run on the CPU
# (a view and a copy call cost microseconds each; small runs of small pages are mostly that) ...
GATHER_MIN_RUNS = 16
# ... as long as runs are small: measured with ``bench copy`` on a 2-core machine (both host layouts,
# pages of 16 and 64), the gather wins up to 4 KiB a run and part and loses from 16 KiB (at 1 MiB
# pages it moved 0.8 GB/s against 8-10 for a copy per run).
GATHER_MAX_RUN_BYTES = 8192


def gather_pays(runs: list[Run], token_bytes: int) -> bool:
    """Whether ``runs`` (of ``token_bytes`` per token and part) are many and small enough to gather."""
    if len(runs) < GATHER_MIN_RUNS:
        return False
    return sum(n for _, _, n in runs) * token_bytes <= GATHER_MAX_RUN_BYTES * len(runs)


def _token_views(dev: DeviceKVPool, host: HostKVPool, layer: int | None):
    """(device view, host view, token dim) with the same shape but the token dim, or None for this layout."""
    if dev.adopted or host.layout not in ("layer_first", "page_first"):
        return None
    if layer is None:
        if host.layout == "layer_first":
            return dev.kv, host.kv, 2  # (P, L, T, H, D) both
        return dev.kv.transpose(1, 2), host.kv, 1  # (P, T, L, H, D) both
    dl = dev.kv.select(1, layer)  # (P, T, H, D)
    return dl, host.kv.select(1 if host.layout == "layer_first" else 2, layer), 1


def _run_indices(runs: list[Run]) -> tuple[torch.Tensor, torch.Tensor]:
    """Device and host token indices covered by ``runs``, in run order."""
    device, host = run_positions(runs)
    return torch.from_numpy(device), torch.from_numpy(host)


def _gathered(dev: DeviceKVPool, host: HostKVPool, runs: list[Run], layer: int | None, to_host: bool) -> bool:
    """Copy ``runs`` with one index_select and one index_copy_ when they are many; False when not done."""
    if len(runs) < GATHER_MIN_RUNS:
        return False
    views = _token_views(dev, host, layer)
    if views is None:
        return False
    dview, hview, dim = views
    if not gather_pays(runs, dview[0].numel() // dview.shape[dim] * dview.element_size()):
        return False
    d_idx, h_idx = _run_indices(runs)
    dview, hview = as_bits(dview), as_bits(hview)  # bits: the indexed kernels have no float8 variants
    if to_host:
        hview.index_copy_(dim, h_idx, dview.index_select(dim, d_idx))
    else:
        dview.index_copy_(dim, d_idx, hview.index_select(dim, h_idx))
    return True


def _d2h_cpu(dev: DeviceKVPool, host: HostKVPool, runs: list[Run], layer: int | None) -> None:
    if _gathered(dev, host, runs, layer, to_host=True):
        return
    pairs = _paged_pairs(dev, host, runs, layer) if dev.adopted else _cpu_pairs(dev, host, runs, layer)
    _copy_pairs([(h, d) for d, h in pairs])


def _d2h_cuda_memcpy(dev: DeviceKVPool, host: HostKVPool, runs: list[Run], layer: int | None, nb: bool) -> None:
    """Without a GPU view of the host: a copy per run, layer and part (``layer_pages`` views, owned or adopted)."""
    # layer_first: each host view is contiguous, one async memcpy each. One layer of a
    # page_first(_direct) pool is scattered over the host: synchronous.
    async_ok = host.layout == "layer_first"
    for d, h in _paged_pairs(dev, host, runs, layer):
        h.copy_(d, non_blocking=nb and async_ok)


# ---------------------------------------------------------------- host -> device


def load_to_device(device_pool: DeviceKVPool, host_pool: HostKVPool, host_indices=None, device_indices=None,
                   layer: int = 0, *, runs: list[Run] | None = None, non_blocking: bool = False,
                   staging: dict | None = None) -> None:
    """Copy one layer of host slots into device slots.

    ``staging`` is a dict the caller keeps for one batch (CUDA only: what the
    first layer prepared, page numbers or staged runs, serves the following ones).
    """
    if layer is None:
        raise BadIndices("load_to_device copies one layer; use load_all_layers")
    runs = _runs_for(device_pool, host_pool, device_indices, host_indices, runs)
    _check(device_pool, host_pool, runs, layer)
    if not runs:
        return
    if device_pool.device.type == "cpu":
        _h2d_cpu(device_pool, host_pool, runs, layer)
    elif (view := host_view(host_pool, device_pool.device)) is not None:
        load_mapped(device_pool, view, host_pool.layout, runs, layer, staging)
        _wait_unless(non_blocking, device_pool)
    elif host_pool.layout in STAGED_LAYOUTS:
        load_staged(device_pool, host_pool, runs, layer, non_blocking, staging)
    else:  # layer_first without a GPU view of the host: one contiguous host view per run and part
        for d, h in _paged_pairs(device_pool, host_pool, runs, layer):
            d.copy_(h, non_blocking=non_blocking)


def load_all_layers(device_pool: DeviceKVPool, host_pool: HostKVPool, host_indices=None, device_indices=None,
                    *, runs: list[Run] | None = None, non_blocking: bool = False) -> None:
    """Copy every layer of host slots into device slots.

    On CUDA this goes layer by layer (as an executor does between layer
    events). On the CPU nothing runs concurrently, so layer order is not
    observable and one copy per run covers every layer (fewer, larger copies).
    """
    runs = _runs_for(device_pool, host_pool, device_indices, host_indices, runs)
    if device_pool.device.type == "cpu":
        _check(device_pool, host_pool, runs, None)
        _h2d_cpu(device_pool, host_pool, runs, None)
        return
    staging: dict = {}
    for layer in range(device_pool.layers):
        load_to_device(device_pool, host_pool, layer=layer, runs=runs, non_blocking=non_blocking, staging=staging)


def _h2d_cpu(dev: DeviceKVPool, host: HostKVPool, runs: list[Run], layer: int | None) -> None:
    if _gathered(dev, host, runs, layer, to_host=False):
        return
    _copy_pairs(_paged_pairs(dev, host, runs, layer) if dev.adopted else list(_cpu_pairs(dev, host, runs, layer)))


__all__ = ["Run", "coalesce_runs", "plan_runs", "backup_to_host", "load_to_device", "load_all_layers"]
