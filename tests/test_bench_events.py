"""``bench events`` reports every figure it documents, and its publisher sends every batch (no timing asserted)."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from hicache_fsm.bench import events  # noqa: E402


@pytest.mark.parametrize("clock", ["thread", "wall"])
def test_bench_events_reports_the_serving_thread_and_the_work_beside_it(clock, capsys):
    parser = argparse.ArgumentParser()
    events.configure(parser)
    args = parser.parse_args(["--requests", "4", "--repeats", "1", "--tree-nodes", "8", "--clock", clock])
    args.json = True
    result = events.run(args)
    assert result["events_per_request"] == 2.0  # stored on the device, then on the host
    assert result["zmq_dropped"] == 0
    for name in ("off", "inprocess", "zmq"):
        assert result[f"{name}_us_per_request"] > 0
    for name in ("inprocess", "zmq"):
        assert result[f"{name}_beside_cpu_us_per_request"] > 0  # rendering (and sending) is counted, not hidden
        for figure in ("serving_best_chunk_pct", "serving_median_chunk_pct"):
            assert isinstance(result[f"{name}_{figure}"], float)
        for figure in ("process_cpu_median_chunk_pct", "process_cpu_pct"):
            assert (result[f"{name}_{figure}"] is None) == (clock == "wall")
    assert result["target_pct"] == 10.0
    assert '"benchmark": "events"' in capsys.readouterr().out
