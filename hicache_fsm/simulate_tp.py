"""``simulate --tp N``: every configuration served by N rank processes in lockstep.

Each rank process (torch multiprocessing, a gloo group over 127.0.0.1) builds
the same model and serves the same requests through its own caches, which hold
its shard of the KV heads and agree with the other ranks through the group
(``hicache_fsm.tp``). The engine gathers the served KV of all ranks before
computing, so the answers equal the one-rank run's; after every request the
ranks compare their trees (``rank_view``), and each rank reports its own figures.
"""

from __future__ import annotations

from hicache_fsm.errors import HiCacheError
from hicache_fsm.simulate_config import Options, Tier
from hicache_fsm.simulate_engine import Shard, run_tier
from hicache_fsm.simulate_results import TierResult
from hicache_fsm.simulate_workload import Reference
from hicache_fsm.testing.ranks import run_ranks
from hicache_fsm.tp import RankGroup

GROUP_TIMEOUT_S = 60.0


def _rank_main(rank: int, world: int, pg, options: Options, tiers: list[Tier], reference: Reference, device: str,
               storage_options: dict | None, settle_storage: bool = False) -> list[TierResult]:
    from hicache_fsm.model import TinyModel

    w = options.workload
    model = TinyModel(options.model_layers, options.model_heads, options.model_head_dim, vocab=w.vocab,
                      seed=w.seed, device=device)
    shard = Shard(RankGroup(pg, timeout_s=GROUP_TIMEOUT_S), options.model_heads)
    return [run_tier(tier, w, reference, model, options.page_size, options.layout, device, storage_options,
                     shard=shard, settle_storage=settle_storage) for tier in tiers]


def run_ranks_tiers(options: Options, tiers: list[Tier], reference: Reference, device: str,
                    storage_options: dict | None = None, settle_storage: bool = False) -> list[list[TierResult]]:
    """Every rank's results of every configuration, by rank; HiCacheError if a rank failed."""
    outcomes = run_ranks(_rank_main, options.tp, options, tiers, reference, device, storage_options,
                         settle_storage, timeout_s=3600.0, group_timeout_s=GROUP_TIMEOUT_S)
    failed = [o for o in outcomes if o.status != "ok"]
    if failed:
        o = failed[0]
        why = f"{o.error_type}: {o.error.splitlines()[0] if o.error else ''}" if o.status == "error" \
            else f"died (exit code {o.exitcode})"
        raise HiCacheError(f"rank {o.rank} of {options.tp} failed: {why}")
    return [o.value for o in outcomes]


__all__ = ["run_ranks_tiers"]
