"""Tensor parallelism: real rank processes over gloo keep identical trees (see hicache_fsm.tp)."""

from __future__ import annotations

import pytest

import tp_scenarios
from hicache_fsm.testing.ranks import run_ranks


def _values(outcomes):
    return [o.unwrap() for o in outcomes]


@pytest.mark.parametrize("args, kw, named", [
    ((0,), {}, "world"),  # was [], a run of no rank that a test took for a pass
    ((65,), {}, "at most 64"), (("2",), {}, "world"), ((2,), {"timeout_s": 0}, "timeout_s"),
    ((2,), {"group_timeout_s": float("inf")}, "group_timeout_s"),
])
def test_run_ranks_refuses_what_it_cannot_run_before_any_process_starts(args, kw, named):
    from hicache_fsm.errors import ConfigError

    with pytest.raises(ConfigError, match=named):
        run_ranks(tp_scenarios.rank_dies, *args, **kw)


@pytest.mark.parametrize("world,policy", [
    (2, "write_through"), (2, "write_back"), pytest.param(4, "write_through", marks=pytest.mark.slow)])
def test_ranks_agree_on_acks_whatever_order_each_rank_sees(world, policy):
    examples = 3 if world == 2 else 2
    values = _values(run_ranks(tp_scenarios.acks_property, world, policy, examples, timeout_s=600))
    assert all(v == values[0] for v in values[1:]), "ranks returned different view digests"
    assert len(values[0]) > examples * 14


def test_a_dead_rank_gives_the_others_a_typed_error():
    # the live ranks' timeout also bounds their skew at every collective before the death: 10 s, not less
    outcomes = run_ranks(tp_scenarios.rank_dies, 3, 1, 10.0, timeout_s=300)
    assert outcomes[1].status == "died" and outcomes[1].exitcode == 17
    for o in (outcomes[0], outcomes[2]):
        kind, _ = o.unwrap()
        assert kind == "RankTimeout"  # the group's timeout ended the wait, typed


@pytest.mark.parametrize("world,url,mla,policy", [
    (2, "memory://", False, "wait_complete"),
    (2, "memory://", False, "timeout"),  # termination on the agreed clock, what landed on every rank inserted
    (2, "file", True, "wait_complete"),  # MLA: rank 0 writes the shared copy, every rank reads it
    pytest.param(4, "memory://", False, "wait_complete", marks=pytest.mark.slow),
])
def test_ranks_agree_on_storage_hits_progress_and_backups(world, url, mla, policy, tmp_path):
    if url == "file":
        url = f"file://{tmp_path}"
    values = _values(run_ranks(tp_scenarios.storage_property, world, url, mla, 2 if world == 2 else 1, policy,
                               timeout_s=600))
    assert all(v == values[0] for v in values[1:]), "ranks returned different view digests"


def test_ranks_fed_different_requests_get_a_typed_error_not_a_hang():
    outcomes = run_ranks(tp_scenarios.fed_differently, 2, timeout_s=300)
    assert [o.unwrap() for o in outcomes] == ["RanksDiverged", "RanksDiverged"]


def test_one_rank_costs_nothing_and_bad_timeouts_are_refused():
    from hicache_fsm.errors import ConfigError
    from hicache_fsm.tp import RankGroup

    solo = RankGroup(None)
    assert solo.solo and solo.min([3, -1]) == [3, -1] and solo.all_true(False) is False and solo.same(7)
    assert solo.collectives == 0
    for bad in (0, -1.0, True, "5"):
        with pytest.raises(ConfigError):
            RankGroup(None, timeout_s=bad)
    cache, _ = tp_scenarios.make_cache(solo)
    assert cache.acks is None  # completions apply at once, as without a group


def test_a_rank_that_attaches_storage_alone_gets_a_typed_error_and_the_group_goes_on():
    outcomes = [o.unwrap() for o in run_ranks(tp_scenarios.attach_alone, 2, True, timeout_s=300)]
    assert [o[0] for o in outcomes] == ["StorageLinkError", "RanksDiverged"]
    assert outcomes[0][1] == outcomes[1][1]  # the next steps agree: the same tree on both ranks
    assert [o[2] for o in outcomes] == [False, False]  # nothing attached, no tier on either rank


def test_a_rank_that_attaches_storage_while_the_others_leave_gets_a_typed_error():
    outcomes = run_ranks(tp_scenarios.attach_alone, 2, False, timeout_s=300)
    assert [o.status for o in outcomes] == ["ok", "ok"]  # no process died
    assert outcomes[0].unwrap()[0] == "StorageLinkError" and outcomes[1].unwrap()[0] == "left"
