"""The whole-protocol checks: ProtocolAdapter's obligations, CPAdapter, and `check` with no flags.

The default `check` explores every family to its depth bound; its test here runs the same
families to a smaller depth (a model bound, never a time budget).
"""

from __future__ import annotations

import json

import attrs
import pytest

from hicache_fsm.testing import Bounds, explore
from hicache_fsm.testing.checks import Step
from hicache_fsm.testing.cp import CPAdapter
from hicache_fsm.testing.explorer import quiet_cache_logs
from hicache_fsm.testing.mutants import mutant
from hicache_fsm.testing.paths import CoverageTracker
from hicache_fsm.testing.protocol import ProtocolAdapter, default_families, families_for
from obligation_helpers import backed_up, flagged_only_when_planted


def test_families_cover_every_policy_stop_policy_and_cp_world():
    fams = default_families()
    policies = {b.write_policy for _, b, _ in fams if not b.storage}
    assert {"write_through", "write_back", "write_through_selective", "write_behind"} <= policies
    assert {b.stop_policy for _, b, _ in fams if b.storage} == {"best_effort", "wait_complete", "timeout"}
    assert {n for n, _, _ in fams if n.startswith("cp/")} == {"cp/1_ranks", "cp/2_ranks", "cp/2_ranks_host_full"}
    assert "storage/prefetch_split" in {n for n, _, _ in families_for({"storage": True})}
    assert all(b.max_depth and b.max_seconds is None and b.max_states is None for _, b, _ in fams)
    assert families_for({"cp": True}) and all(n.startswith("cp/") for n, _, _ in families_for({"cp": True}))


