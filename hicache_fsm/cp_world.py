"""Simulated context-parallel worlds: one ``HiCache`` and layer-write runtime per CP rank.

Built on the facade (like ``simulate``), for tests, the explorer's CP adapter
and the docs' examples; an engine builds its own ranks, one a process, with
``build_cp_rank(..., group=...)``. Ranks of one world in one process agree on
nothing: each applies its own completions, so a copy failed on one rank only
leaves the ranks apart (docs/cp-writes.md).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from hicache_fsm.cache import HiCache
from hicache_fsm.cp import CPLayout, build_cp_pools
from hicache_fsm.errors import ConfigError
from hicache_fsm.layer_write import LayerWriteRuntime
from hicache_fsm.machine import compile_machine
from hicache_fsm.spec import load_builtin
from hicache_fsm.tp import PURPOSE_BUILD, RankGroup


@attrs.frozen
class CPRank:
    """One simulated CP rank: its layout, pools, cache and layer-write runtime."""

    layout: CPLayout
    pools: object
    cache: object
    writes: LayerWriteRuntime


def build_cp_rank(pool_config, world_size: int, rank: int, block_pages: int = 1, cache_config=None,
                  executor_factory: Callable | None = None, group=None) -> CPRank:
    """Build one rank: ``pool_config.device_tokens`` is the logical device size.

    ``executor_factory(pools)`` makes the executor (a ``TorchExecutor`` over the pools by default).
    ``group``: the ``tp.RankGroup`` (or process group) of the CP ranks when each runs in its own
    process: completions are then agreed, so a copy that fails on one rank fails the write on all. ``rank`` and
    ``world_size`` must be the group's (a rank built as another would own another's pages: KV no rank copies);
    otherwise every rank raises ``ConfigError``.
    """
    group = RankGroup.of(group)
    own = group.solo or (rank, world_size) == (group.rank, group.size)
    if not group.all_true(own, PURPOSE_BUILD):  # every rank refuses together: none waits in a collective alone
        raise ConfigError(
            f"CP rank {rank} of {world_size}, but this process is rank {group.rank} of {group.size} in its group: "
            f"pass the group's rank and size" if not own else
            "another rank's CP rank or world size is not its rank and size in the group: every rank refused")
    pools = build_cp_pools(pool_config, world_size, rank, block_pages)
    executor = executor_factory(pools) if executor_factory is not None else None
    cache = HiCache(pools.device, pools.host, cache_config, executor, pools.draft_device, pools.draft_host,
                    dispatcher=compile_machine(load_builtin("residency")), group=group)
    return CPRank(pools.device.layout, pools, cache, LayerWriteRuntime(cache))


def build_cp_world(pool_config, world_size: int, block_pages: int = 1, cache_config=None,
                   executor_factory: Callable | None = None) -> list[CPRank]:
    """Every rank of a ``world_size`` CP world (``build_cp_rank`` for each)."""
    return [build_cp_rank(pool_config, world_size, r, block_pages, cache_config, executor_factory)
            for r in range(world_size)]
