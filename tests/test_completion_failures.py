"""One failing completion never loses the others; no node waits for a job that does not exist; traces end clean."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_helpers import make_cache, pages, put
from hicache_fsm.errors import CompletionsFailed, StorageKeyError, UnknownJob
from hicache_fsm.jobs import Completion
from hicache_fsm.storage.memory import MemoryBackend
from hicache_fsm.testing.trace import TraceRecorder, replay


def _poison_keys(cache, monkeypatch, poisoned: set[int]) -> None:
    """Storage keys of the ``poisoned`` nodes cannot be computed (a fault at the storage edge)."""
    keys_for = cache.storage.keys_for

    def faulty(node):
        if node.id in poisoned:
            raise StorageKeyError(f"no key for node {node.id} (injected)")
        return keys_for(node)

    monkeypatch.setattr(cache.storage, "keys_for", faulty)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(2, 6), data=st.data())
def test_bad_completions_in_a_batch_lose_none_of_the_good_ones(monkeypatch, n, data):
    cache, ex = make_cache(device_pages=32, host_pages=64)
    try:
        cache.attach_storage(MemoryBackend())
        nodes = [put(cache, [100 * (i + 1) + t for t in range(8)]).node for i in range(n)]
        cache.flush()
        d2h = list(ex.pending_job_ids())
        assert len(d2h) == n
        poisoned = data.draw(st.sets(st.sampled_from([x.id for x in nodes]), max_size=n), label="poisoned")
        _poison_keys(cache, monkeypatch, poisoned)
        unknown = data.draw(st.lists(st.sampled_from([10**9, -3, d2h[0] + 10**6]), max_size=3), label="unknown")
        fails = data.draw(st.sets(st.sampled_from(d2h), max_size=n), label="failed")
        good = [ex.fail(j) if j in fails else ex.complete(j) for j in d2h]
        batch = ex.poll() + [Completion(j) for j in unknown]
        random.Random(data.draw(st.integers(0, 2**16), label="order")).shuffle(batch)
        ex._queue.extend(batch)  # the executor reports them in this order, the bad ones mixed in
        stranded = {node.id for node, c in zip(nodes, good) if c.ok and node.id in poisoned}
        failures = []
        if unknown or stranded:
            with pytest.raises(CompletionsFailed) as info:
                cache.poll()
            failures = info.value.failures
            assert sorted(c.job_id for c in info.value.applied) == sorted(d2h)
        else:
            assert sorted(c.job_id for c in cache.poll()) == sorted(d2h)
        assert sorted(f.completion.job_id for f in failures if isinstance(f.error, UnknownJob)) == sorted(unknown)
        keyless = {f.completion.job_id for f in failures if isinstance(f.error, StorageKeyError)}
        for node, c in zip(nodes, good):
            if not c.ok:
                assert node.state == "device"  # the failed backup was applied
            elif node.id in poisoned:
                assert node.state == "device_host" and c.job_id in keyless  # acked; its store could not start
            else:
                assert node.state in ("device_host_storing", "device_host_stored")
        assert not set(d2h) & set(cache.pending_job_ids())  # every D2H job ended, none lost
        cache.check_invariants()
    finally:
        cache.close()


def test_a_completion_whose_store_cannot_start_leaves_the_node_acked_not_in_flight(monkeypatch):
    """The issue's reproducer shape: the D2H ack lands, the H2S job cannot be built; the node is not stranded."""
    cache, ex = make_cache()
    try:
        cache.attach_storage(MemoryBackend())
        a, b, c = (put(cache, range(s, s + 8)).node for s in (1, 100, 200))
        _poison_keys(cache, monkeypatch, {b.id})
        cache.flush()
        ex.complete_all()
        with pytest.raises(CompletionsFailed, match="injected") as info:
            cache.poll()
        assert [type(f.error) for f in info.value.failures] == [StorageKeyError]
        assert len(info.value.applied) == 3  # every D2H job ended; one follow-up could not start
        assert b.state == "device_host" and not b.pending_jobs
        assert {a.state, c.state} <= {"device_host_storing", "device_host_stored"}
        cache.check_invariants()
    finally:
        cache.close()


def test_invariant_catches_a_node_in_flight_without_a_job():
    cache, ex = make_cache()
    node = put(cache, pages(2)).node
    assert node.state == "writing_host"
    (job,) = cache.pending_job_ids()
    cache.outbox.forget(job)
    node.pending_jobs.discard(job)
    problems = [p for p in cache.invariant_violations() if p.startswith("in_flight_has_job")]
    assert problems == [f"in_flight_has_job: node {node.id} is writing_host but no pending d2h job covers it"]


# ------------------------------------------------------------------ traces: every completion is observed


def test_storage_trace_of_simulate_replays_with_no_job_pending(tmp_path):
    trace = tmp_path / "t.jsonl"
    run = subprocess.run(
        [sys.executable, "-m", "hicache_fsm.cli", "simulate", "--clients", "8", "--rounds", "3",
         "--request-length", "32", "--output-length", "8", "--system-prompt-length", "32", "--page-size", "4",
         "--device-tokens", "192", "--host-tokens", "384", "--no-progress",
         "--record", str(trace), "--record-tier", "device+host+storage"],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr
    text = trace.read_text()
    assert '"h2s"' in text and '"s2h"' in text  # storage backups and prefetches were recorded
    result = replay(trace, require_quiescent=True)
    assert result.ok, result.divergence.format()
    assert result.pending_jobs == []


def test_cp_trace_replays_with_no_job_pending():
    from test_cp_layer_write import settle, world_of, write_kv

    ranks = world_of(2)
    recorders = [TraceRecorder(r.cache) for r in ranks]
    tokens = tuple(range(1, 13))
    idx = [r.cache.alloc_device(len(tokens)) for r in ranks]
    nodes = [r.cache.insert(tokens, i).node for r, i in zip(ranks, idx)]
    for r, n in zip(ranks, nodes):
        r.writes.reserve(n)
    for source, layer in [("target", 0), ("draft", 0), ("target", 1), ("draft", 1), ("target", 2)]:
        for r, i in zip(ranks, idx):
            write_kv(r, i, tokens, layer, source)
            r.writes.on_layer_end(layer, source)
    for r, n in zip(ranks, nodes):
        settle(r.cache)
        assert n.state == "device_host"
        r.cache.evict(100)
        m = r.cache.match_prefix(tokens)
        r.cache.load_back(m.last_host_node)
        settle(r.cache)
        r.cache.check_invariants()
    for rec in recorders:
        assert any(e.get("event") == "job" and "layer" in e for e in rec.events)
        result = replay(rec.events, require_quiescent=True)
        assert result.ok, result.divergence.format()
        assert result.pending_jobs == []
