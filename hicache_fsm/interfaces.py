"""What each part of the controller may use of the cache that composes it, as ``typing.Protocol``s.

The facade (``hicache_fsm.cache.HiCache``) builds the parts and hands each
one itself, typed as the narrow protocol below: a reader of ``eviction.py``
sees in ``EvictionHost`` everything eviction may touch, without reading the
facade, and no part imports the facade (``tests/test_import_graph.py``).
Siblings are typed by their interfaces here too (``Driver``, ``Jobs``), so
this module imports no part and a part imports no sibling's class for a type.

The tree, the storage tier and a CP runtime are read through the host on
every use because they are replaced (``reset`` builds a new tree) or attached
after construction (``attach_storage``, a ``LayerWriteRuntime``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Hashable, Iterable, Protocol

import torch

from hicache_fsm.config import CacheConfig
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

    def alloc(self, num_tokens: int) -> torch.Tensor | None: ...

    def free(self, indices: torch.Tensor) -> None: ...


class DriverHost(Protocol):
    """What ``ResidencyDriver`` uses: the tree and who hears of its changes; jobs go to the outbox."""

    tree: RadixTree
    eviction: StructureHooks
    outbox: Jobs
    cp: Any  # a CP layer-write runtime, or None
    storage: Any  # the storage tier (keys of H2S jobs), or None
    draft_host_pool: Any


class EvictionHost(Protocol):
    """What ``Eviction`` uses: the tree, the driver and outbox, the host allocator, the executor."""

    config: CacheConfig
    tree: RadixTree
    counters: Counter[str]
    driver: Driver
    outbox: Jobs
    executor: Any
    cp: Any
    host_allocator: Allocator

    def executor_can_block(self) -> bool: ...


class LoadHost(Protocol):
    """What ``LoadBacks`` uses; ``flush`` is what a ``LoadHandle`` calls before its first wait."""

    config: CacheConfig
    tree: RadixTree
    counters: Counter[str]
    driver: Driver
    outbox: Jobs
    eviction: Any  # add_locks / add_pins / evict
    cp: Any
    device_allocator: Allocator
    group: Any  # tp.RankGroup
    draft_host_pool: Any

    def flush(self) -> None: ...


class OutboxHost(Protocol):
    """What ``Outbox`` uses to apply completions: the driver, loads (failed loads), agreement, runtimes."""

    tree: RadixTree
    counters: Counter[str]
    driver: Driver
    loads: Any  # load_failed
    executor: Any
    storage: Any
    cp: Any
    acks: Any
    agreement: Any
    token_bytes: int
    storage_attached: bool


class TierHost(Protocol):
    """What the storage tier and its prefetch runtime use of the cache they serve."""

    page_size: int
    tree: RadixTree
    driver: Driver
    outbox: Jobs
    storage: Any
    cp: Any
    group: Any
    agreement: Any
    host_pool: Any
    draft_host_pool: Any
    host_allocator: Allocator
    check_candidates: bool

    def check_open(self) -> None: ...

    def complete(self, completion: Completion, *, owner: object = None) -> None: ...

    def pending_jobs(self) -> list[TransferJob]: ...

    def storage_transfers_in_flight(self) -> int: ...

    def lock(self, node: TreeNode) -> None: ...

    def unlock(self, node: TreeNode) -> None: ...

    def pin_host(self, node: TreeNode) -> None: ...

    def unpin_host(self, node: TreeNode) -> None: ...

    def evict_host(self, num_tokens: int) -> int: ...

    def register_host_owner(self, source: Callable[[], Iterable[tuple[str, torch.Tensor]]]) -> None: ...

    def register_invariants(self, check: Callable[[], list[str]]) -> None: ...


class LayerWriteHost(Protocol):
    """What a CP ``LayerWriteRuntime`` uses of the cache it attaches to (as ``cache.cp``)."""

    page_size: int
    tree: RadixTree
    counters: Counter[str]
    driver: Driver
    outbox: Jobs
    loads: Any  # start
    cp: Any
    device_pool: Any
    draft_device_pool: Any
    draft_host_pool: Any
    device_allocator: Any  # a cp.CPPageAllocator
    host_allocator: Allocator

    def check_open(self) -> None: ...

    def flush(self) -> None: ...

    def evict_host(self, num_tokens: int) -> int: ...

    def load_back(self, node: TreeNode) -> Any: ...

    def register_invariants(self, check: Callable[[], list[str]]) -> None: ...


__all__ = ["Allocator", "Driver", "DriverHost", "EvictionHost", "Jobs", "LayerWriteHost", "LoadHost",
           "OutboxHost", "StructureHooks", "TierHost"]
