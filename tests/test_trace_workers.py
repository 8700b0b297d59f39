"""Configurations (and sweep sizes) replayed in worker processes (``simulate --trace --jobs N``) give the in-process figures."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from hicache_fsm.cli import main
from hicache_fsm.trace import load_trace
from hicache_fsm.trace_replay import TraceOptions, run_trace
from hicache_fsm.trace_workers import in_workers

SHIPPED = Path(__file__).resolve().parent.parent / "examples" / "traces" / "synthetic-chat.jsonl"
TIMINGS = ("wall_s", "controller_s", "transfer_s", "controller_by_call", "prefetch_wait_s", "agreement_s")


def figures(sim) -> list[dict]:
    """Every configuration's result and latency, less what the clock measured."""
    out = []
    for t in sim.tiers:
        out.append(({k: v for k, v in attrs.asdict(t).items() if k not in TIMINGS}, sim.latency[t.name]))
    return out


def test_workers_give_the_in_process_figures():
    trace = load_trace(SHIPPED)
    options = TraceOptions(trace, device_tokens=16384, host_tokens=65536, storage_url="memory://", device="cpu")
    alone = run_trace(options, sweep=[4096, 32768])
    parallel = run_trace(options, sweep=[4096, 32768], elsewhere=in_workers(2))
    assert [t.name for t in parallel.tiers] == [t.name for t in alone.tiers]
    assert figures(parallel) == figures(alone)
    assert parallel.sweep == alone.sweep and len(alone.sweep) == 2


@pytest.mark.parametrize("value", ["0", "-1", "two", "1000"])
def test_cli_refuses_a_bad_job_count(value, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--trace", str(SHIPPED), "--jobs", value, "--no-progress"])
    assert exc.value.code == 2
    assert "--jobs" in capsys.readouterr().err


def test_jobs_needs_a_trace(capsys):
    assert main(["simulate", "--jobs", "2", "--no-progress"]) == 2
    assert "--jobs needs --trace" in capsys.readouterr().err
