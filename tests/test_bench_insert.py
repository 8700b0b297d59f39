"""``bench insert``: every variant's insert by position after a collection, ours split into with and without its backup.

Nothing here reads a figure as fast or slow (the machine is shared); the tests
check what the figures are made of: one sample per position and round, the
backup part taken out of the same calls, one backup started by every timed
insert of ours, and bad arguments refused in one line.
"""

from __future__ import annotations

import json
import sys

import pytest

from hicache_fsm import cli
from hicache_fsm.bench import insert, scale


def test_each_position_has_a_median_for_every_variant_and_ours_without_its_backup_is_never_above_ours():
    out = insert.measure(nodes=64, blocks=3, block=5, warmup=4)
    names = ["ours", "ours_nobackup", *scale.BASELINES]
    assert list(out["positions"]) == names and out["baselines"] == list(scale.BASELINES)
    for name in names:
        assert len(out["positions"][name]) == 5 and all(us >= 0 for us in out["positions"][name])
    # the same calls less a non-negative part: every order statistic, and so every median, is no larger
    for with_backup, without in zip(out["positions"]["ours"], out["positions"]["ours_nobackup"]):
        assert without <= with_backup
    assert out["mean_us"]["ours_nobackup"] <= out["mean_us"]["ours"]
    for name in scale.BASELINES:
        assert set(out[f"vs_{name}"]) == {"insert", "insert_nobackup", "first", "first_nobackup", "warm",
                                          "warm_nobackup"}


@pytest.mark.parametrize("request_kind,backups", [("new", 12), ("finished", 12), ("cached", 0)])
def test_every_timed_insert_of_ours_that_adds_ids_starts_one_host_backup(request_kind, backups):
    """The figure it splits off is real: write_through backs up the node each insert adds (host full: evicting for
    room), and an insert of a request cached just before adds nothing, so it backs up nothing."""
    out = insert.measure(nodes=32, blocks=4, block=3, warmup=60, request=request_kind)
    assert out["timed_inserts"] == 12 and out["request"] == request_kind
    assert out["ours_backups_started"] == backups
    if not backups:
        assert out["positions"]["ours_nobackup"] == out["positions"]["ours"]


def test_the_command_prints_one_json_object_and_names_each_id_form(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # no peer, whatever this machine has
    argv = ["bench", "insert", "--json", "--nodes", "32", "--blocks", "2", "--block", "2", "--warmup", "2",
            "--ids", "list"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["ids"] == {"ours": scale.ID_FORMS["list"][1]} and "sglang_peer" not in result["baselines"]
    assert "position after the collection" in captured.err
    assert "bench insert: no SGLang peer" in captured.err


def test_lists_built_per_call_hand_insert_another_list_of_the_ids_matched(monkeypatch):
    """``--ids list_per_call``: every insert of ours gets a list of the ids its match got, never the same object."""
    from hicache_fsm.cache import HiCache

    handed: list[tuple[str, object]] = []
    for name in ("match_prefix", "insert"):
        real = getattr(HiCache, name)
        monkeypatch.setattr(HiCache, name, (lambda name, real: lambda self, tokens, *a, **k:
                                            handed.append((name, tokens)) or real(self, tokens, *a, **k))(name, real))
    out = insert.measure(nodes=32, blocks=2, block=2, warmup=2, ids=insert.PER_CALL, request="finished")
    assert out["ids"]["ours"] == insert.INSERT_ID_FORMS[insert.PER_CALL][1]
    pairs = [(m, i) for (a, m), (b, i) in zip(handed, handed[1:]) if (a, b) == ("match_prefix", "insert")]
    assert len(pairs) >= 2 * (2 * 2 + 2)  # every insert of ours, the earlier (untimed) ones of finished requests too
    assert all(type(i) is list and i == list(m) and i is not m for m, i in pairs)


@pytest.mark.parametrize("argv", [["--blocks", "0"], ["--block", "-1"], ["--nodes", "x"], ["--clock", "sun"],
                                  ["--request", "old"]])
def test_a_bad_argument_is_one_line_and_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as done:  # argparse refuses it before the benchmark starts
        cli.main(["bench", "insert", *argv])
    assert done.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1
