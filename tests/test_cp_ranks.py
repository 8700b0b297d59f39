"""Context parallelism over real rank processes: a gloo group agrees every copy, so the ranks' trees stay one.

Each CP rank copies only the pages it owns, so one rank's copy can fail while
the others' land. The ranks' completions are agreed job by job (``acks``): a
write fails on every rank if it failed on any, and a rank that owns no page of
a node submits empty copies so its jobs line up with the others'.
"""

from __future__ import annotations

import pytest

import cp_rank_scenarios
from hicache_fsm.testing.ranks import run_ranks


def _values(outcomes):
    return [o.unwrap() for o in outcomes]


@pytest.mark.parametrize("block_pages, failing_rank", [
    (1, 1),  # round robin: both ranks own half of the node
    (4, 0),  # blocks of 4 pages: rank 0 owns the whole node and fails; rank 1 submitted empty copies
    (4, 1),  # the rank that owns nothing fails its (empty) copy: the owner's write fails too
])
def test_a_copy_failed_on_one_rank_fails_the_write_on_every_rank(block_pages, failing_rank):
    values = _values(run_ranks(cp_rank_scenarios.one_copy_fails_here, 2, block_pages, failing_rank, timeout_s=300))
    for v in values:
        assert v["state"] == "device" and v["failed_writes"] == 1 and v["host_free_again"]
        assert v["jobs"] == 2  # one copy a layer on every rank, empty where the rank owns nothing
        assert v["retried"] == "device_host"
    assert sum(v["owned_pages"] for v in values) == 4
    assert sum(v["checked_pages"] for v in values) == 8  # each page's owner checked it on device and on host
    assert len({v["view"] for v in values}) == 1 and len({v["view_after_retry"] for v in values}) == 1


@pytest.mark.parametrize("world, block_pages, policy", [
    (2, 1, "write_through"), (3, 2, "write_through"), (2, 2, "write_back"), (2, 1, "write_through_selective")])
def test_cp_ranks_agree_whatever_order_and_failures_each_rank_sees(world, block_pages, policy):
    values = _values(run_ranks(cp_rank_scenarios.agreement_property, world, block_pages, policy, 3,
                               timeout_s=600))
    seen = [v[0] for v in values]
    assert all(s == seen[0] for s in seen[1:]), "ranks returned different view digests or failed-write counts"
    failed = {v[1] for v in values}
    assert len(failed) == 1 and failed.pop() > 0  # failures were injected, and every rank failed the same writes
    assert all(v[2] > 0 for v in values)  # every rank read its own pages back bit for bit


@pytest.mark.parametrize("claimed", ["rank 0 on every process", "a world of 3"])
def test_a_cp_rank_built_as_another_rank_is_refused_on_every_rank(claimed):
    """A rank built as another owns another's pages: half the KV would be copied by no rank, silently."""
    if claimed == "a world of 3":
        values = _values(run_ranks(cp_rank_scenarios.build_as_another_rank, 2, None, 3, timeout_s=300))
    else:
        values = _values(run_ranks(cp_rank_scenarios.build_as_another_rank, 2, 0, 2, timeout_s=300))
    assert all(v != "ok" for v in values)
    assert any("pass the group's rank and size" in v for v in values)
