"""Tensor parallelism: real rank processes over gloo keep identical trees (see hicache_fsm.tp)."""

from __future__ import annotations

import pytest

import tp_scenarios
from hicache_fsm.testing.ranks import run_ranks


def _values(outcomes):
    return [o.unwrap() for o in outcomes]


@pytest.mark.parametrize("world,policy", [(2, "write_through"), (2, "write_back"), (4, "write_through")])
def test_ranks_agree_on_acks_whatever_order_each_rank_sees(world, policy):
    examples = 3 if world == 2 else 2
    values = _values(run_ranks(tp_scenarios.acks_property, world, policy, examples, timeout_s=600))
    assert all(v == values[0] for v in values[1:]), "ranks returned different view digests"
    assert len(values[0]) > examples * 14


def test_a_dead_rank_gives_the_others_a_typed_error_within_the_timeout():
    outcomes = run_ranks(tp_scenarios.rank_dies, 3, 1, 3.0, timeout_s=300)
    assert outcomes[1].status == "died" and outcomes[1].exitcode == 17
    for o in (outcomes[0], outcomes[2]):
        kind, elapsed = o.unwrap()
        assert kind == "RankTimeout"
        assert elapsed < 3.0 + 2.0


@pytest.mark.parametrize("world,url,mla", [(2, "memory://", False), (2, "file", True), (4, "memory://", False)])
def test_ranks_agree_on_storage_hits_progress_and_backups(world, url, mla, tmp_path):
    if url == "file":
        url = f"file://{tmp_path}"
    values = _values(run_ranks(tp_scenarios.storage_property, world, url, mla, 2 if world == 2 else 1,
                               timeout_s=600))
    assert all(v == values[0] for v in values[1:]), "ranks returned different view digests"
