"""The protocol fuzzing and verification toolkit (hicache_fsm.testing) against our own cache."""

from __future__ import annotations

import json
import logging
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_fsm.cli import main
from hicache_fsm.errors import ConfigError
from hicache_fsm.spec import load_all, load_builtin
from hicache_fsm.testing import (
    Bounds,
    CoverageTracker,
    HiCacheAdapter,
    Step,
    catalogue,
    explore,
    fault_schedules,
    hicache_machine,
    load_trace,
    multi_turn_workloads,
    perform,
    record,
    replay,
    run_path,
    spec_paths,
)
from hicache_fsm.testing.adapter import CacheAdapter, NotSupported

pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.usefixtures("quiet_logs")]


# ------------------------------------------------------------------ the stateful machine in our suite

HiCacheProtocol = hicache_machine(name="HiCacheProtocol", examples=40, steps=30)
TestHiCacheProtocol = HiCacheProtocol.TestCase


# ------------------------------------------------------------------ engine-like workloads with fault schedules


def _run_workload(adapter: CacheAdapter, workload, schedule) -> None:
    """Serve a workload like an engine; acknowledge jobs as the schedule says; check after every step."""
    ordinal = 0
    rng = random.Random(schedule.shuffle_seed)
    prompts = []
    for n, req in enumerate(workload.requests):
        for step in (Step("match", (req.tokens,)), Step("load_back", (req.tokens,)), Step("lock", (req.tokens,)),
                     Step("insert", (req.tokens,))):
            out = perform(adapter, step, catch=False)
            assert not out.problems, out.problems
            if step.op == "insert":
                prompts.append(req.tokens)
            assert not catalogue(adapter, prompts), catalogue(adapter, prompts)
        if adapter.held_locks():
            assert not perform(adapter, Step("unlock", (0,))).problems
        if n % schedule.ack_every == 0:
            jobs = [j.id for j in adapter.pending_jobs()]
            if schedule.ack_order == "lifo":
                jobs.reverse()
            elif schedule.ack_order == "shuffle":
                rng.shuffle(jobs)
            for job_id in jobs:
                ids = [j.id for j in adapter.pending_jobs()]
                if job_id not in ids:
                    continue
                op = "fail_job" if ordinal in schedule.fail_jobs else "complete_job"
                ordinal += 1
                out = perform(adapter, Step(op, (ids.index(job_id),)), catch=False)
                assert not out.problems, out.problems
                problems = catalogue(adapter, prompts)
                assert not problems, problems


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(workload=multi_turn_workloads(), schedule=fault_schedules(),
       policy=st.sampled_from(["write_through", "write_back", "write_behind"]))
def test_multi_turn_workloads_with_faults(workload, schedule, policy):
    adapter = HiCacheAdapter(device_pages=6, host_pages=6, write_policy=policy)
    _run_workload(adapter, workload, schedule)
    while adapter.pending_jobs():  # drain: every job ends exactly once
        assert not perform(adapter, Step("complete_job", (0,))).problems
    assert not catalogue(adapter, workload.prompts)


def test_unsupported_operations_are_skipped():
    class Minimal(CacheAdapter):
        def insert(self, tokens):
            return False

        def match(self, tokens):
            raise AssertionError

        def read_kv(self, tokens):
            return []

        def invariant_violations(self):
            return []

    a = Minimal()
    assert not a.supports("lock") and not a.supports("prefetch") and a.supports("insert")
    assert perform(a, Step("lock", ((1,),))).skipped
    with pytest.raises(NotSupported):
        a.prefetch((1,))


# ------------------------------------------------------------------ model-based spec paths

PATHS = spec_paths()


@pytest.mark.parametrize("path", PATHS, ids=str)
def test_spec_path(path):
    visited = run_path(path)
    assert visited[-1] == path.final_state


def test_spec_paths_reach_every_state_and_transition():
    for spec in load_all():
        mine = [p for p in PATHS if p.spec.name == spec.name]
        states = {p.final_state for p in mine if p.goal.startswith("state:")}
        assert states == set(spec.state_names), spec.name
        fired = {(s.trigger, s.source, s.dest) for p in mine for s in p.steps}
        assert fired == {(t.trigger, s, t.dest) for t in spec.transitions for s in t.sources}, spec.name


# ------------------------------------------------------------------ the explorer


