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
None where it cannot be had: the caller then copies with memcpys. The pools
are torch's pinned allocations (``cudaHostAlloc``), which unified addressing
maps into every GPU at their host address; a view is made once per pool and
GPU and checked before it is used: the pool must be pinned, torch must not
copy instead of viewing, and bytes a kernel reads through the view must
equal the host's.
"""

from __future__ import annotations

import weakref

import torch

from hicache_fsm.page_index import Run, gather_pages, index_on, run_positions, scatter_pages
from hicache_fsm.pools import DeviceKVPool, HostKVPool, layer_of

PROBE_BYTES = 256

_views: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # host pool -> {device: view of its kv or None}


class _PinnedBytes:
    """The first ``nbytes`` pinned bytes of a tensor's storage, offered to torch as CUDA memory."""

    def __init__(self, tensor: torch.Tensor, nbytes: int) -> None:
        self.tensor = tensor  # the view's deleter keeps this object, and so the host memory, alive
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (tensor.untyped_storage().data_ptr(), False), "strides": None,
                                         "version": 3}


def _bytes_on(tensor: torch.Tensor, nbytes: int, device: torch.device) -> torch.Tensor | None:
    """A uint8 CUDA tensor on ``device`` over the first ``nbytes`` of ``tensor``'s storage, or None.

    Some torch versions check the pointer and copy memory that belongs to
    another GPU to ``device`` (a copy is refused here), others take the
    address as it is.
    """
    try:
        flat = torch.as_tensor(_PinnedBytes(tensor, nbytes), device=device)
    except (RuntimeError, TypeError, ValueError):  # a pointer CUDA does not know, or no CUDA at all
        return None
    return flat if flat.data_ptr() == tensor.untyped_storage().data_ptr() else None


def _map(tensor: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """The checked view of ``tensor``'s pinned storage on ``device``, as ``tensor`` (shape, strides, dtype)."""
    storage = tensor.untyped_storage()
    probe = min(PROBE_BYTES, storage.nbytes())
    if not tensor.is_pinned() or not probe:  # torch allocated it pinned: mapped at its host address (UVA)
        return None
    head = _bytes_on(tensor, probe, device)  # a small view first: a refused copy costs nothing
    if head is None:
        return None
    torch.cuda.synchronize(device)  # no copy in flight may change the probed bytes
    host_bytes = torch.empty(0, dtype=torch.uint8).set_(storage)
    if not torch.equal(head.clone().cpu(), host_bytes[:probe]):
        return None
    flat = _bytes_on(tensor, storage.nbytes(), device)
    if flat is None:
        return None
    return flat.view(tensor.dtype).as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())


def host_view(host: HostKVPool, device: torch.device) -> torch.Tensor | None:
    """A CUDA tensor on ``device`` over the same pinned memory as ``host.kv`` (same shape and strides), or None."""
    if device.type != "cuda":
        return None
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    views = _views.setdefault(host, {})  # pinned memory is portable: each GPU gets its own view
    if device not in views:
        views[device] = _map(host.kv, device)
    return views[device]


def _pages(runs: list[Run], page_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Device and host page numbers ``runs`` cover, in run order, on ``device``."""
    dev_pages, host_pages = run_positions(runs, page_size)
    return index_on(dev_pages, device), index_on(host_pages, device)


def backup_mapped(dev: DeviceKVPool, view: torch.Tensor, layout: str, runs: list[Run], layer: int | None) -> None:
    """Device -> host through the host pool's view: per layer and part, one gather and one scatter."""
    ps = dev.page_size
    dev_pages, host_pages = _pages(runs, ps, dev.device)
    for li in range(dev.layers) if layer is None else (layer,):
        for dst, src in zip((layer_of(part, layout, li, ps) for part in view), dev.layer_pages(li)):
            scatter_pages(dst, host_pages, gather_pages(src, dev_pages))


def load_mapped(dev: DeviceKVPool, view: torch.Tensor, layout: str, runs: list[Run], layer: int,
                staging: dict | None) -> None:
    """One layer, host -> device through the host pool's view (``staging`` keeps the page numbers)."""
    staging = {} if staging is None else staging
    if "mapped_pages" not in staging:
        staging["mapped_pages"] = _pages(runs, dev.page_size, dev.device)
    dev_pages, host_pages = staging["mapped_pages"]
    for dst, src in zip(dev.layer_pages(layer), (layer_of(part, layout, layer, dev.page_size) for part in view)):
        scatter_pages(dst, dev_pages, gather_pages(src, host_pages))
