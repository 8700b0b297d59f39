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
        assert result[f"{name}_beside_us_per_request"] > 0  # rendering (and sending) is counted, not hidden
        assert (result[f"{name}_process_cpu_overhead_pct"] is None) == (clock == "wall")
    assert '"benchmark": "events"' in capsys.readouterr().out
