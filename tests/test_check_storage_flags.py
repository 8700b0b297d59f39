"""``check`` with bounds and a storage tier: ``--storage``, ``--stop-policy``, ``--max-prefetches``,
``--storage-option``, ``--remote-tenant``, ``--priorities`` and ``--max-resets`` reach the explorer's bounds, and the
storage bugs they are for are caught from the command line (the usage errors are in ``test_cli_errors``)."""

from __future__ import annotations

import json

from hicache_fsm.cli import main
from hicache_fsm.testing.mutants import mutant


def check(*argv: str) -> int:
    return main(["check", *argv, "--quiet", "--stop-on-first"])


def test_storage_bounds_reach_the_exploration_and_the_report(capsys):
    assert check("--storage", "--stop-policy", "wait_complete", "--max-prefetches", "2", "--storage-option",
                 "batch_pages=1", "--remote-tenant", "other", "--priorities", "2", "--eviction-policy", "priority",
                 "--max-resets", "1", "--max-depth", "2", "--json") == 0
    run = json.loads(capsys.readouterr().out)  # one policy: the run itself
    bounds = run["bounds"]
    assert bounds["storage"] and bounds["stop_policy"] == "wait_complete" and bounds["max_prefetches"] == 2
    assert bounds["storage_options"] == [["batch_pages", 1]] and bounds["remote_tenant"] == "other"
    assert (bounds["priorities"], bounds["max_resets"]) == (2, 1)
    assert "batch_pages=1" in run["adapter"] and "remote_tenant=other" in run["adapter"]


def test_a_storage_option_catches_the_bug_that_ignores_it():
    with mutant("storage_calls_ignore_batch_pages"):
        assert check("--storage", "--max-depth", "3") == 0  # two pages a call at most: the default never shows it
        assert check("--storage", "--storage-option", "batch_pages=1", "--max-depth", "3") == 1


def test_a_remote_tenant_catches_keys_that_leave_the_tenant_out():
    """(The real cache passes these bounds deeper still: the ``storage/foreign_tenant`` family of plain ``check``.)"""
    with mutant("storage_keys_ignore_tenant"):
        assert check("--storage", "--remote-tenant", "other", "--max-depth", "4") == 1
