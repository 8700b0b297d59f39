"""The interfaces the controller's parts are built with, and the records that carry them.

The facade (``hicache_fsm.cache.HiCache``) builds each part with the few
collaborators it uses, typed by the interfaces here: the driver's
(``Driver``), the outbox's (``Jobs``), eviction's (``StructureHooks``,
``Refs``), the load-backs' (``Loads``), an ``Allocator``. No part holds the
facade, and a part imports no sibling's class for a type, so this module
imports no part (``tests/test_import_graph.py`` checks both).

Two things change under the parts after they were built, and each is one
shared object: the tree (``reset`` clears it in place) and the runtimes that
attach later (``Attached``: a CP runtime, the storage tier). A runtime that
attaches later is given its collaborators when it attaches: the storage
tier a ``TierContext`` read off the cache (``TierHost``), a CP runtime what
``LayerWriteHost`` names.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Hashable, Iterable, Protocol

import attrs
import torch

from hicache_fsm.errors import StorageLinkError
from hicache_fsm.jobs import Completion, JobKind, TransferJob
from hicache_fsm.radix import RadixTree, TreeNode


class Driver(Protocol):
    """The residency driver's interface (``residency_driver.ResidencyDriver``): the only path of a transition."""

    polls: int
    observed: bool

    def fire(self, node: TreeNode, trigger: str, ctx: object = None, emit: bool = True) -> Any: ...

    def can_fire(self, node: TreeNode, trigger: str) -> bool: ...

    def require_node(self, node: object) -> TreeNode: ...

    def add_child(self, parent: TreeNode, tokens: tuple, namespace: Hashable, start: int) -> TreeNode: ...

    def remove(self, node: TreeNode) -> None: ...

    def touch(self, node: TreeNode, now: int | None = None) -> None: ...

    def walk_splitting(self, tokens: tuple, namespace: Hashable) -> tuple[list[TreeNode], int]: ...

    def add_listener(self, listener: Any) -> None: ...

    def remove_listener(self, listener: Any) -> None: ...

    def notify(self, event: dict) -> None: ...


class Jobs(Protocol):
    """The outbox's interface (``outbox.Outbox``): pending jobs from emission to the completion that ends them."""

    def emit(self, job: TransferJob, nodes: list[TreeNode] | None = None) -> None: ...

    def emit_load(self, job: TransferJob, handle: Any) -> None: ...

    def enrol_split(self, upper: TreeNode) -> None: ...

    def flush(self) -> None: ...

    def is_pending(self, job_id: int) -> bool: ...

    def pending_jobs(self) -> list[TransferJob]: ...

    def has_pending(self, kind: JobKind) -> bool: ...

    def count(self, kinds: frozenset[JobKind] | None = None) -> int: ...

    def handles_of(self, node: TreeNode) -> list: ...

    def defer(self, failures: list) -> None: ...

    def apply_agreed(self, done: list[Completion]) -> tuple[list[Completion], list]: ...


class StructureHooks(Protocol):
    """What the driver tells eviction about every change of a node (``eviction.Eviction``)."""

    def state_changed(self, node: TreeNode, old: str) -> None: ...

    def child_added(self, node: TreeNode) -> None: ...

    def split(self, node: TreeNode, upper: TreeNode) -> None: ...

    def removed(self, node: TreeNode, parent: TreeNode) -> None: ...


class Allocator(Protocol):
    """A pool's slot allocator (``pools.PageAllocator`` and kin)."""

    available_tokens: int
    capacity_tokens: int  # the most it can ever hand out at once

    def alloc(self, num_tokens: int) -> torch.Tensor | None: ...

    def free(self, indices: torch.Tensor) -> None: ...


class Loads(Protocol):
    """The load-back part's interface (``load_back.LoadBacks``) as the outbox and CP writes use it."""

    def start(self, nodes: list[TreeNode], handle: Any) -> TransferJob: ...

    def load_failed(self, nodes: list[TreeNode], handle: Any) -> None: ...


class Refs(Protocol):
    """Eviction's interface as a load-back uses it: lock / pin refs of a chain, and a device eviction pass."""

    def add_locks(self, nodes: Iterable[TreeNode], delta: int) -> None: ...

    def add_pins(self, nodes: Iterable[TreeNode], delta: int) -> None: ...

    def evict(self, num_tokens: int) -> int: ...