@pytest.mark.parametrize("policy, depth", [("write_through", 5), ("write_back", 6)])  # the default families' depths
def test_explorer_finds_no_violation_on_the_real_cache(policy, depth):
    cov = CoverageTracker()
    result = explore(Bounds(nodes=2, device_pages=2, host_pages=2, write_policy=policy, max_depth=depth), coverage=cov)
    assert result.complete and not result.violations, [v.format() for v in result.violations]
    assert result.states > 100 and result.transitions > result.states
    summary = result.to_json()
    assert {"states", "transitions", "violations", "complete"} <= set(summary)
    # without storage, every residency state and transition that does not involve L3 is reached
    rep = cov.report(["residency"])["residency"]
    assert all("stor" in s for s in rep["missing_states"]), rep["missing_states"]
    assert all("stor" in t or "prefetched" in t for t in rep["missing_transitions"]), rep["missing_transitions"]


@given(field=st.sampled_from(["nodes", "device_pages", "host_pages", "layers", "page_size", "alphabet",
                               "max_prefetches", "max_len", "max_depth", "max_states", "max_locks", "max_pins"]),
       value=st.one_of(st.integers(-3, 0), st.just("2"), st.just(2.0), st.just(True)))
def test_bounds_that_would_explore_nothing_meaningful_are_refused(field, value):
    """A run over such bounds would report a complete, clean exploration of next to nothing."""
    if field in ("max_locks", "max_pins") and isinstance(value, int) and not isinstance(value, bool) and value == 0:
        Bounds(**{field: value})  # no locks / pins held at once: a narrower but meaningful action set
        return
    with pytest.raises(ConfigError, match=f"Bounds.{field} must be an int >= "):
        Bounds(**{field: value})


@pytest.mark.parametrize("kwargs", [{"max_len": 0}, {"alphabet": -1}, {"max_jobs": 0}, {"max_depth": 0},
                                    {"max_states": 0}, {"max_entries": -1}, {"max_len": "3"}])
def test_store_bounds_that_would_explore_nothing_meaningful_are_refused(kwargs):
    from hicache_fsm.testing.blockstore import StoreBounds

    (field, _), = kwargs.items()
    with pytest.raises(ConfigError, match=f"StoreBounds.{field} must be an int >= "):
        StoreBounds(**kwargs)
    assert StoreBounds(max_entries=0).max_entries == 0  # nothing held: the admission path alone, still meaningful


def test_explorer_write_through_selective():
    """Regression: match_prefix's selective backup once host-evicted a node of its own result."""
    result = explore(Bounds(nodes=3, device_pages=2, host_pages=2, write_policy="write_through_selective",
                            max_depth=4), stop_on_first=True)
    assert not result.violations, result.violations[0].format()


def test_explorer_counterexample_replays():
    from hicache_fsm.testing.mutants import mutant

    with mutant("split_drops_job"):
        bounds = Bounds(nodes=2, device_pages=2, host_pages=2)
        from hicache_fsm.testing.explorer import Explorer

        ex = Explorer(bounds=bounds, stop_on_first=True)
        result = ex.run()
        assert result.violations
        trace = result.violations[0].trace
        assert ex.replay(trace)  # the shortest trace reproduces the problem on a fresh cache
        assert not ex.replay(trace[:-1])  # and is minimal at its end


def test_clone_is_independent():
    a = HiCacheAdapter(device_pages=3, host_pages=3, layers=2)
    a.insert((1, 2))
    a.match((1,))
    before = a.snapshot()
    b = a.clone()
    assert b.snapshot() == before and b.state_key() == a.state_key()
    b.complete_job(b.pending_jobs()[0].id)
    b.insert((3,))
    b.evict(3)
    assert a.snapshot() == before and not catalogue(a, [(1, 2)])
    assert not catalogue(b, [(1, 2), (3,)])
    a.complete_job(a.pending_jobs()[0].id)  # the original still works on its own
    assert not catalogue(a, [(1, 2)])


# ------------------------------------------------------------------ traces


def _workload_trace():
    a = HiCacheAdapter(device_pages=3, host_pages=3, layers=1)
    rec = record(a.cache)
    a.insert((1, 2))
    a.insert((1, 3))
    a.match((1,))
    for j in a.pending_jobs():
        a.complete_job(j.id)
    a.insert((2,))
    a.evict(2)
    a.load_back((1, 2))
    for j in a.pending_jobs():
        a.fail_job(j.id)
    a.load_back((1, 2))
    for j in a.pending_jobs():
        a.complete_job(j.id)
    a.evict_host(3)
    return rec


