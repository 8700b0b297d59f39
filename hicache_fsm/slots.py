"""Checks on the slot indices an engine hands the cache, and on the pools and machine it is built over.

An engine passes device slot indices to ``insert`` and ``free_device``; they
must be a 1-D int64 CPU tensor of whole pages that ``alloc_device`` handed
out and nobody handed back yet (that last part: ``engine_pages``). Each check
raises ``BadIndices`` (or ``ConfigError`` for pools and the machine) naming
the first thing wrong, before the cache changes anything.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hicache_fsm.errors import BadIndices, ConfigError
from hicache_fsm.pools import DeviceKVPool, HostKVPool
from hicache_fsm.radix import TreeNode, slot_tensor
from hicache_fsm.spec import Spec

_EMPTY = torch.empty(0, dtype=torch.int64)
_INT64 = np.dtype(np.int64)
DISPATCH_METHODS = ("fire", "can_fire", "add_listener")  # what the cache calls on its residency machine


def page_ids(indices: torch.Tensor, page_size: int) -> list[int]:
    """Page id of each page of a page-aligned index tensor."""
    return (indices.numpy()[::page_size] // page_size).tolist()


def node_page_ids(node: TreeNode, page_size: int) -> list[int]:
    """Page ids of a node's device slots (read from its compact form: no tensor is built)."""
    slots = node.device_slots
    if type(slots) is bytes:
        return np.frombuffer(slots, dtype=np.int64).tolist()
    return page_ids(slots, page_size)


def device_slot_tensor(parts: list, allocator: Any) -> torch.Tensor:
    """One int64 slot tensor of nodes' compact slots (``TreeNode.device_slots``), in order (a fresh copy)."""
    if not parts:
        return _EMPTY
    try:
        joined = parts[0] if len(parts) == 1 else b"".join(parts)  # a tensor part (kept as given) refuses to join
    except TypeError:
        return torch.cat([slot_tensor(p, allocator) for p in parts])
    return slot_tensor(joined, allocator)


def check_index_tensor(indices: object, length: int | None, page_size: int, allocator: Any) -> list[int]:
    """Type, dtype, device, length and page alignment of an engine index tensor; returns its page ids."""
    return check_index_pages(indices, length, page_size, allocator).tolist()


def check_index_pages(indices: object, length: int | None, page_size: int, allocator: Any) -> np.ndarray:
    """``check_index_tensor``, returning the page ids as an int64 array (what a node keeps, packed).

    A plain CPU tensor is read through its numpy view first: its dtype and
    rank are then numpy attributes, a tenth of torch's; anything else (or a
    tensor numpy cannot view) takes the checks in order, which name the fault.
    """
    if type(indices) is torch.Tensor:
        try:
            a = indices.numpy()  # refused off the CPU (and for a negative-bit view)
        except (TypeError, RuntimeError):
            a = None
        if a is not None and a.ndim == 1 and (a.dtype is _INT64 or a.dtype == _INT64):
            if a.size == length and length:  # the usual case: whole pages of the expected length, one call
                pages = allocator.whole_pages(a)
                if pages is not None:
                    return pages
            return _whole_pages(indices, a, length, page_size, allocator)  # empty, or the fault named
    if not isinstance(indices, torch.Tensor):
        raise BadIndices(f"device indices must be a torch.Tensor, got {type(indices).__name__}")
    if indices.dtype != torch.int64 or indices.dim() != 1:
        raise BadIndices(
            f"device indices must be a 1-D int64 tensor, got {indices.dtype} with shape {tuple(indices.shape)}"
        )
    if not indices.is_cpu:
        raise BadIndices(f"slot indices are kept on the CPU; got a tensor on {indices.device}")
    return _whole_pages(indices, None, length, page_size, allocator)