class Attached:
    """The runtimes that attach to a cache after its parts were built: a CP layer-write runtime, the storage tier.

    One record shared by the facade and the parts that consult a runtime
    (the driver, eviction, load-backs, the outbox, the residency bindings);
    ``HiCache.cp`` / ``HiCache.storage`` read and write it, so an attach is
    seen by every part at once and no part holds the facade to find them.
    """

    __slots__ = ("cp", "storage")

    def __init__(self, cp: Any = None, storage: Any = None) -> None:
        self.cp = cp
        self.storage = storage

    def storage_attached(self) -> bool:
        """Whether backups to storage may start now (a tier is attached, healthy and open)."""
        return self.storage is not None and self.storage.accepting_backups()


class TierHost(Protocol):
    """What ``TierContext.of`` reads off the cache the storage tier attaches to (once, at attach)."""

    storage: Any  # where ``attach_storage`` puts the tier
    page_size: int
    tree: RadixTree
    driver: Driver
    outbox: Jobs
    cp: Any
    group: Any
    agreement: Any
    host_pool: Any
    draft_host_pool: Any
    host_allocator: Allocator
    check_candidates: bool

    def check_open(self) -> None: ...

    def complete(self, completion: Completion, *, owner: object = None) -> None: ...

    def lock(self, node: TreeNode) -> None: ...

    def unlock(self, node: TreeNode) -> None: ...

    def pin_host(self, node: TreeNode) -> None: ...

    def unpin_host(self, node: TreeNode) -> None: ...

    def evict_host(self, num_tokens: int) -> int: ...

    def register_host_owner(self, source: Callable[[], Iterable[tuple[str, torch.Tensor]]]) -> None: ...

    def register_invariants(self, check: Callable[[], list[str]]) -> None: ...


@attrs.frozen
class TierContext:
    """Everything the storage tier and its prefetch runtime may use of the cache they serve.

    Built once when the tier attaches (``TierContext.of``); the tier keeps
    this record, never the cache. The engine-facing calls it makes on the
    cache's behalf (``complete``, ``lock``, ``pin_host``, ...) are the
    cache's validated ones, handed over as callables.
    """

    page_size: int
    tree: RadixTree
    driver: Driver
    outbox: Jobs
    group: Any  # tp.RankGroup
    agreement: Any  # tp.StepAgreement
    host_pool: Any
    host_allocator: Allocator
    complete: Callable[..., None]
    lock: Callable[[TreeNode], None]
    unlock: Callable[[TreeNode], None]
    pin_host: Callable[[TreeNode], None]
    unpin_host: Callable[[TreeNode], None]
    evict_host: Callable[[int], int]
    register_host_owner: Callable[[Callable[[], Iterable[tuple[str, torch.Tensor]]]], None]
    register_invariants: Callable[[Callable[[], list[str]]], None]
    check_candidates: Callable[[], bool]  # also run the O(N) checks (tests)
    check_open: Callable[[], None]  # the cache's confinement: WrongThread from a thread that does not drive it

    @classmethod
    def of(cls, cache: TierHost) -> "TierContext":
        """The context of ``cache``; ``StorageLinkError`` for a cache storage cannot serve."""
        if cache.cp is not None:
            raise StorageLinkError("a context-parallel cache cannot attach storage")
        if cache.draft_host_pool is not None:
            raise StorageLinkError("storage of draft-model KV is not supported; detach the draft pools first")
        return cls(cache.page_size, cache.tree, cache.driver, cache.outbox, cache.group, cache.agreement,
                   cache.host_pool, cache.host_allocator, cache.complete, cache.lock, cache.unlock, cache.pin_host,
                   cache.unpin_host, cache.evict_host, cache.register_host_owner, cache.register_invariants,
                   lambda: cache.check_candidates, cache.check_open)


class LayerWriteHost(Protocol):
    """What a CP ``LayerWriteRuntime`` reads off the cache it attaches to (as ``cache.cp``), once, at attach."""

    page_size: int
    tree: RadixTree
    counters: Counter[str]
    driver: Driver
    outbox: Jobs
    loads: Loads
    cp: Any
    device_pool: Any
    draft_device_pool: Any
    draft_host_pool: Any
    device_allocator: Any  # a cp.CPPageAllocator
    host_allocator: Allocator
    group: Any  # a tp.RankGroup: whether the ranks' completions are agreed

    def check_open(self) -> None: ...

    def flush(self) -> None: ...

    def evict_host(self, num_tokens: int) -> int: ...

    def register_invariants(self, check: Callable[[], list[str]]) -> None: ...


__all__ = ["Allocator", "Attached", "Driver", "Jobs", "LayerWriteHost", "Loads", "Refs", "StructureHooks",
           "TierContext", "TierHost"]
