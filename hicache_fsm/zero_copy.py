"""GPU views of pinned host memory: kernels gather and scatter host pages directly (zero copy).

Moving a batch of shuffled pages with memcpys takes one per run and layer and
K/V part where one layer of a run is the contiguous unit (``layer_first``),
or a staged copy of every layer before the first is ready (the page_first
layouts, ``copy_staged``). Pinned memory is mapped into the GPU's address
space under unified addressing, so a CUDA tensor over the same address lets
one indexed kernel per layer and part read or write the host pages over the
bus (SGLang's transfer kernels work the same way), for every host layout.

On an H200 (docs/gpu.md) this moved layer_first batches at 0.83-0.86 of one
contiguous DMA where memcpys reached 0.18-0.24, and a load's layer 0 was
ready after 0.12-0.19 of the whole load where staging waited for 0.92; a
page_first load's total throughput fell from 0.86 to 0.66 (one layer of a
page_first token is a short strided read), a price paid for layers that
arrive one by one.

``host_view(host, device)`` is that CUDA tensor over a host pool's buffer, or
None where the platform does not map the memory: the caller then copies with
memcpys. A view is made once per host pool and checked before use: torch
refuses a pointer CUDA does not know, the view must start at the host
address, and bytes read through it by a kernel must equal the host's.
"""

from __future__ import annotations

import weakref

import torch

from hicache_fsm.copy_staged import Run, run_positions
from hicache_fsm.pools import DeviceKVPool, HostKVPool

PROBE_BYTES = 256

_views: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # host pool -> view of its kv, or None


class _PinnedBytes:
    """The pinned bytes of a tensor's storage, offered to torch through the CUDA array interface."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor  # the view's deleter keeps this object, and so the host memory, alive
        storage = tensor.untyped_storage()
        self.__cuda_array_interface__ = {"shape": (storage.nbytes(),), "typestr": "|u1",
                                         "data": (storage.data_ptr(), False), "strides": None, "version": 3}


def _map(tensor: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    storage = tensor.untyped_storage()
    probe = min(PROBE_BYTES, storage.nbytes())
    if not tensor.is_pinned() or not probe:
        return None
    try:
        flat = torch.as_tensor(_PinnedBytes(tensor), device=device)
    except (RuntimeError, TypeError, ValueError):  # not registered with CUDA, or no CUDA at all
        return None
    if flat.data_ptr() != storage.data_ptr():  # torch copied (the memory belongs to another GPU) instead of viewing
        return None
    torch.cuda.synchronize(device)  # no copy in flight may change the probed bytes
    host_bytes = torch.empty(0, dtype=torch.uint8).set_(storage)
    if not torch.equal(flat[:probe].clone().cpu(), host_bytes[:probe]):
        return None
    return flat.view(tensor.dtype).as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())


def host_view(host: HostKVPool, device: torch.device) -> torch.Tensor | None:
    """A CUDA tensor on ``device`` over the same pinned memory as ``host.kv`` (same shape and strides), or None."""
    if device.type != "cuda":
        return None
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if host not in _views:  # one view per pool, on the GPU that first copies it
        _views[host] = _map(host.kv, device)
    view = _views[host]
    return view if view is not None and view.device == device else None


def _pages(runs: list[Run], page_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Device and host page numbers ``runs`` cover, in run order, on ``device``."""
    dev_pages, host_pages = run_positions(runs, page_size)
    return (torch.from_numpy(dev_pages).to(device, non_blocking=True),
            torch.from_numpy(host_pages).to(device, non_blocking=True))


def _layer_pages(view: torch.Tensor, layout: str, layer: int, page_size: int) -> list[torch.Tensor]:
    """Per part, one layer of a host view as (pages, page_size, heads, head_dim), as ``HostKVPool.layer_pages``."""
    if layout == "layer_first":
        return [part[layer].unflatten(0, (-1, page_size)) for part in view]
    if layout == "page_first":
        return [part[:, layer].unflatten(0, (-1, page_size)) for part in view]
    return [part[:, layer] for part in view]


def backup_mapped(dev: DeviceKVPool, view: torch.Tensor, layout: str, runs: list[Run], layer: int | None) -> None:
    """Device -> host through the host pool's view: per layer and part, one gather and one scatter."""
    ps = dev.page_size
    dev_pages, host_pages = _pages(runs, ps, dev.device)
    for li in range(dev.layers) if layer is None else (layer,):
        for dst, src in zip(_layer_pages(view, layout, li, ps), dev.layer_pages(li)):
            dst.index_copy_(0, host_pages, src.index_select(0, dev_pages))


def load_mapped(dev: DeviceKVPool, view: torch.Tensor, layout: str, runs: list[Run], layer: int,
                staging: dict | None) -> None:
    """One layer, host -> device through the host pool's view (``staging`` keeps the page numbers)."""
    staging = {} if staging is None else staging
    if "mapped_pages" not in staging:
        staging["mapped_pages"] = _pages(runs, dev.page_size, dev.device)
    dev_pages, host_pages = staging["mapped_pages"]
    for dst, src in zip(dev.layer_pages(layer), _layer_pages(view, layout, layer, dev.page_size)):
        dst.index_copy_(0, dev_pages, src.index_select(0, host_pages))
