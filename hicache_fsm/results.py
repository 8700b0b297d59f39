"""What the cache hands back to the engine: match results, load-backs, inserts and load waits.

Plain records (``attrs``) plus ``LoadHandle``, the per-layer wait of one
load-back. They depend on nothing but jobs and errors, so every part of the
controller (and the storage tier, and CP layer writes) can build them without
importing the ``HiCache`` facade.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import attrs
import torch

from hicache_fsm.errors import BadIndices, HiCacheError
from hicache_fsm.jobs import LayerWait
from hicache_fsm.radix import TreeNode
from hicache_fsm.records import slot_setters


class LoadCancelled(HiCacheError):
    """``wait`` on a load that ``reset`` dropped before it was started."""


class Flushable(Protocol):
    def flush(self) -> None: ...


@attrs.frozen
class DeviceGrant:
    """Context of ``revive``: the device slots the engine hands over."""

    device_indices: torch.Tensor


class LoadHandle:
    """Per-layer wait of one load-back.

    Binds to the executor's wait when the load's batch is started (the first
    ``wait`` flushes ``owner``, the cache, if needed). It also waits for loads
    of ancestors that were still in flight when this load started, so reading
    layer ``i`` of the whole prefix is safe once ``wait(i)`` returns. A load
    retried after a failure re-binds to the retry's batch.
    """

    def __init__(self, owner: Flushable, deps: Sequence["LoadHandle"] = ()) -> None:
        self._owner = owner
        self._wait: LayerWait | None = None
        self._deps = tuple(deps)
        self.cancelled = False

    @property
    def deps(self) -> tuple["LoadHandle", ...]:
        return self._deps

    @property
    def bound_wait(self) -> LayerWait | None:
        """The executor's wait of the batch that carries this load; None until it is started."""
        return self._wait

    def bind(self, wait: LayerWait) -> None:
        """Called by the outbox when the batch carrying this load was submitted."""
        self._wait = wait

    def unbind(self) -> None:
        """Called when the load is re-queued (a retry): the next ``wait`` flushes again."""
        self._wait = None

    def replica(self, owner: Flushable, deps: Sequence["LoadHandle"], wait: LayerWait | None) -> "LoadHandle":
        """A copy waiting for ``owner`` (a forked cache) with the given deps and wait (the explorer's forks)."""
        new = LoadHandle(owner, deps)
        new._wait = wait
        new.cancelled = self.cancelled
        return new

    def wait(self, layer: int) -> None:
        """Block the forward pass until ``layer`` of this load (and of loading ancestors) is on the device."""
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:  # before anything is started
            raise BadIndices(f"layer must be an int >= 0, got {layer!r}")
        for dep in self._deps:
            dep.wait(layer)
        if self._wait is None and not self.cancelled:
            self._owner.flush()
        if self._wait is None:
            raise LoadCancelled("this load was dropped by reset() before it started")
        self._wait.wait(layer)

    def done(self) -> bool:
        return self._wait is not None and self._wait.done() and all(d.done() for d in self._deps)


@attrs.frozen(init=False)
class MatchResult:
    """What ``match_prefix`` found.

    ``device_indices`` cover the matched prefix that is on the device (or being
    loaded); ``host_hit_length`` tokens after it are only on the host and can be
    loaded back from ``last_host_node``. ``loads`` are the in-flight loads
    that cover part of ``device_indices``: ``wait(layer)`` before reading a layer.
    """

    device_indices: torch.Tensor
    last_device_node: TreeNode
    last_host_node: TreeNode
    host_hit_length: int
    loads: tuple[LoadHandle, ...] = ()

    def __init__(self, device_indices: torch.Tensor, last_device_node: TreeNode, last_host_node: TreeNode,
                 host_hit_length: int, loads: tuple[LoadHandle, ...] = ()) -> None:
        set_indices, set_device_node, set_host_node, set_host_hit, set_loads = _MATCH_RESULT_FIELDS
        set_indices(self, device_indices)
        set_device_node(self, last_device_node)
        set_host_node(self, last_host_node)
        set_host_hit(self, host_hit_length)
        set_loads(self, loads)

    @property
    def device_hit_length(self) -> int:
        return int(self.device_indices.numel())

    def wait(self, layer: int) -> None:
        """Wait until ``layer`` of every load covering ``device_indices`` has landed (no-op if none)."""
        for handle in self.loads:
            handle.wait(layer)


_MATCH_RESULT_FIELDS = slot_setters(MatchResult, "device_indices", "last_device_node", "last_host_node",
                                    "host_hit_length", "loads")


@attrs.frozen
class LoadBack:
    """A started load-back: device slots of the loaded chain (top-down) and its wait handle."""

    device_indices: torch.Tensor
    nodes: tuple[TreeNode, ...]
    handle: LoadHandle

    @property
    def last_node(self) -> TreeNode:
        return self.nodes[-1]

    def wait(self, layer: int) -> None:
        self.handle.wait(layer)


@attrs.frozen(init=False)
class InsertResult:
    node: TreeNode
    cached_tokens: int  # tokens that were already in the tree (engine slots there were freed)
    new_tokens: int

    def __init__(self, node: TreeNode, cached_tokens: int, new_tokens: int) -> None:
        set_node, set_cached, set_new = _INSERT_RESULT_FIELDS
        set_node(self, node)
        set_cached(self, cached_tokens)
        set_new(self, new_tokens)


_INSERT_RESULT_FIELDS = slot_setters(InsertResult, "node", "cached_tokens", "new_tokens")
