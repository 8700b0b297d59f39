"""``simulate --tp N``: rank processes with sharded KV heads give the one-rank run's answers and hit rates."""

from __future__ import annotations

import json

import pytest

from hicache_fsm.cli import main
from hicache_fsm.errors import ConfigError
from hicache_fsm.simulate import FULL, Options, Workload, run_simulation

SMALL = Workload(clients=3, rounds=3, request_length=32, output_length=8, system_prompt_length=32)


def options(tmp_path, tp: int, heads: int, name: str) -> Options:
    return Options(SMALL, device_tokens=160, host_tokens=256, storage_url=f"file://{tmp_path}/{name}", page_size=8,
                   device="cpu", model_heads=heads, tp=tp)


@pytest.mark.parametrize("tp,heads", [(2, 2), pytest.param(4, 4, marks=pytest.mark.slow)])
def test_tp_run_equals_the_one_rank_run(tmp_path, tp, heads):
    # settled storage: storage hits depend on the requests only, so the runs can be compared exactly
    one = run_simulation(options(tmp_path, 1, heads, "one"), settle_storage=True)
    many = run_simulation(options(tmp_path, tp, heads, "many"), settle_storage=True)
    assert many.tp == tp and len(many.rank_tiers) == tp
    assert many.ranks_agree
    assert many.kv_mismatches == 0 and many.output_mismatches == 0
    assert one.kv_mismatches == 0 and one.output_mismatches == 0
    full = many.tier(FULL)
    assert full.storage_hit_tokens and full.host_hit_tokens  # every tier of the hierarchy served something
    for tiers in many.rank_tiers:
        for mine, ref in zip(tiers, one.tiers):
            assert mine.name == ref.name
            assert (mine.device_hit_tokens, mine.host_hit_tokens, mine.storage_hit_tokens, mine.computed_tokens) == (
                ref.device_hit_tokens, ref.host_hit_tokens, ref.storage_hit_tokens, ref.computed_tokens)
            assert mine.kv_checked_pages == ref.kv_checked_pages and mine.output_tokens == ref.output_tokens
    d = many.as_dict()
    assert d["tp"] == tp and d["ranks_agree"] is True and len(d["ranks"]) == tp


def test_cli_tp_json(capsys, tmp_path):
    rc = main(["simulate", "--clients", "2", "--rounds", "2", "--request-length", "16", "--output-length", "4",
               "--system-prompt-length", "16", "--page-size", "8", "--device-tokens", "64", "--host-tokens", "128",
               "--storage-url", f"file://{tmp_path}/l3", "--device", "cpu", "--no-progress", "--json", "--tp", "2"])
    captured = capsys.readouterr()
    assert rc == 0
    result = json.loads(captured.out)
    assert result["tp"] == 2 and result["ranks_agree"] is True
    assert result["kv_mismatches"] == 0 and result["output_mismatches"] == 0
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    assert "2 ranks" in captured.err


def test_tp_must_divide_the_heads(capsys):
    with pytest.raises(ConfigError):
        Options(SMALL, device_tokens=160, host_tokens=256, page_size=8, tp=3)
    assert main(["simulate", "--tp", "3", "--no-progress"]) == 2
    assert "--model-heads" in capsys.readouterr().err


def test_tp_is_at_most_the_rank_processes_one_run_may_start(capsys):
    with pytest.raises(ConfigError, match="at most 64 rank processes"):  # checked before the head count
        Options(SMALL, device_tokens=160, host_tokens=256, page_size=8, tp=65, model_heads=130)
    assert main(["simulate", "--tp", "1000", "--no-progress"]) == 2
    assert "at most 64" in capsys.readouterr().err
