"""Checks on engine-owned KV memory before a device pool adopts it.

An adopted pool writes into the engine's tensors through views, so memory the
pool cannot write safely must be refused up front: a sparse or meta tensor has
no plain memory to write, a ``requires_grad`` leaf or an inference-mode tensor refuses in-place writes, and
two views sharing bytes (K and V views of one tensor, two layers over the same
memory) would let the load of one request overwrite another's live KV without
any error. Every refusal is a ``ConfigError`` naming the view.

Overlap is decided exactly, on the bytes each view touches: a view is split
into runs of contiguous bytes (its dimensions sorted by stride, the inner
contiguous ones merged), and the runs of all views on one device must not
intersect. Views whose byte extents do not meet are never split.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hicache_fsm.allocator import PageAllocator
from hicache_fsm.errors import ConfigError

MAX_RUNS = 1 << 24  # runs enumerated per group of views whose extents meet (8 bytes each: 128 MiB at most)


def check_kv_tensor(t: object, what: str) -> torch.Tensor:
    """One engine tensor the pool may read and write in place, or ConfigError saying why not."""
    if not isinstance(t, torch.Tensor):
        raise ConfigError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ConfigError(f"{what}: KV memory must be a dense (strided) tensor, got layout {t.layout}")
    if t.is_meta or t.device.type == "meta":
        raise ConfigError(f"{what}: a meta tensor holds no memory to adopt")
    if t.requires_grad:
        raise ConfigError(f"{what}: KV buffers must not require grad (in-place writes would fail); "
                          "allocate them under torch.no_grad() or call .requires_grad_(False)")
    if t.is_inference():  # made under torch.inference_mode(): in-place updates outside it raise
        raise ConfigError(f"{what}: an inference-mode tensor refuses in-place writes outside inference mode; "
                          "allocate KV buffers under torch.no_grad() instead")
    if t.is_quantized or t.is_nested:
        raise ConfigError(f"{what}: quantized or nested tensors cannot be adopted")
    if not t.dtype.is_floating_point:
        raise ConfigError(f"{what}: KV must be a floating-point tensor, got {t.dtype}")
    return t


def _sequence(value: object, what: str) -> Sequence:
    if isinstance(value, (torch.Tensor, str, bytes)) or not isinstance(value, Sequence):
        raise ConfigError(f"{what}: expected a list or tuple, got {type(value).__name__}")
    return value


def check_adoption(layer_pages: object, *, mla: object, buffers: object, allocator: object) -> None:
    """Everything ``DeviceKVPool.adopt`` is given, checked before anything is built (ConfigError)."""

    if not isinstance(mla, bool):
        raise ConfigError(f"mla must be a bool, got {mla!r}")
    if allocator is not None and not isinstance(allocator, PageAllocator):
        raise ConfigError(f"allocator must be a PageAllocator or None, got {type(allocator).__name__}")
    views: list[tuple[str, torch.Tensor]] = []
    for layer, parts in enumerate(_sequence(layer_pages, "layer_pages")):
        for part, view in enumerate(_sequence(parts, f"layer_pages[{layer}]")):
            views.append((f"layer {layer} part {part}", check_kv_tensor(view, f"layer_pages[{layer}][{part}]")))
    for i, buffer in enumerate(_sequence(buffers, "buffers")):
        check_kv_tensor(buffer, f"buffers[{i}]")
    check_disjoint(views)


def check_disjoint(views: Sequence[tuple[str, torch.Tensor]]) -> None:
    """ConfigError unless no byte is reachable through two views, or twice through one."""
    by_device: dict[torch.device, list[tuple[tuple[int, int], str, torch.Tensor]]] = {}
    for name, t in views:
        if t.numel():
            by_device.setdefault(t.device, []).append((_extent(t), name, t))
    for spans in by_device.values():
        group: list[tuple[str, torch.Tensor]] = []
        group_end = 0
        for (start, end), name, t in sorted(spans, key=lambda span: span[0]):
            if group and start >= group_end:
                _check_group(group)
                group = []
            group_end = end if not group else max(group_end, end)
            group.append((name, t))
        if group:
            _check_group(group)


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """Absolute [first, last) byte addresses of a view's elements (torch strides are never negative)."""
    first = t.data_ptr()
    return first, first + (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()


def _check_group(group: list[tuple[str, torch.Tensor]]) -> None:
    if len(group) == 1 and _nested(group[0][1]):
        return  # alone in its extent and laid out without self-overlap
    runs = [(_runs(t), name) for name, t in group]
    if sum(r.shape[0] for r, _ in runs) > MAX_RUNS:
        names = ", ".join(name for _, name in group)
        raise ConfigError(f"cannot prove that the views of {names} do not overlap (more than {MAX_RUNS} "
                          "separate memory runs); adopt views in a denser layout")
    owners = torch.cat([torch.full((r.shape[0],), i, dtype=torch.int64) for i, (r, _) in enumerate(runs)])
    bounds = torch.cat([r for r, _ in runs])
    order = torch.argsort(bounds[:, 0], stable=True)
    bounds, owners = bounds[order], owners[order]
    clash = (bounds[1:, 0] < torch.cummax(bounds[:-1, 1], 0).values).nonzero()
    if clash.numel():
        at = int(clash[0, 0]) + 1
        prior = int(torch.argmax((bounds[:at, 1] > bounds[at, 0]).to(torch.int8)))
        a, b = runs[int(owners[prior])][1], runs[int(owners[at])][1]
        who = f"{a} and {b} share memory" if a != b else f"{a} reaches some bytes twice"
        raise ConfigError(f"adopted KV views overlap: {who}; every layer and part needs memory of its own")


def _dims(t: torch.Tensor) -> list[tuple[int, int]]:
    """(size, stride in bytes) of the dimensions that matter, outermost (largest stride) first."""
    size = t.element_size()
    return sorted(((n, s * size) for n, s in zip(t.shape, t.stride()) if n > 1), key=lambda d: -d[1])


def _nested(t: torch.Tensor) -> bool:
    """Each stride spans at least every inner dimension: no element reachable twice."""
    span = t.element_size()
    for n, stride in reversed(_dims(t)):
        if stride < span:
            return False
        span = stride * (n - 1) + span
    return True


def _runs(t: torch.Tensor) -> torch.Tensor:
    """(runs, 2) int64 [start, end) byte addresses of the contiguous runs of a view."""
    dims = _dims(t)
    run = t.element_size()
    while dims and dims[-1][1] == run:
        n, stride = dims.pop()
        run = n * stride
    starts = torch.tensor([_extent(t)[0]], dtype=torch.int64)
    count = 1
    for n, stride in dims:
        count *= n
        if count > MAX_RUNS:
            raise ConfigError(f"cannot prove that a view of shape {tuple(t.shape)} does not overlap another "
                              f"(more than {MAX_RUNS} separate memory runs); adopt views in a denser layout")
        starts = (starts[:, None] + torch.arange(n, dtype=torch.int64) * stride).reshape(-1)
    return torch.stack([starts, starts + run], 1)


__all__ = ["MAX_RUNS", "check_adoption", "check_disjoint", "check_kv_tensor"]