def test_check_without_flags_runs_every_family_and_reports_coverage_per_machine(monkeypatch, capsys):
    from hicache_fsm.cli import main
    from hicache_fsm.testing import protocol

    quick = [(n, attrs.evolve(b, max_depth=2), f) for n, b, f in default_families()]
    monkeypatch.setattr(protocol, "default_families", lambda: quick)
    assert main(["check", "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["complete"] and all(r["complete"] for r in out["runs"])
    assert [r["family"] for r in out["runs"]] == [n for n, _, _ in quick]
    cov = out["coverage"]
    assert set(cov) == {"residency", "prefetch", "storage_link", "layer_write"}
    for machine in cov.values():
        hit, total = machine["states"]
        assert 0 < hit <= total and len(machine["transitions"]) == 2
    assert cov["residency"]["states"][1] == 13


def test_selective_policy_obligation_and_load_back_indices_hold_for_the_real_cache():
    with quiet_cache_logs():
        for policy in ("write_through_selective", "write_back"):
            from hicache_fsm.testing.protocol import protocol_factory

            r = explore(Bounds(nodes=2, device_pages=2, host_pages=2, write_policy=policy, max_depth=4),
                        protocol_factory)
            assert r.complete
            assert not r.violations, r.violations[0].format()


def test_partial_storage_step_gives_a_per_key_partial_prefetch():
    a = ProtocolAdapter(device_pages=3, host_pages=5, storage=True)
    a.insert((1, 2, 3))
    for job in a.pending_jobs():
        a.complete_job(job.id)
    a.complete_storage(a.storage_steps()[0].id)
    a.evict(3), a.evict_host(3)
    request = a.prefetch((1, 2, 3))
    a.complete_storage(a.storage_steps()[0].id)  # the hit query
    a.partial_storage(a.storage_steps()[0].id)  # the first batch comes back one page short
    assert a.prefetch_ready(request)
    assert 0 < len(a.read_kv((1, 2, 3))) < 3
    assert not a.faults.armed and not a.invariant_violations() and not a.kv_violations()


def test_detach_ends_transfers_in_flight_first_and_attach_can_fail():
    from hicache_fsm.testing.adapter import Rejected

    a = ProtocolAdapter(device_pages=3, host_pages=5, storage=True)
    a.insert((1, 2))
    for job in a.pending_jobs():
        a.complete_job(job.id)
    assert a.storage_steps()  # the backup is queued
    a.detach_storage()  # the queued backup fails: the node keeps its host copy, nothing is in flight
    assert a.cache.storage.link.state == "detached" and not a.storage_steps()
    assert not a.invariant_violations()
    a.attach_storage()
    a.insert((1, 2))
    for job in a.pending_jobs():
        a.complete_job(job.id)
    for step in a.storage_steps():
        a.complete_storage(step.id)
    a.detach_storage()
    assert a.cache.storage.link.state == "detached" and not a.storage_steps()
    with pytest.raises(Rejected):  # a fresh store cannot hold what the stored node claims
        a.attach_storage()
    a.evict(2), a.evict_host(2)
    with pytest.raises(Rejected):
        a.attach_storage(fail=True)
    assert a.cache.storage.link.state == "detached"
    a.attach_storage()
    assert a.cache.storage.link.state == "attached" and not a.invariant_violations()


@pytest.mark.parametrize("world_size, depth", [(1, 6), (2, 5)])  # two ranks: one step less keeps it small
def test_cp_writes_with_draft_layers_hold_and_reach_the_layer_write_states(world_size, depth):
    cov = CoverageTracker()
    with quiet_cache_logs():
        r = explore(Bounds(nodes=2, device_pages=2, host_pages=2, alphabet=1, max_len=2, redeliver=False,
                           write_policy="write_back", max_depth=depth), lambda b: CPAdapter(world_size=world_size),
                    coverage=cov)
    assert not r.violations, r.violations[0].format()
    assert r.complete
    states = set(cov.report()["layer_write"]["missing_states"])
    assert {"submitting", "all_submitted", "acked"}.isdisjoint(states)
    if world_size == 2:
        assert "zero_owned" not in states


def test_cp_draft_layers_not_written_is_caught_by_host_read_back():
    a = None
    with quiet_cache_logs(), mutant("cp_draft_layers_not_written"):
        a = CPAdapter(world_size=1)
        a.insert((1, 1))
        assert a.reserve((1, 1))
        for source, layers in (("target", 2), ("draft", 1)):
            for layer in range(layers):
                a.layer_end(layer, source)
        for job in a.pending_jobs():
            a.complete_job(job.id)
        problems = a.kv_violations()
    assert any("cp_ack_after_every_layer" in p for p in problems)
    assert any("draft host copy" in p for p in problems)


def _cp_host_full() -> CPAdapter:
    """Two one-layer CP ranks after ``CP_HOST_FULL_START``: rank 1's host full of its own pages, rank 0's not."""
    from hicache_fsm.testing.checks import replay_steps
    from hicache_fsm.testing.start_families import CP_HOST_FULL_START

    a = CPAdapter(world_size=2, device_pages=2, host_pages=2, layers=1, draft_layers=0, write_policy="write_through")
    assert replay_steps(a, [Step(op, args) for op, args in CP_HOST_FULL_START]) == []
    return a


def test_cp_ranks_evicting_host_kv_alike_hold_and_a_one_rank_shortfall_parts_them():
    """A backup of a page rank 1 owns, its host full: every rank evicts the same host KV, or ``cp_group_host_copy``
    sees a node rank 0 still holds whose owner dropped its share (each rank's own read-back cannot)."""
    with quiet_cache_logs():
        a = _cp_host_full()
        assert a.insert((4,)) and not a.kv_violations()
        with mutant("cp_shortfall_own_rank_only"):
            b = _cp_host_full()
            assert b.insert((4,))
            problems = b.kv_violations()
    assert any(p.startswith("cp_group_host_copy: rank 0 holds node (2,)") for p in problems), problems


def test_cp_engine_steps_wait_while_a_load_failed_on_one_rank_runs_on_another():
    """Inserting then would evict on the still-loading rank only and part the ranks' trees."""
    with quiet_cache_logs():
        a = _cp_host_full()
        assert a.load_back((2,)) == 1
        a.fail_job(next(j.id for j in a.pending_jobs() if j.id[0] == 1))
        assert not a.applicable("insert", ((4,),)) and a.applicable("complete_job", (0,))
        a.complete_job(a.pending_jobs()[0].id)
        assert not a.kv_violations()


def _refused_load_back(adapter: ProtocolAdapter) -> tuple[int, list[str]]:
    """Three nodes on a three-page device: a host-only node, the device full of a locked prompt, and a
    load-back of the host-only node that cannot find device room."""
    adapter.insert((1,))
    assert adapter.backup((1,))
    for job in adapter.pending_jobs():
        adapter.complete_job(job.id)
    assert adapter.evict(1) == 1
    adapter.insert((2, 2, 2))
    handle = adapter.lock((2, 2, 2))
    loaded = adapter.load_back((1,))
    problems = adapter.invariant_violations()
    adapter.unlock(handle)
    return loaded, problems + adapter.invariant_violations()


def test_a_load_back_refused_for_device_room_keeps_the_locks_balanced():
    with quiet_cache_logs():
        adapter = ProtocolAdapter(device_pages=3, host_pages=3, layers=1, write_policy="write_back")
        loaded, problems = _refused_load_back(adapter)
    assert loaded == 0 and adapter.cache.counters["load_back_device_full"] == 1
    assert problems == []
    assert all(n.lock_ref == 0 for n in adapter.cache.tree.nodes())


def test_a_lock_leaked_by_a_refused_load_back_is_caught():
    with quiet_cache_logs(), mutant("lock_leak_on_refused_load_back"):
        adapter = ProtocolAdapter(device_pages=3, host_pages=3, layers=1, write_policy="write_back")
        _, problems = _refused_load_back(adapter)
    assert any(p.startswith("engine_locks:") for p in problems), problems


def test_reset_family_and_recency_families_hold_for_the_real_cache():
    """The families that reset, prioritise and re-use prompts find nothing in the real cache."""
    names = {"memory/reset", "memory/recency_lru", "memory/recency_lfu", "memory/recency_priority",
             "storage/prefetch_anchor", "storage/prefetch_split", "cp/2_ranks_host_full"}
    fams = [f for f in default_families() if f[0] in names]
    assert {n for n, _, _ in fams} == names
    with quiet_cache_logs():
        for name, bounds, factory in fams:
            r = explore(bounds, factory)
            assert r.complete and r.ok, (name, r.violations[0].format() if r.violations else r.checked_nothing())
    policies = [b.eviction_policy for _, b, _ in families_for({"eviction_policy": "lfu"})]
    assert policies[0] == "lfu" and policies == sorted(policies, key=lambda p: p != "lfu")  # that policy's first
    assert families_for({"reset": True})[0][1].max_resets  # a bug only a reset shows: the resetting family first


def test_reset_empties_the_cache_and_late_acks_change_nothing():
    a = ProtocolAdapter(device_pages=2, host_pages=2)
    assert a.insert((1, 1)) and a.pending_jobs()
    a.reset(acked=True)
    assert a.size() == 0 and a.occupancy().device_tokens == 0 and not a.pending_jobs()
    assert not a.kv_violations() and not a.invariant_violations()
    assert a.insert((2,))  # a new job; completing it polls the reset's late ack too
    a.complete_job(a.pending_jobs()[0].id)
    assert not a.kv_violations() and a.cache.counters["late_cancelled_completions"] == 1


def test_priority_is_ranked_before_recency():
    """Under the priority policy a node inserted at priority 1 outlives a newer one at 0 (the order check agrees)."""
    a = ProtocolAdapter(device_pages=3, host_pages=2, eviction_policy="priority",
                        write_policy="write_through_selective")
    assert a.insert((1,), 1) and a.insert((2,))
    assert a.evict(1) == 1
    assert a.read_kv((1,)) and not a.read_kv((2,)) and not a.kv_violations()
    with mutant("priority_order_inverted"):
        b = ProtocolAdapter(device_pages=3, host_pages=2, eviction_policy="priority",
                            write_policy="write_through_selective")
        b.insert((1,), 1), b.insert((2,)), b.evict(1)
        assert any(p.startswith("policy_eviction_order") for p in b.kv_violations())


def test_pages_a_prefetch_fetched_before_storage_lost_them_are_inserted_unstored_and_stored_again():
    """A prefetch whose pages landed, then the backend lost everything: its node claimed ``host_stored``
    (``stored_means_stored`` failed) and was never backed up again."""
    a = ProtocolAdapter(device_pages=3, host_pages=6, storage=True)
    a.insert((1, 2))
    for job in a.pending_jobs():
        a.complete_job(job.id)
    a.complete_storage(a.storage_steps()[0].id)  # (1, 2) stored: lose_storage has a node to find
    a.store_remote((3, 4))  # another instance stored a prompt this one never saw
    request = a.prefetch((3, 4))
    while a.storage_steps():  # the hit query, then the transfer: the pages land on the host
        a.complete_storage(a.storage_steps()[0].id)
    assert a.lose_storage() == 1  # the backend restarts empty; the maintenance check finds (1, 2) gone
    assert a.prefetch_ready(request)
    node = a.cache.match_prefix((3, 4)).last_host_node
    assert node.state == "host" and not a.invariant_violations() and not a.kv_violations()
    stats = a.cache.stats()["storage"]  # the lost stored node and the prefetch's tokens, each counted apart
    assert stats["storage_lost_nodes"] == 1 and stats["prefetch_unstored_tokens"] == 2
    a.cache.poll()  # stored again at the next poll
    while a.storage_steps():
        a.complete_storage(a.storage_steps()[0].id)
    assert node.state == "host_stored" and not a.invariant_violations()


def test_a_load_back_below_a_revived_page_waits_for_the_load_above_it():
    """``check --nodes 4 --device-pages 3 --host-pages 3`` found this in six steps: the first page loading, the
    second revived by an insert (on the device at once), a load-back of the third had no wait for the first."""
    from hicache_fsm.testing.checks import replay_steps
    from hicache_fsm.testing.protocol import protocol_factory

    adapter = protocol_factory(Bounds(nodes=4, device_pages=3, host_pages=3, write_policy="write_through"))
    steps = [Step("insert", ((1, 1, 1),)), Step("complete_job", (0,)), Step("evict", (1,)),
             Step("load_back", ((1,),)), Step("insert", ((1, 1),)), Step("load_back", ((1, 1, 1),))]
    try:
        assert replay_steps(adapter, steps) == []
    finally:
        adapter.close()


def test_a_split_whose_lower_half_leaves_in_the_same_insert_keeps_its_use_record():
    """``fuzz --examples 1500 --steps 80 --seed 15`` raised a false ``order_agrees``: one insert split a host-only
    node that had a hit, revived its upper half and evicted the lower half for host room. The records guessed
    the split from the lower half, gone by the end of the call, so the upper half counted no hit where the
    cache (rightly) kept it. The records now hear of each split as it happens."""
    from hicache_fsm.testing.stateful import hicache_machine

    state = hicache_machine(name="SplitRecords")()
    try:
        state.setup(variant=3, pages=[0])
        state.expect_variant({"write_policy": "write_through", "eviction_policy": "lfu", "device_pages": 4,
                              "host_pages": 2})
        short = state.insert(pages=[1, 0])
        state.ack_round(fail_mask=0, order=list(range(8)))
        long = state.insert(pages=[1, 0, 0, 0])
        state.reuse_then_evict(again=True, pages=1, tokens=short)
        state.ack_round(fail_mask=0, order=[0, 2, 1, 3, 4, 5, 6, 7])
        state.reuse_then_evict(again=False, pages=1, tokens=long)  # the short prompt's node: one hit, host-only
        state.insert(pages=[1, 1])  # splits it: upper half revived, lower half evicted for host room
        upper = [n for n in state.adapter.cache.tree.nodes() if n.parent is not None and n.hit_count == 1]
        assert len(upper) == 1 and state.adapter.uses.uses[upper[0].id][0] == 1
        state.insert(pages=[0])
        state.check()
    finally:
        state.teardown()


def test_use_records_follow_splits_and_leave_nodes_the_cache_made_unjudged():
    from types import SimpleNamespace

    from hicache_fsm.testing.recency import UseLog

    log = UseLog("lfu")
    root = SimpleNamespace(id=0, parent=None)
    a = SimpleNamespace(id=1, parent=root)
    log.used([a], hit=False, new={1})
    log.used([a], hit=True)
    log.split(1, 2)  # the upper half takes the record
    log.split(7, 8)  # a node without a record: nothing to hand on
    upper, fetched = SimpleNamespace(id=2, parent=root), SimpleNamespace(id=3, parent=root)
    log.sync([root, upper, fetched])  # node 1 left; node 3 came from the cache itself
    assert log.uses == {2: (1, 2, 0), 3: None}
    log.split(5, 6)  # a node the cache made since the last sync: its upper half is the cache's too
    assert log.knows(6) and log.uses[6] is None and not log.knows(9)
    log.forget_all()
    assert not log.knows(2) and log.uses == {}


def test_the_upper_half_of_a_prefetched_node_split_by_an_insert_stays_unjudged():
    """``fuzz --examples 1500 --steps 80 --seed 25`` raised a false ``order_agrees``: a prefetch inserted a node
    the cache counted one hit (a node of the cache's own: no record), and an insert of its first page split
    it. The insert took the split's upper half for a node it made, with no hit, where the cache (rightly)
    kept the hit; a new node then ranked below it under LFU. A split's upper half now keeps its lower
    half's record even when that is "none"."""
    from hicache_fsm.testing.stateful import hicache_machine

    state = hicache_machine(name="PrefetchedSplit")()
    try:
        prompt = state.setup(variant=32, pages=[0])
        state.expect_variant({"write_policy": "write_through_selective", "eviction_policy": "lfu", "device_pages": 4,
                              "host_pages": 5, "storage": True, "stop_policy": "wait_complete"})
        state.backup(cut=0, tokens=prompt)
        state.ack_round(fail_mask=1, order=list(range(8)))
        state.evict(pages=1)
        state.remote_turn(base=prompt, pages=[0], script=[])
        state.reuse_then_evict(again=False, pages=1, tokens=prompt)
        state.prefetch_ready(pick=0)  # (1, 1) lands from storage: the cache's node, one hit
        state.complete_job(pick=0)
        state.insert(pages=[0])  # splits it at (1,)
        upper = state.adapter.walk(prompt)[0][-1]
        assert upper.hit_count == 1 and state.adapter.uses.uses[upper.id] is None
        state.insert(pages=[1])
        state.check()
    finally:
        state.teardown()


def _host_only_prompt(a) -> None:
    """(1,) inserted, backed up and evicted from the device: a one-token host hit."""
    a.insert((1,))
    for job in a.pending_jobs():
        a.complete_job(job.id)
    assert a.evict(1) == 1 and a.match((1,)).host_tokens == 1


def test_a_load_back_refused_though_eviction_could_make_room_is_a_problem():
    """``load_back_due``: every tool passed a load-back that never loaded (or never evicted for room)."""
    def steps(a) -> None:
        _host_only_prompt(a)
        backed_up(a, (2, 2))  # the device is full again, of an unlocked, backed-up prompt
        a.load_back((1,))

    flagged_only_when_planted(steps, ("load_back_refused_with_room", "load_back_never_evicts"), "load_back_due",
                               device_pages=2, host_pages=4)


def test_a_load_back_refused_for_a_device_full_of_locked_kv_is_justified():
    a = ProtocolAdapter(device_pages=2, host_pages=4)
    _host_only_prompt(a)
    a.insert((2, 2))
    assert a.lock((2, 2)) is not None  # nothing on the device may go
    assert a.load_back((1,)) == 0
    assert not a.kv_violations() and not a.invariant_violations()
    a.close()


def test_an_eviction_that_stops_short_of_what_could_go_is_a_problem():
    """``evict_due``: an eviction that freed nothing, or stopped after its first victim, passed every tool."""
    def steps(a) -> None:
        backed_up(a, (1,), (2,))  # two backed-up nodes of one token each
        a.evict(2)

    flagged_only_when_planted(steps, ("evict_frees_nothing", "evict_stops_after_one_token"), "evict_due",
                               device_pages=3, host_pages=4)


def test_freeable_device_tokens_counts_what_an_eviction_may_take_at_once():
    from hicache_fsm.testing.obligations import freeable_device_tokens

    a = ProtocolAdapter(device_pages=6, host_pages=6, write_policy="write_back")
    a.insert((1, 1))  # device-only under write_back: must be backed up before it can go
    root = a.cache.tree.root
    assert freeable_device_tokens(root, keeps_unbacked=True) == 0
    assert freeable_device_tokens(root, keeps_unbacked=False) == 2  # a policy that drops unbacked KV
    assert a.backup((1, 1)) and freeable_device_tokens(root, keeps_unbacked=False) == 0  # the copy in flight
    for job in a.pending_jobs():
        a.complete_job(job.id)
    assert freeable_device_tokens(root, keeps_unbacked=True) == 2
    handle = a.lock((1, 1))
    assert freeable_device_tokens(root, keeps_unbacked=True) == 0
    a.unlock(handle)
    assert a.evict(2) == 2 and freeable_device_tokens(root, keeps_unbacked=True) == 0
    assert not a.kv_violations() and not a.invariant_violations()
    a.close()


def test_an_eviction_that_takes_more_than_it_was_asked_is_a_problem():
    """``evict_just_enough``: evictions that took every candidate, asked for one token, passed every tool."""
    def on_device(a) -> None:
        backed_up(a, (1,), (2,))
        a.evict(1)

    def on_host(a) -> None:
        backed_up(a, (1,), (2,))
        assert a.evict(2) == 2  # both on the host only now
        a.kv_violations()
        a.evict_host(1)

    flagged_only_when_planted(on_device, ("evict_takes_everything",), "evict_just_enough", device_pages=3,
                               host_pages=4)
    flagged_only_when_planted(on_host, ("evict_host_takes_everything",), "evict_just_enough", device_pages=3,
                               host_pages=4)


def test_an_allocation_refused_while_kv_could_go_is_a_problem():
    """``alloc_due``: an allocation that failed without evicting passed every tool."""
    def steps(a) -> None:
        backed_up(a, (1,))  # (1,) may go
        a.insert((2, 2))  # needs both device pages

    flagged_only_when_planted(steps, ("alloc_device_never_evicts",), "alloc_due", device_pages=2, host_pages=4)


def test_a_host_copy_never_backed_up_to_storage_is_a_problem():
    """``store_due``: a cache whose storage backups never started passed every tool."""
    def steps(a) -> None:
        backed_up(a, (1,))  # the D2H lands: its storage backup starts
        a.kv_violations()
        a.poll()

    flagged_only_when_planted(steps, ("storage_backups_never_start",), "store_due", device_pages=3, host_pages=4,
                               storage=True)


def test_a_prefetch_step_that_misses_stored_pages_is_a_problem():
    """``query_exact`` / ``transfer_exact``: a hit query that counted only the first stored page, and a transfer
    whose last page went uncounted (reported short), passed every tool."""
    def query(a) -> None:
        assert a.store_remote((1, 2)) == 2  # another instance stored both pages
        a.prefetch((1, 2))
        a.complete_storage(a.storage_steps()[0].id)  # the hit query

    def transfer(a) -> None:
        assert a.store_remote((1,)) == 1
        a.prefetch((1,))
        a.complete_storage(a.storage_steps()[0].id)  # the hit query
        a.complete_storage(a.storage_steps()[0].id)  # the transfer

    flagged_only_when_planted(query, ("hit_query_stops_after_first_page",), "query_exact", device_pages=3,
                               host_pages=5, storage=True)
    flagged_only_when_planted(transfer, ("transfer_counts_one_page_short",), "transfer_exact", device_pages=3,
                               host_pages=5, storage=True)


def test_a_transfer_short_of_a_page_a_corrupt_fault_damaged_is_not_a_problem():
    """``fuzz --examples 600 --steps 80 --seed 43``: a corrupt fault on a hit query damaged the stored page, so
    the transfer (run with no fault left armed) read it as a miss; ``transfer_exact`` counts what reads back."""
    from hicache_fsm.testing.interface import StorageFault
    from hicache_fsm.testing.stateful import hicache_machine

    state = hicache_machine(name="CorruptThenTransfer")()
    try:
        prompt = state.setup(variant=21, pages=[0])  # drawn as 421: 421 % 50 variants then
        state.expect_variant({"write_policy": "write_through", "eviction_policy": "lru", "device_pages": 3,
                              "host_pages": 6, "page_size": 2, "layers": 2, "storage": True,
                              "stop_policy": "best_effort"})
        state.complete_job(pick=0)
        state.storage_fault(fault=StorageFault(kind="corrupt", call="exists", after=0, count=1))
        state.evict(pages=1)
        state.remote_turn(base=prompt, pages=[0], script=[])
        state.check()
    finally:
        state.teardown()
