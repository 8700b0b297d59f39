"""``simulate --trace`` with the bundled trace at its default sizes: every configuration shows what it adds."""

from __future__ import annotations

import json
from pathlib import Path

from hicache_fsm.cli import main
from hicache_fsm.commands.simulate_trace import DEVICE_SHARE, HOST_PER_DEVICE, default_sizes
from hicache_fsm.trace import load_trace, prefix_bound

BUNDLED = Path(__file__).resolve().parents[1] / "examples" / "traces" / "synthetic-chat.jsonl"


def test_default_sizes_follow_the_trace():
    trace = load_trace(str(BUNDLED))
    unique = prefix_bound(trace, 16).unique_tokens
    device, host = default_sizes(trace, 16, None, None)
    assert device % 16 == 0 and device - 16 < max(unique // DEVICE_SHARE, trace.max_input_length) <= device
    assert host == HOST_PER_DEVICE * device and device < unique  # the device cannot hold everything
    assert default_sizes(trace, 16, 4096, None) == (4096, HOST_PER_DEVICE * 4096)
    assert default_sizes(trace, 16, 4096, 9000) == (4096, 9000)


def test_bundled_trace_shows_four_columns_and_no_progress_off_a_terminal(capsys):
    assert main(["simulate", "--trace", str(BUNDLED), "--json"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert "requests (" not in err  # stderr is not a terminal here: the table only, no progress lines
    rates = [report["configs"][name]["hit_rate"] for name in ("device", "device+host", "device+host+storage")]
    assert rates[0] < rates[1] < rates[2] <= report["hit_rate_bound"]
    full = report["configs"]["device+host+storage"]
    assert full["hit_rate_host"] > 0 and full["hit_rate_storage"] > 0
    assert report["configs"]["device"]["device_tokens"] < report["unique_tokens"]