def test_trace_round_trip(tmp_path):
    rec = _workload_trace()
    path = tmp_path / "run.jsonl"
    rec.dump(path)
    result = replay(path, require_quiescent=True)
    assert result.ok, result.divergence.format()
    assert result.transitions > 10 and result.completions == result.jobs
    assert main(["replay", str(path)]) == 0
    marked = tmp_path / "marked.jsonl"  # saved by an editor that starts UTF-8 with a byte-order mark
    marked.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert load_trace(marked) == load_trace(path)
    assert main(["replay", str(marked)]) == 0


def test_a_trace_that_is_not_utf8_is_refused_by_its_line(tmp_path, capsys):
    """Past the first 8 KiB, which text mode decodes as one chunk: the error still names the line."""
    lines = _workload_trace().lines() * 4  # never replayed: the file is refused before
    assert len("\n".join(lines)) > 8192
    bad = len(lines) + 1
    path = tmp_path / "damaged.jsonl"
    path.write_bytes("".join(line + "\n" for line in lines).encode() + b'{"event": "\xff"}\n' + b"{}\n")
    with pytest.raises(ValueError, match=f"^trace line {bad}: not UTF-8 text \\(byte 0xff"):
        load_trace(path)
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"hicache-fsm replay: trace line {bad}: not UTF-8 text (byte 0xff; a binary file?)"]


@pytest.mark.parametrize("event, reason", [
    ({"event": "job", "job": [1, 2], "kind": "d2h"}, "job event: 'job' must be an integer or a string, got [1, 2]"),
    ({"event": "job", "job": 9, "kind": "d2h", "nodes": [{}]}, "'nodes' must be an integer or a string, got {}"),
    ({"event": "transition", "machine": ["x"], "node": 1, "trigger": "insert", "source": "absent", "dest": "device"},
     "'machine' must be a string"),
    ({"event": "transition", "node": 1, "source": "absent", "dest": "device"}, "transition event without 'trigger'"),
    ({"event": "transition", "trigger": "insert", "source": "absent", "dest": "device"},
     "without 'node' or 'object'"),
    ({"event": "completion", "job": 0, "ok": "yes"}, "'ok' must be true or false"),
    ({"event": "split", "node": True, "upper": 2}, "'node' must be an integer or a string, got true"),
    ({"event": "transition", "machine": "../specs/residency", "node": 1, "trigger": "insert", "source": "absent",
      "dest": "device"}, "unknown machine '../specs/residency'"),
])
def test_an_event_of_the_wrong_shape_is_a_divergence_naming_its_field(tmp_path, capsys, event, reason):
    """A trace is untrusted input: a field of the wrong JSON type is reported at its line, never a traceback."""
    lines = _workload_trace().lines()
    path = tmp_path / "odd.jsonl"
    path.write_text("".join(line + "\n" for line in lines[:3]) + json.dumps(event) + "\n")
    result = replay(path)
    assert not result.ok and result.divergence.line == 4 and reason in result.divergence.reason
    assert main(["replay", str(path)]) == 1
    out, err = capsys.readouterr()
    assert reason in out and "Traceback" not in out + err


@pytest.mark.parametrize("tamper", ["dest", "double_completion", "skipped_transition"])
def test_tampered_trace_is_rejected(tmp_path, tamper, capsys):
    events = [json.loads(line) for line in _workload_trace().lines()]
    if tamper == "dest":
        i = next(i for i, e in enumerate(events) if e.get("trigger") == "write_done")
        events[i]["dest"] = "host"
    elif tamper == "double_completion":
        i = next(i for i, e in enumerate(events) if e["event"] == "completion")
        events.insert(i + 1, dict(events[i]))
    else:
        i = next(i for i, e in enumerate(events) if e.get("trigger") == "backup")
        del events[i]
    for seq, e in enumerate(events):  # renumbered, as a careful tamperer would: the check below still catches it
        e["seq"] = seq
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    result = replay(path)
    assert not result.ok
    if tamper == "skipped_transition":  # noticed where the node next moves from a state it is not in
        assert result.divergence.line > i and "is in 'device'" in result.divergence.reason
    else:
        assert result.divergence.line == i + 1 + (tamper == "double_completion")
    assert main(["replay", str(path)]) == 1
    assert f"line {result.divergence.line}" in capsys.readouterr().out


# ------------------------------------------------------------------ the commands


def test_check_command_json(capsys):
    rc = main(["check", "--nodes", "2", "--device-pages", "2", "--host-pages", "1", "--max-depth", "4", "--quiet",
               "--json"])
    out = capsys.readouterr().out
    summary = json.loads(out)
    assert rc == 0 and summary["violations"] == 0 and summary["states"] > 10 and summary["complete"]


