"""What `fuzz --cp` found or must keep finding, replayed step by step (no hypothesis, no clock).

A CP write is one copy per rank: each rank's executor completes or fails its own. When the copy lands on
one rank and fails on another, the node is ``device_host`` on the first and ``device`` on the second. A
scheduler that then evicts it drops the node on the failed rank and keeps, on the other, a host copy whose
pages of the failed rank are gone: the prompt reads back a slot never written (the ``kv_readback``
violation an in-suite ``fuzz --cp`` run once reported). The CP adapter, as the engine, holds every other
step until the node is backed up again on the failed rank.
"""

from __future__ import annotations

from hicache_fsm.testing.checks import Step, catalogue, perform
from hicache_fsm.testing.cp import CPAdapter
from hicache_fsm.testing.explorer import quiet_cache_logs
from hicache_fsm.testing.kv import fingerprints
from hicache_fsm.testing.mutants import mutant
from hicache_fsm.testing.paths import CoverageTracker
from hicache_fsm.testing.stateful import cp_machine, run_fuzz

PROMPT = (1, 1)  # two pages: page 0 on rank 0, page 1 on rank 1


def _states(a: CPAdapter) -> list[str | None]:
    """The prompt's node state on each rank (None: the rank has no such node)."""
    out = []
    for r in a.ranks:
        path, matched, partial = r.cache.tree.walk(PROMPT)
        out.append(path[-1].state if path and not partial and matched == len(PROMPT) else None)
    return out


def _diverged() -> CPAdapter:
    """Two ranks after the prompt's write landed on rank 0 and failed on rank 1."""
    a = CPAdapter(world_size=2, device_pages=2, host_pages=3, write_policy="write_through", layers=1,
                  draft_layers=0)
    for step in (Step("insert", (PROMPT,)), Step("complete_job", (0,)), Step("fail_job", (0,))):
        out = perform(a, step, catch=False)
        assert not out.problems, out.problems
        assert catalogue(a, [PROMPT]) == []
    assert _states(a) == ["device_host", "device"]
    return a


def _run(a: CPAdapter, *steps: Step) -> list[str]:
    for step in steps:
        assert a.applicable(step.op, step.args), step
        out = perform(a, step, catch=False)
        assert not out.problems, out.problems
    return catalogue(a, [PROMPT])


def test_evicting_a_node_whose_copy_failed_on_one_rank_loses_that_ranks_pages():
    """The hazard itself: evict while the ranks disagree (what the scheduler must not do)."""
    with quiet_cache_logs():
        a = _diverged()
        perform(a, Step("evict", (1,)), catch=False)
        problems = catalogue(a, [PROMPT])
    assert _states(a) == ["host", None]
    # the group check names the lost share before the prompt is read back; the read-back still sees it
    assert any(p.startswith("cp_group_host_copy: rank 0 holds node (1, 1) (host)") for p in problems), problems
    assert a.read_kv(PROMPT)[1] != (fingerprints(PROMPT)[1],)


def test_the_engine_waits_for_a_failed_rank_to_back_the_node_up_again():
    with quiet_cache_logs():
        a = _diverged()
        for op, args in (("evict", (1,)), ("insert", ((2,),)), ("evict_host", (1,)), ("load_back", (PROMPT,)),
                         ("reserve", (PROMPT,)), ("layer_end", (0, "target"))):
            assert not a.applicable(op, args), op
        assert a.applicable("complete_job", (0,)) and a.applicable("backup", (PROMPT,))
        assert _run(a, Step("backup", (PROMPT,))) == []
        # only the failed rank writes again
        assert [len(r.cache.executor.pending_jobs()) for r in a.ranks] == [0, 1]
        assert _run(a, Step("complete_job", (0,))) == []
        assert _states(a) == ["device_host", "device_host"]
        assert _run(a, Step("evict", (2,))) == []
    assert _states(a) == ["host", "host"]
    assert a.read_kv(PROMPT) == [(fp,) for fp in fingerprints(PROMPT)]


