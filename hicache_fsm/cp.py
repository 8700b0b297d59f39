"""Context-parallel (CP) KV layout: which rank stores which page.

Under context parallelism every rank runs the same scheduler over the same
radix tree and hands out the same *logical* device slots (the allocators of
all ranks see the same calls, so they stay identical). The KV of a logical
page, however, lives on exactly one rank, its *owner*, which stores it in its
own, smaller *physical* device pool. Here the ranks are simulated in one
process: each rank is one ``HiCache`` over one ``CPDeviceKVPool``.

Owner function (a pure function of the logical page id, so every rank agrees
without talking to the others): block-cyclic with ``block_pages`` pages per
block::

    owner(p)    = (p // block_pages) % world_size
    physical(p) = (p // (block_pages * world_size)) * block_pages + p % block_pages

``block_pages=1`` is plain round robin (page p belongs to rank p % world_size).
``physical`` numbers a rank's own pages densely from 0, so a rank's physical
pool holds exactly the logical pages it owns.

``CPPageAllocator`` is the logical allocator; besides ``alloc`` it has
``alloc_pages_with_owners``, which hands out pages whose owners follow a given
per-page pattern (a CP load must put every page back on the rank that holds
its host copy).
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from hicache_fsm.allocator import as_index_tensor
from hicache_fsm.errors import BadIndices, ConfigError
from hicache_fsm.pools import DeviceKVPool, HostKVPool, KVPools, PageAllocator, PoolConfig, pages_of


def _positive_int(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{attribute.name} must be a positive int, got {value!r}")


MAX_CP_RANKS = int(torch.iinfo(torch.int8).max) + 1  # a page's owner is kept as an int8 (ranks 0..127)


def _world_size(instance, attribute, value) -> None:
    _positive_int(instance, attribute, value)
    if value > MAX_CP_RANKS:  # a larger rank wrapped negative in the saved owners: its load-backs were refused
        raise ConfigError(f"world_size must be at most {MAX_CP_RANKS} (page owners are kept as int8), got {value}")


@attrs.frozen
class CPLayout:
    """Logical-to-physical page mapping of one rank of a CP group (see module docstring)."""

    world_size: int = attrs.field(validator=_world_size)
    rank: int = attrs.field()
    page_size: int = attrs.field(validator=_positive_int)
    logical_tokens: int = attrs.field(validator=_positive_int)
    block_pages: int = attrs.field(default=1, validator=_positive_int)

    @rank.validator
    def _check_rank(self, attribute, value) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self.world_size:
            raise ConfigError(f"rank must be an int in [0, {self.world_size}), got {value!r}")

    def __attrs_post_init__(self) -> None:
        if self.logical_tokens % self.page_size:
            raise ConfigError(f"logical_tokens {self.logical_tokens} is not a multiple of page_size {self.page_size}")

    # ------------------------------------------------------------------ sizes

    @property
    def logical_pages(self) -> int:
        return self.logical_tokens // self.page_size

    @property
    def physical_pages(self) -> int:
        """Logical pages this rank owns (= pages of its physical pool)."""
        return int((self.owner_for_logical_pages(torch.arange(self.logical_pages)) == self.rank).sum())

    @property
    def physical_tokens(self) -> int:
        return self.physical_pages * self.page_size

    # ------------------------------------------------------------------ owner function

    def owner_for_logical_pages(self, pages: torch.Tensor) -> torch.Tensor:
        """Owner rank of each logical page id (int64)."""
        pages = torch.as_tensor(pages, dtype=torch.int64)
        return (pages // self.block_pages) % self.world_size

    def page_owners(self, indices: torch.Tensor) -> torch.Tensor:
        """One owner per page of page-aligned logical token indices, as int8 on the CPU."""
        pages = pages_of(indices, self.page_size, self.logical_tokens, "logical indices")
        return self.owner_for_logical_pages(pages).to(torch.int8)

    def _logical(self, indices) -> torch.Tensor:
        """``indices`` as int64 logical token slots (on their device), refused unless in ``[0, logical_tokens)``.

        Every rank must refuse the same slot: an unchecked one would be
        "owned elsewhere" on some ranks and silently skipped there.
        """
        checked = as_index_tensor(indices, "logical indices")
        if checked.numel() and (int(checked.min()) < 0 or int(checked.max()) >= self.logical_tokens):
            raise BadIndices(f"logical indices out of range [0, {self.logical_tokens})")
        return indices.to(torch.int64) if isinstance(indices, torch.Tensor) else checked

    def owned_by_this_rank(self, indices: torch.Tensor) -> torch.Tensor:
        """Bool per logical token index: does this rank store it?"""
        idx = self._logical(indices)
        return self.owner_for_logical_pages(idx // self.page_size) == self.rank

    def logical_locs_to_physical(self, indices: torch.Tensor) -> torch.Tensor:
        """Physical slots (in this rank's pool) of logical token indices this rank owns."""
        idx = self._logical(indices)
        if idx.numel() == 0:
            return idx.new_empty(0)
        pages = idx // self.page_size
        if not bool((self.owner_for_logical_pages(pages) == self.rank).all()):
            raise BadIndices(f"rank {self.rank} was asked for the physical slots of pages it does not own")
        b, n = self.block_pages, self.world_size
        physical_pages = (pages // (b * n)) * b + pages % b
        return physical_pages * self.page_size + idx % self.page_size

    # ------------------------------------------------------------------ engine helpers

    def scatter_kv(self, pool: DeviceKVPool, logical: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   layer: int | None = None) -> None:
        """Engine side: store the owned tokens of computed KV into this rank's physical pool.

        ``k``/``v`` cover every token of ``logical``: (layers, n, heads, head_dim),
        or (n, heads, head_dim) for one ``layer``.
        """
        logical = self._logical(logical)
        mask = self.owned_by_this_rank(logical)
        dim = 1 if layer is None else 0  # the token dimension of k and v
        for t in (k, v):
            if t is not None and (not isinstance(t, torch.Tensor) or t.dim() <= dim or t.shape[dim] != mask.numel()):
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise BadIndices(f"k/v must have {mask.numel()} tokens in dimension {dim}, got {got}")
        phys = self.logical_locs_to_physical(logical[mask])
        owned = [None if t is None else (t[:, mask] if layer is None else t[mask]) for t in (k, v)]
        pool.write(phys, layer, *owned)

    def gather_kv(self, pool: DeviceKVPool, logical: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V (layers, owned, heads, head_dim) of the owned tokens of ``logical``."""
        logical = self._logical(logical)
        mask = self.owned_by_this_rank(logical)
        return pool.read(self.logical_locs_to_physical(logical[mask]))


class CPPageAllocator(PageAllocator):
    """Logical page allocator of a CP rank; can replay a per-page owner pattern."""

    def __init__(self, layout: CPLayout) -> None:
        super().__init__(layout.logical_tokens, layout.page_size)
        self.layout = layout

    def alloc_pages_with_owners(self, page_owners) -> torch.Tensor | None:
        """Token indices of free pages whose owners are ``page_owners``, page by page.

        Takes the lowest free pages of each owner (deterministic, so every rank
        gets the same answer). Returns None, changing nothing, when some owner
        has too few free pages.
        """
        owners = as_index_tensor(page_owners, "page owners")  # a float owner is refused, not truncated
        if owners.numel() and (int(owners.min()) < 0 or int(owners.max()) >= self.layout.world_size):
            raise BadIndices(f"page owners must be ranks in [0, {self.layout.world_size})")
        need = owners.numel()
        if need == 0:
            return torch.empty(0, dtype=torch.int64)
        if need > self.free_pages:
            return None
        free = self._free_array()
        free_owner = self.layout.owner_for_logical_pages(torch.from_numpy(free)).numpy()
        wanted = owners.numpy()
        chosen = np.empty(need, dtype=np.int64)
        taken = np.zeros(free.size, dtype=bool)
        for rank in np.unique(wanted).tolist():
            want = np.flatnonzero(wanted == rank)
            have = np.flatnonzero(free_owner == rank)
            if have.size < want.size:
                return None
            pick = have[: want.size]
            chosen[want] = free[pick]
            taken[pick] = True
        self._claim(chosen, free[~taken])
        return self._slots_of_claimed(chosen, run=False)


class CPDeviceKVPool(DeviceKVPool):
    """One rank's physical device pool; its ``allocator`` hands out *logical* slots.

    ``kv`` holds only the pages this rank owns (``layout.physical_tokens``
    slots). Target and draft pools of a rank share one logical allocator.
    """

    def __init__(self, shape, layout: CPLayout, device: torch.device | str | None = None,
                 allocator: CPPageAllocator | None = None) -> None:
        if layout.physical_tokens == 0:
            raise ConfigError(f"rank {layout.rank} owns no page of {layout.logical_pages}; make the pool larger")
        if allocator is not None and allocator.layout != layout:
            raise ConfigError("a shared CP allocator must use the pool's layout")
        super().__init__(shape, layout.physical_tokens, layout.page_size, device)
        self.layout = layout
        self.allocator = allocator if allocator is not None else CPPageAllocator(layout)


def build_cp_pools(config: PoolConfig, world_size: int, rank: int, block_pages: int = 1) -> KVPools:
    """Pools of one CP rank: ``config.device_tokens`` is the *logical* device size.

    The host pools (target and draft) are this rank's own, sized as ``config`` says.
    """
    layout = CPLayout(world_size, rank, config.page_size, config.device_tokens, block_pages)
    host_tokens = config.validate(backed_device_tokens=layout.physical_tokens)
    allocator = CPPageAllocator(layout)
    device = CPDeviceKVPool(config.shape, layout, config.device, allocator)
    host = HostKVPool(config.shape, host_tokens, config.page_size, config.host_layout, config.pin_memory)
    draft_device = draft_host = None
    if config.draft_shape is not None:
        draft_device = CPDeviceKVPool(config.draft_shape, layout, config.device, allocator)
        draft_host = HostKVPool(config.draft_shape, host_tokens, config.page_size, config.host_layout,
                                config.pin_memory)
    return KVPools(config, device, host, draft_device, draft_host)


__all__ = ["CPLayout", "CPPageAllocator", "CPDeviceKVPool", "build_cp_pools"]