def test_fuzz_command_json(capsys):
    rc = main(["fuzz", "--examples", "10", "--steps", "15", "--seed", "3", "--quiet", "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert rc == 0 and summary["ok"] and summary["seed"] == 3


def test_fuzz_failure_becomes_a_runnable_test():
    from hicache_fsm.testing.mutants import mutant
    from hicache_fsm.testing.stateful import run_fuzz

    with mutant("double_ack"):
        machine = hicache_machine(name="HiCacheMachine")
        result = run_fuzz(machine, examples=200, steps=30, seed=0, wrap='mutant("double_ack")',
                          machine_import="from hicache_fsm.testing.stateful import hicache_machine\n"
                                         "from hicache_fsm.testing.mutants import mutant\n"
                                         "HiCacheMachine = hicache_machine(name='HiCacheMachine')")
    assert not result.ok and result.steps
    namespace: dict = {}
    exec(compile(result.test_code, "<regression>", "exec"), namespace)  # noqa: S102 - our own generated test
    with pytest.raises(AssertionError, match="accepted again"):
        namespace["test_fuzz_regression"]()


def test_logging_is_restored():
    logger = logging.getLogger("hicache_fsm")
    assert logger.level == logging.ERROR  # inside the autouse fixture


@pytest.mark.parametrize("options, named", [
    ({"write_polcy": "write_back"}, "unknown option"),  # a misspelt CacheConfig field was a TypeError
    ({"storage": "yes"}, "storage must be True or False"),  # was taken as storage on
    ({"page_size": -1}, "page_size must be an int >= 1"),  # the pools named only the product, size_tokens -4
    ({"device_pages": 0}, "device_pages"),
    ({"host_pages": 2.0}, "host_pages"),
])
def test_the_adapter_names_an_option_it_cannot_use(options, named):
    with pytest.raises(ConfigError, match=named):
        HiCacheAdapter(**options)


def test_a_closed_recording_records_nothing_more(tmp_path):
    """close() left the recorder observing: a long-running engine kept appending events (and paying for them)."""
    from hicache_fsm.testing import record

    adapter = HiCacheAdapter(device_pages=3, host_pages=3)
    path = tmp_path / "run.jsonl"
    with record(adapter.cache, path) as recording:
        adapter.insert((1, 2))
    seen = len(recording.events)
    adapter.insert((3, 4))
    for job in adapter.pending_jobs():
        adapter.complete_job(job.id)
    assert len(recording.events) == seen and len(path.read_text().splitlines()) == seen
    assert not adapter.cache.driver.observed
    recording.close()  # idempotent


@pytest.mark.parametrize("meta, named", [({"event": "run"}, "header's own fields"), ({"version": 2}, "version"),
                                         ({"when": object()}, "meta must be JSON")])
def test_meta_that_would_spoil_the_header_is_refused_before_a_file_is_written(tmp_path, meta, named):
    from hicache_fsm.testing import record

    adapter = HiCacheAdapter()
    with pytest.raises(ConfigError, match=named):
        record(adapter.cache, tmp_path / "run.jsonl", **meta)
    assert not (tmp_path / "run.jsonl").exists() and not adapter.cache.driver.observed


@pytest.mark.parametrize("options, named", [
    ({"context": -1}, "context"),  # deque's ValueError before
    ({"context": "4"}, "context"),
    ({"specs": "residency"}, "Spec objects"),  # its letters were taken as specs: AttributeError
    ({"specs": ["residency"]}, "Spec objects"),
    ({"require_quiescent": "yes"}, "require_quiescent"),
])
def test_replay_names_an_option_it_cannot_use(options, named):
    from hicache_fsm.testing import record, replay

    adapter = HiCacheAdapter()
    with record(adapter.cache) as recording:
        adapter.insert((1, 2))
    with pytest.raises(ConfigError, match=named):
        replay(recording.text(), **options)
    assert replay(recording.text(), specs=load_builtin("residency")).ok  # one Spec alone is fine


@pytest.mark.parametrize("options, named", [
    ({"world_size": 0}, "world_size"),  # no rank: every run passed, checking nothing
    ({"world_size": "2"}, "world_size"),
    ({"bogus": 1}, "CPAdapter: unknown option"),
])
def test_the_cp_adapter_names_an_option_it_cannot_use(options, named):
    from hicache_fsm.testing.cp import CPAdapter

    with pytest.raises(ConfigError, match=named):
        CPAdapter(**options)
