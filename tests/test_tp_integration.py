"""Tensor parallelism as engines deploy it: several TP groups in one world, storage keyed by each rank.

Real gloo rank processes. An engine's TP group is NCCL on GPUs; the cache then
agrees over a gloo group it makes beside it. Here every group is gloo (no GPU),
so the rank functions report the TP group's backend as NCCL to take that path.
"""

from __future__ import annotations

from tp_scenarios import drain, make_cache, prompts, serve

from hicache_fsm.errors import HiCacheError
from hicache_fsm.testing.ranks import run_ranks
from hicache_fsm.tp import PURPOSE_ENGINE, RankGroup, StepAgreement


def outcome(fn) -> tuple[str, str]:
    try:
        fn()
        return ("ok", "")
    except HiCacheError as exc:
        return (type(exc).__name__, str(exc))


def two_tp_groups(rank: int, world: int, pg) -> tuple[list[int], list[int]]:
    """Ranks 0-1 and 2-3 are two TP groups (pipeline or data parallel beside them), reported as NCCL."""
    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every process makes both, as engines do
    mine = groups[rank // 2]
    real = dist.get_backend
    dist.get_backend = lambda group=None: "nccl" if group is mine else real(group)
    try:
        first = RankGroup(mine, timeout_s=60.0).min([100 + rank, -rank], PURPOSE_ENGINE)
        again = RankGroup(mine, timeout_s=60.0).min([rank], PURPOSE_ENGINE)  # a second cache over the same group
    finally:
        dist.get_backend = real
    return first, again


def test_each_tp_group_agrees_within_itself_when_the_world_holds_several():
    # A world-wide new_group per TP group joined ranks 1 and 2 (of different groups) and left 0 and 3 to time out.
    got = [o.unwrap() for o in run_ranks(two_tp_groups, 4, timeout_s=300, group_timeout_s=60)]
    assert got == [([100, -1], [0]), ([100, -1], [0]), ([102, -3], [2]), ([102, -3], [2])]


def late_second_group(rank: int, world: int, pg) -> list[int]:
    """Ranks 2-3 make their gloo group after ranks 0-1 returned, as a busy machine schedules them."""
    import time

    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    if rank >= 2:
        time.sleep(2.0)  # lateness, not a verdict: the answer must be the same however late they come
    real = dist.get_backend
    dist.get_backend = lambda group=None: "nccl" if group is mine else real(group)
    try:
        return RankGroup(mine, timeout_s=60.0).min([100 + rank], PURPOSE_ENGINE)
    finally:
        dist.get_backend = real


def test_a_group_made_after_rank_0_returned_still_forms():
    """Rank 0 hosts the store every group is made through: having answered, it stays until all answered
    (``run_ranks``), or ranks 2-3 lost the store when rank 0's process ended ("connection closed")."""
    got = [o.unwrap() for o in run_ranks(late_second_group, 4, timeout_s=300, group_timeout_s=60)]
    assert got == [[100], [100], [102], [102]]


def refused_then_served(rank: int, world: int, pg, url: str) -> dict:
    """Rank 1 names another rank's storage keys: refused before it opens anything; then both serve on."""
    group = RankGroup(pg, timeout_s=60.0)
    cache, ex = make_cache(group)
    tokens = prompts(3, 1)[0]
    serve(cache, tokens, rank)
    drain(cache, ex)
    cache.evict(10**6)  # host only: the next step loads it back (a collective of its own)
    seen = {"attach": outcome(lambda: cache.attach_storage(url, model="m", **({"tp_rank": 0} if rank else {})))}
    seen["load back"] = outcome(lambda: serve(cache, tokens, rank))
    drain(cache, ex)
    seen["poll"] = outcome(cache.poll)
    seen["attached"] = cache.storage is not None and cache.storage.state == "attached"
    seen["again"] = outcome(lambda: cache.attach_storage(url, model="m"))  # the group's ranks are taken
    options = cache.storage.options
    seen["keyed as"] = (options.tp_rank, options.tp_size, options.key_namespace().storage_key("0" * 64)[:8])
    cache.close()
    return seen


def test_a_rank_refused_before_its_vote_still_votes_and_ranks_keep_their_own_keys(tmp_path):
    # Rank 1 raised before the attach vote and its next collective (a load-back's room check) took the
    # vote's place: rank 0 attached alone and every poll after it was RanksDiverged. And with the
    # defaults (rank 0 of 1) both ranks wrote the same keys in one store: each overwrote the other's heads.
    url = f"file://{tmp_path}/store"
    seen = [o.unwrap() for o in run_ranks(refused_then_served, 2, url, timeout_s=300, group_timeout_s=60)]
    assert seen[0]["attach"][0] == "StorageLinkError" and "another rank" in seen[0]["attach"][1]
    assert seen[1]["attach"][0] == "StorageLinkError" and "tp_rank 0 of tp_size 1" in seen[1]["attach"][1]
    for rank, s in enumerate(seen):
        assert s["load back"] == ("ok", "") and s["poll"] == ("ok", "")
        assert s["attached"] is False
        assert s["again"] == ("ok", "")
        assert s["keyed as"] == (rank, 2, f"m/_/{rank}of2")


class OnceMalformed:
    """A section whose first items on one rank have the wrong width (a bug of that section)."""

    name, width = "once-malformed", 1

    def __init__(self, malformed: bool) -> None:
        self.malformed = malformed
        self.applied: list = []

    def collect(self):
        if self.malformed:
            self.malformed = False
            return [[1, 2]], 0
        return [[5]], 0

    def apply(self, items) -> None:
        self.applied.append(items)


def malformed_once(rank: int, world: int, pg) -> tuple[list, int, list]:
    agreement = StepAgreement(RankGroup(pg, timeout_s=60.0))
    section = OnceMalformed(malformed=rank == 1)
    agreement.register(section)
    seen = [outcome(agreement.step)[0]] if rank == 1 else []  # refused before its collective
    seen += [outcome(agreement.step)[0], outcome(agreement.step)[0]]
    return seen, agreement.steps, section.applied


def test_a_step_refused_before_its_collective_is_not_counted():
    # The refused rank counted the step anyway, and every later step was "at different agreement steps".
    got = [o.unwrap() for o in run_ranks(malformed_once, 2, timeout_s=300, group_timeout_s=60)]
    assert got[0] == (["ok", "ok"], 2, [[[5]], [[5]]])
    assert got[1] == (["ConfigError", "ok", "ok"], 2, [[[5]], [[5]]])


def executor_fails_once(rank: int, world: int, pg) -> dict:
    """Rank 1's executor raises in one poll; then both ranks load a prefix back (a collective of its own)."""
    group = RankGroup(pg, timeout_s=60.0)
    cache, ex = make_cache(group)
    tokens = prompts(7, 1)[0]
    serve(cache, tokens, rank)
    drain(cache, ex)
    cache.evict(10**6)
    if rank == 1:
        real = ex.poll

        def broken():
            ex.poll = real
            raise RuntimeError("the engine's executor failed (injected)")

        ex.poll = broken
    seen = {"poll": outcome(cache.poll) if rank == 0 else _raised(cache.poll)}
    seen["load back"] = outcome(lambda: serve(cache, tokens, rank))
    drain(cache, ex)
    seen["poll after"] = outcome(cache.poll)
    cache.close()
    return seen


def _raised(fn) -> tuple[str, str]:
    try:
        fn()
        return ("ok", "")
    except RuntimeError as exc:
        return ("RuntimeError", str(exc))


def test_a_rank_whose_executor_raised_in_poll_still_takes_part_in_the_step():
    # The failing rank skipped the step's collective: its next one (a load-back's room check) met the
    # other rank's step, and both were RanksDiverged.
    got = [o.unwrap() for o in run_ranks(executor_fails_once, 2, timeout_s=300, group_timeout_s=60)]
    assert got[0] == {"poll": ("ok", ""), "load back": ("ok", ""), "poll after": ("ok", "")}
    assert got[1]["poll"] == ("RuntimeError", "the engine's executor failed (injected)")
    assert got[1]["load back"] == ("ok", "") and got[1]["poll after"] == ("ok", "")
