"""Cluster replay: N caches behind a router fed by KV events; the event-built index matches every cache."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hicache_fsm.cluster_replay import ClusterOptions, run_cluster, sweep_cluster
from hicache_fsm.errors import ConfigError
from hicache_fsm.trace import load_trace
from hicache_fsm.trace_replay import ReplayProgress

pytest.importorskip("zmq")


@pytest.fixture
def trace_file(tmp_path):
    """Three conversations of four turns, each turn extending its conversation's prefix."""
    lines, ts = [], 0
    for turn in range(4):
        for conv in range(3):
            ids = [100 * conv + i for i in range(turn + 2)]
            lines.append(json.dumps({"timestamp": ts, "input_length": 64 * len(ids), "output_length": 8,
                                     "hash_ids": ids}))
            ts += 10
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _options(trace_file, **kw) -> ClusterOptions:
    trace = load_trace(str(trace_file), 64)
    base = dict(instances=3, device_tokens=1024, host_tokens=2048, page_size=16, device="cpu", verify_every=1)
    base.update(kw)
    return ClusterOptions(trace, **base)


@pytest.mark.parametrize("storage", [False, True])
def test_index_built_from_events_matches_every_instance_after_every_request(trace_file, storage):
    result = run_cluster(_options(trace_file, policy="round_robin", storage=storage,
                                  storage_url="memory://cluster-test" if storage else None))
    assert result.index_checks == 12 * 3
    assert result.index_agreements == result.index_checks
    assert result.staleness.decisions == 12
    assert [r.requests for r in result.results] == [4, 4, 4]


def test_prefix_aware_keeps_a_conversation_on_one_instance_and_hits_more(trace_file):
    # two instances for three conversations: round robin moves every conversation at each turn
    rr = run_cluster(_options(trace_file, instances=2, policy="round_robin", storage=False))
    pa = run_cluster(_options(trace_file, instances=2, policy="prefix_aware", storage=False))
    assert pa.hit_rate > rr.hit_rate
    assert pa.staleness.exact == pa.staleness.decisions  # a current view predicts every hit


def test_each_instance_reports_the_prompt_tokens_it_reused(trace_file):
    """``prefill_tokens_reused`` was 0 for every instance: the replay kept it in its latency figures alone."""
    pa = run_cluster(_options(trace_file, instances=2, policy="prefix_aware", storage=False))
    rows = [r.as_dict() for r in pa.results]
    assert sum(row["prefill_tokens_reused"] for row in rows) > 0
    for row in rows:
        assert row["prefill_tokens_reused"] == row["prefill_tokens_saved"]


def test_a_lagging_view_shows_up_as_stale_predictions(trace_file):
    lagging = run_cluster(_options(trace_file, policy="prefix_aware", storage=False, event_lag=3))
    assert lagging.staleness.as_dict()["mean_batches_behind"] > 0
    assert lagging.index_checks == 0  # the index is compared only when it is meant to be current


def test_a_lag_of_k_requests_leaves_the_router_k_requests_behind(trace_file):
    """Lag 1 was lag 0 (the current request has published nothing yet): now each request of lag K is at least a
    batch behind for every lagging request that published one."""
    behind = {}
    for lag in (0, 1, 3):
        result = run_cluster(_options(trace_file, policy="round_robin", storage=False, event_lag=lag))
        behind[lag] = result.staleness.as_dict()["mean_batches_behind"]
    assert behind[0] < 0.5 < 1 <= behind[1] < behind[3] and behind[3] >= 2.5, behind


@pytest.mark.parametrize("kw, named", [
    (dict(instances=0), "instances"), (dict(policy="random"), "policy"), (dict(event_lag=-1), "event-lag"),
    (dict(storage_url="memory://"), "memory://NAME"), (dict(storage_url=5), "storage URL 5"),
    # pool options are refused with the options, not when the replay builds the first cache
    (dict(device_tokens=0), "device_tokens"), (dict(device_tokens=100), "not a multiple of page_size"),
    (dict(host_tokens=64, device_tokens=128), "must be larger than device_tokens"),
    (dict(layout="sideways"), "layout"), (dict(device="tpu"), "device must be"),
])
def test_bad_cluster_options_are_config_errors(trace_file, kw, named):
    with pytest.raises(ConfigError, match=named):
        _options(trace_file, **kw)


def _simulate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hicache_fsm", "simulate", *args], capture_output=True, text=True)


def test_cli_cluster_replay_json(trace_file):
    proc = _simulate("--trace", str(trace_file), "--block-size", "64", "--instances", "2", "--router",
                     "prefix_aware_capped", "--device-tokens", "1024", "--host-tokens", "2048", "--no-storage",
                     "--device", "cpu", "--no-progress", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["instances"] == 2 and out["policy"] == "prefix_aware_capped"
    assert out["index_agreements"] == out["index_checks"] > 0
    assert "router view" in proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--router", "round_robin"], "--router needs --instances"),
    (["--router", "prefix_aware", "--event-lag", "0"], "--router, --event-lag need --instances"),  # the defaults
    (["--instances", "0"], "instances must be a positive int"),
    (["--instances", "2", "--sweep", "x"], "instance counts"),
    (["--instances", "2", "--router", "prefix_aware_capped", "--load-cap", "0.5"], "load cap must be a number >= 1"),
    # options that would do nothing
    (["--instances", "2", "--sweep", "1,2", "--router", "round_robin"], "--router picks one policy"),
    (["--instances", "2", "--load-cap", "2"], "--load-cap is prefix_aware_capped's"),
])
def test_cli_cluster_usage_errors_are_one_line_and_exit_2(trace_file, args, message):
    proc = _simulate("--trace", str(trace_file), "--block-size", "64", "--no-progress", *args)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_a_sweep_of_one_count_and_one_policy_is_one_replay(trace_file):
    """A policy given alone was read letter by letter ('router policy ... got 'r'')."""
    [result] = sweep_cluster(_options(trace_file, storage=False), 2, "round_robin")
    assert (result.instances, result.policy) == (2, "round_robin")


def test_a_sweep_counts_its_progress_against_every_run(trace_file):
    """Each run set the total to its own requests: a sweep's count went to 585% of it."""
    progress = ReplayProgress(enabled=False)
    results = sweep_cluster(_options(trace_file, storage=False), [1, 2], progress=progress)
    assert len(results) == 6 and progress.done == progress.total == 6 * 12


def test_replayed_configurations_report_no_chat_ttft_and_no_host_where_none(trace_file):
    result = run_cluster(_options(trace_file, policy="round_robin", storage=False, instances=2))
    for row in result.as_dict()["per_instance"]:
        assert "ttft_ms_mean" not in row and "ttft_ms_p90" not in row and row["host_tokens"] == 2048