def test_a_backup_is_a_no_op_once_every_rank_holds_a_host_copy():
    with quiet_cache_logs():
        a = _diverged()
        _run(a, Step("backup", (PROMPT,)), Step("complete_job", (0,)))
        assert perform(a, Step("backup", (PROMPT,)), catch=False).result is None
    assert a.pending_jobs() == []


def test_fuzz_cp_defaults_catch_draft_layers_acked_before_they_landed():
    """Issue 21: a CP write with draft layers is acknowledged only after every target and draft layer
    landed; the planted bug (draft layers marked submitted but never copied) is caught at the defaults."""
    with quiet_cache_logs(), mutant("cp_draft_layers_not_written"):
        result = run_fuzz(cp_machine(coverage=CoverageTracker()), examples=100, steps=40, seed=0, shrink=False)
    assert not result.ok
    assert "cp_ack_after_every_layer" in result.failure and "('draft', 0)" in result.failure


def _steps_of_a_short_run(monkeypatch) -> list[str]:
    from hicache_fsm.testing.stateful import CacheProtocolMachine

    log: list[str] = []
    do = CacheProtocolMachine._do

    def recording(self, op, *args):
        out = do(self, op, *args)
        log.append(repr((op, args, out)))
        return out

    monkeypatch.setattr(CacheProtocolMachine, "_do", recording)
    with quiet_cache_logs():
        assert run_fuzz(cp_machine(), examples=12, steps=20, seed=0, shrink=False).ok
    monkeypatch.undo()
    return log


def test_a_seeded_fuzz_run_does_not_depend_on_what_the_process_imported(monkeypatch, tmp_path):
    """Hypothesis also draws literals (of 100 and more) harvested from loaded modules outside site-packages:
    an in-suite `fuzz --cp` run, after earlier tests had imported more of the package, took other steps
    than a fresh process (and found the divergence above). ``run_fuzz`` draws without them."""
    import importlib
    import sys

    from hypothesis.internal.conjecture import providers

    from hicache_fsm.testing.fixed_draws import without_local_constants

    before = _steps_of_a_short_run(monkeypatch)
    (tmp_path / "constants_of_some_module.py").write_text("LIMITS = (101, 117, 133, 149, 165, 181, 197, 245)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("constants_of_some_module")
    try:
        assert 245 in providers._get_local_constants().integers  # hypothesis harvested the new module
        with without_local_constants() as arranged:
            assert arranged and len(providers._get_local_constants().integers) == 0
        assert 245 in providers._get_local_constants().integers
        assert _steps_of_a_short_run(monkeypatch) == before
    finally:
        sys.modules.pop("constants_of_some_module", None)


def test_ranks_evict_the_same_host_nodes_when_a_backup_is_short_of_host_room():
    """Found while steering `fuzz --cp` to host pressure. A three-page prompt's pages are owned 2:1 by the two
    ranks; each rank's host has one free page. Rank 0's reservation failed and it evicted a host-only node for
    room; rank 1's succeeded and kept that node: the trees differed, and the scheduler (which waits for the
    ranks to agree) could never move again. Now every rank evicts while any rank is short
    (``LayerWriteRuntime.group_shortfall``, computed from the shared tree and the owner function)."""
    a = CPAdapter(world_size=2, device_pages=4, host_pages=3, write_policy="write_through")
    with quiet_cache_logs():
        assert _run(a, Step("insert", ((1, 1, 1, 1),))) == []
        while a.pending_jobs():
            assert _run(a, Step("complete_job", (0,))) == []
        assert _run(a, Step("insert", ((2, 2, 2),))) == []
    trees = [sorted(r.cache.tree.prefix_tokens(n) for n in r.cache.tree.nodes() if n.parent is not None)
             for r in a.ranks]
    assert trees[0] == trees[1], trees
    assert [r.cache.counters["cp_reserve_failed"] for r in a.ranks] == [1, 0]  # rank 0 still records its refusal
    assert [len(r.cache.executor.pending_jobs()) for r in a.ranks] == [3, 3]  # backed up on both ranks
