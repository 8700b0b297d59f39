"""``job_keeps_no_lock``: once a job ends, none of its nodes holds a lock or pin that neither the engine
nor a running prefetch owns (``checks.perform`` runs it after ``complete_job`` / ``fail_job``)."""

from __future__ import annotations

from hicache_fsm.testing.checks import Step, replay_steps
from hicache_fsm.testing.explorer import quiet_cache_logs
from hicache_fsm.testing.mutants import mutant
from hicache_fsm.testing.protocol import ProtocolAdapter


def _adapter() -> ProtocolAdapter:
    return ProtocolAdapter(device_pages=3, host_pages=4, layers=1, write_policy="write_through")


def test_locks_the_engine_holds_are_not_the_jobs():
    """A load retried because the engine locked its node: the engine's lock is owned, nothing is flagged."""
    steps = [Step("insert", ((1,),)), Step("complete_job", (0,)), Step("evict", (1,)), Step("load_back", ((1,),)),
             Step("lock", ((1,),)), Step("fail_job", (0,)), Step("complete_job", (0,)), Step("unlock", (0,))]
    with quiet_cache_logs():
        adapter = _adapter()
        assert replay_steps(adapter, steps) == []
    assert adapter.unowned_refs() == {}


def test_a_backup_that_keeps_its_lock_is_named_when_it_ends():
    with quiet_cache_logs(), mutant("backup_keeps_lock"):
        adapter = _adapter()
        problems = replay_steps(adapter, [Step("insert", ((1, 2),)), Step("complete_job", (0,))])
    assert problems[0].startswith("after step 2 complete_job(#0): job_keeps_no_lock: complete_job(#0) ended job")
    assert "(d2h)" in problems[0] and "1 lock(s) and 0 pin(s) nobody owns" in problems[0]
    assert list(adapter.unowned_refs().values()) == [(1, 0)]
