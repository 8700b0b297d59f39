"""``bench storage --url mooncake://...``: the benchmark sizes its segment, or says what to pass; never an assert."""

from __future__ import annotations

import json

from hicache_fsm.bench.storage import mooncake_segment_mb, sized_mooncake_url
from hicache_fsm.cli import main

SMALL = ["--pages", "4", "--page-tokens", "16", "--layers", "2", "--kv-heads", "2", "--head-dim", "32",
         "--repeats", "1"]


def test_segment_is_sized_unless_given():
    assert sized_mooncake_url("mooncake://h:1", 32, 4 << 20) == f"mooncake://h:1?segment_mb={mooncake_segment_mb(32, 4 << 20)}"
    assert mooncake_segment_mb(32, 4 << 20) * (1 << 20) >= 2 * 32 * (4 << 20) / 0.9  # both copies, under 90% full
    assert sized_mooncake_url("mooncake://h:1?segment_mb=4096", 32, 4 << 20) == "mooncake://h:1?segment_mb=4096"


def test_too_small_a_segment_is_one_line_exit_2(capsys):
    assert main(["bench", "storage", "--url", "mooncake://127.0.0.1:1?segment_mb=1", "--pages", "64"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "segment_mb=1 cannot hold" in line and "pass segment_mb=" in line


def test_default_segment_runs_against_a_real_master(mooncake_master, capsys):
    url = mooncake_master.url.split("?")[0] + "?listen=any"  # no segment_mb: the benchmark sizes it
    assert main(["bench", "storage", "--json", "--url", url, *SMALL]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["set_gbps"] > 0 and report["raw_get_gbps"] > 0