def _whole_pages(indices: torch.Tensor, a: np.ndarray | None, length: int | None, page_size: int,
                 allocator: Any) -> np.ndarray:
    """The length and page checks of ``check_index_pages`` on a 1-D int64 CPU tensor (``a``: its numpy view, or
    None: viewed once the length passed, as before the fast path)."""
    n = indices.numel() if a is None else a.size
    if length is not None and n != length:
        raise BadIndices(f"expected {length} device indices (one per token), got {n}")
    if n % page_size:
        raise BadIndices(f"{n} indices is not a whole number of pages of {page_size} tokens")
    if not n:
        return np.empty(0, dtype=np.int64)
    if a is None:
        a = indices.numpy()
    pages = allocator.whole_pages(a)
    if pages is not None:
        return pages
    raise BadIndices(f"device indices {allocator.not_whole_pages_reason(a)}")


def _check_pool(name: str, pool: object, kind: type) -> None:
    if not isinstance(pool, kind):
        raise ConfigError(f"{name} must be a {kind.__name__} (hicache_fsm.pools), got {type(pool).__name__}")


def check_pools(device_pool: Any, host_pool: Any, draft_device_pool: Any, draft_host_pool: Any) -> None:
    """Refuse pool combinations that cannot work (the reference raises on the same ones); types first, so a
    wrong object is named instead of failing on an attribute it lacks."""
    _check_pool("device_pool", device_pool, DeviceKVPool)
    _check_pool("host_pool", host_pool, HostKVPool)
    if draft_device_pool is not None:
        _check_pool("draft_device_pool", draft_device_pool, DeviceKVPool)
    if draft_host_pool is not None:
        _check_pool("draft_host_pool", draft_host_pool, HostKVPool)
    if device_pool.page_size != host_pool.page_size:
        raise ConfigError(f"device and host pools must use the same page size "
                          f"({device_pool.page_size} != {host_pool.page_size})")
    if (draft_device_pool is None) != (draft_host_pool is None):
        raise ConfigError("draft_device_pool and draft_host_pool must be given together (a draft model's KV "
                          "is backed up like the target's)")
    if draft_device_pool is not None:
        if {draft_device_pool.page_size, draft_host_pool.page_size} != {device_pool.page_size}:
            raise ConfigError("draft pools must use the target pools' page size (one tree indexes both)")


def check_dispatcher(dispatcher: object) -> None:
    """None (the cache compiles its own), or a residency machine: a ``CompiledMachine``, or an object with its
    interface over the residency spec (``TransitionsDispatcher``); anything else would fail on first use."""
    if dispatcher is None:
        return
    spec = getattr(dispatcher, "spec", None)
    if isinstance(spec, Spec) and spec.name == "residency" \
            and all(callable(getattr(dispatcher, m, None)) for m in DISPATCH_METHODS):
        return
    of = f" of the {spec.name!r} spec" if isinstance(spec, Spec) else ""
    raise ConfigError(f"dispatcher must be a CompiledMachine of the residency spec "
                      f"(compile_machine(load_builtin('residency'))), got {type(dispatcher).__name__}{of}")


__all__ = [
    "check_dispatcher", "check_index_pages", "check_index_tensor", "check_pools", "device_slot_tensor",
    "node_page_ids", "page_ids",
]


def bind_pools(cache: object, pools: tuple[Any, ...]) -> tuple[Any, ...]:
    """Bind the allocators of ``pools`` (None skipped; a shared one once) to ``cache``: all of them or none.

    Returns the allocators, for ``unbind_pools`` when the cache closes.
    """
    allocators: list[Any] = []
    for pool in pools:
        if pool is not None and all(pool.allocator is not a for a in allocators):
            allocators.append(pool.allocator)
    bound: list[Any] = []
    try:
        for allocator in allocators:
            allocator.bind_cache(cache)
            bound.append(allocator)
    except ConfigError:
        unbind_pools(cache, tuple(bound))
        raise
    return tuple(allocators)


def unbind_pools(cache: object, allocators: tuple[Any, ...]) -> None:
    for allocator in allocators:
        allocator.unbind_cache(cache)
