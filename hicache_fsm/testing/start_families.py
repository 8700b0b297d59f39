"""Two default families of ``hicache-fsm check`` that begin from a fixed start, each for a bug class no other reaches.

Why a start. Both bugs show only past the other families' bounds (a node split that nothing stamps, a CP rank
whose host is full of its own pages while another's has room); exploring to that depth from the empty cache costs
thousands of states, while a few fixed steps (``Bounds.start``, each checked) put the search where the bug would
act, and a short breadth-first search from there tries everything the engine and the executors may do next.

- ``storage/prefetch_split``: a prefetch whose fetched page has arrived, not yet polled in, while another prompt
  is cached. The engine may now insert a prompt the fetched page is a prefix of, so the poll lands the page
  partway into a node: a split that no insert or lookup stamps (theirs stamp the path they split), whose upper
  half must keep its recency (``order_agrees``), and fetched pages that duplicate cached ones.
- ``cp/2_ranks_host_full``: two CP ranks of one-page nodes (owned round robin), rank 1's host full of its own
  pages and rank 0's with room. A backup of a page rank 1 owns must evict host KV on *every* rank (the group's
  largest shortfall), or the ranks' trees part (``cp_group_host_copy`` in ``testing.cp``).

``testing.protocol.default_families`` lists both; this module imports neither it nor the facade (the storage
family takes its factory, ``protocol_factory``, as an argument).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["CP_HOST_FULL_START", "PREFETCH_SPLIT_START", "cp_host_full_family", "prefetch_split_family"]

# A cached sibling (2,), another instance stores page (1,), a prefetch of (1,): its hit query and transfer run.
PREFETCH_SPLIT_START = (("insert", ((2,),)), ("store_remote", ((1,),)), ("prefetch", ((1,),)),
                        ("complete_storage", (0,)), ("complete_storage", (0,)))

# Page 0 is rank 0's, page 1 rank 1's. (1,) takes page 0 and stays on the device (re-inserted before each
# eviction); (2,) and (3,) take page 1 in turn, are written to rank 1's host and evicted from the device:
# rank 1's two host pages hold them, rank 0's hold (1,) and one free page, and page 1 is free.
CP_HOST_FULL_START = (("insert", ((1,),)), ("complete_job", (0,)), ("insert", ((2,),)), ("complete_job", (0,)),
                      ("insert", ((1,),)), ("evict", (1,)), ("insert", ((3,),)), ("complete_job", (0,)),
                      ("insert", ((1,),)), ("evict", (1,)))


def _start(steps: tuple) -> tuple:
    from hicache_fsm.testing.checks import Step

    return tuple(Step(op, args) for op, args in steps)


def prefetch_split_family(factory: Callable[[Any], Any]) -> tuple[str, Any, Callable[[Any], Any]]:
    """From ``PREFETCH_SPLIT_START``, every state within three steps, on a three-page device under
    ``write_through_selective`` (no backup is due: the host keeps room for the fetched page). Locks, pins,
    backups, load-backs, failed jobs, other stores and a second prefetch are left out (the other families
    explore those): this family is about where the prefetch in flight lands."""
    from hicache_fsm.testing.explorer import Bounds

    return ("storage/prefetch_split",
            Bounds(nodes=3, device_pages=3, host_pages=2, alphabet=2, max_len=2, max_locks=0, max_pins=0,
                   redeliver=False, storage=True, write_policy="write_through_selective",
                   omit=("backup", "fail_job", "load_back", "store_remote", "prefetch"),
                   start=_start(PREFETCH_SPLIT_START), max_depth=3),
            factory)


def _two_ranks_one_layer(bounds: Any) -> Any:
    """Two CP ranks of one target layer and no draft model: a write is one copy job, so a start stays short."""
    from hicache_fsm.testing.cp import CPAdapter

    return CPAdapter(world_size=2, device_pages=bounds.device_pages, host_pages=bounds.host_pages, layers=1,
                     draft_layers=0, write_policy=bounds.write_policy)


def cp_host_full_family() -> tuple[str, Any, Callable[[Any], Any]]:
    """From ``CP_HOST_FULL_START``, every state within three steps: four one-page prompts, a two-page (logical)
    device and two host pages a rank, write_through (each insert is backed up at once)."""
    from hicache_fsm.testing.explorer import Bounds

    return ("cp/2_ranks_host_full",
            Bounds(nodes=4, device_pages=2, host_pages=2, alphabet=4, max_len=1, redeliver=False,
                   write_policy="write_through", start=_start(CP_HOST_FULL_START), max_depth=3),
            _two_ranks_one_layer)
