"""The workload simulator: a small run end to end, its KV check, and the command line."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from hicache_fsm.cli import main
from hicache_fsm.errors import ConfigError
from hicache_fsm.model import TinyModel
from hicache_fsm.simulate_engine import ChatEngine
from hicache_fsm.simulate import (
    DEVICE,
    DEVICE_HOST,
    FULL,
    INFINITE,
    KVOracle,
    Options,
    Tier,
    Workload,
    reference_run,
    run_simulation,
    storage_available,
)

SMALL = Workload(clients=3, rounds=3, request_length=32, output_length=8, system_prompt_length=32)


def small_options(tmp_path, **kw) -> Options:
    base = dict(workload=SMALL, device_tokens=160, host_tokens=256, storage_url=f"file://{tmp_path}/l3",
                page_size=8, device="cpu")
    base.update(kw)
    return Options(**base)


@pytest.fixture(scope="module")
def small_sim(tmp_path_factory):
    torch.set_num_threads(1)
    # settled storage: the storage hits asserted below do not depend on how fast the storage threads ran
    return run_simulation(small_options(tmp_path_factory.mktemp("sim")), settle_storage=True)


def test_small_simulation_is_exact_and_ordered(small_sim):
    sim = small_sim
    names = [t.name for t in sim.tiers]
    assert names[:2] == [DEVICE, DEVICE_HOST] and names[-1] == INFINITE
    if storage_available():
        assert FULL in names
    assert sim.kv_mismatches == 0
    assert sim.output_mismatches == 0
    for t in sim.tiers:
        assert t.requests == SMALL.requests
        assert t.kv_checked_pages > 0
        assert t.output_tokens == SMALL.requests * SMALL.output_length
        assert t.hit_tokens + t.computed_tokens == t.prompt_tokens
    device, bound = sim.tier(DEVICE), sim.tier(INFINITE)
    full = sim.hierarchy
    assert device.bytes["d2h"] == 0 and device.host_hit_tokens == 0  # device only: nothing goes to host
    assert device.hit_rate <= full.hit_rate <= bound.hit_rate
    assert sim.tier(DEVICE_HOST).hit_rate >= device.hit_rate


def test_json_fields(small_sim):
    out = json.loads(json.dumps(small_sim.as_dict()))
    for key in ("hit_rate", "hit_rate_bound", "kv_mismatches", "requests", "controller_us_per_request", "configs"):
        assert key in out
    assert out["requests"] == SMALL.requests
    assert out["model"] == "tiny" and out["model_name"].startswith("tinymodel-")  # tiny is the default
    assert out["kv_mismatches"] == 0
    assert out["hit_rate"] <= out["hit_rate_bound"]
    assert set(out["configs"]) == {t.name for t in small_sim.tiers}
    full = out["configs"][out["hierarchy"]]
    assert full["controller_us_per_request"] == out["controller_us_per_request"]


def test_storage_serves_what_host_cannot_hold(small_sim):
    if not storage_available():
        pytest.skip("no storage tier in this build")
    full, bound = small_sim.tier(FULL), small_sim.tier(INFINITE)
    assert full.storage_hit_tokens > 0 and full.bytes["s2h"] > 0
    assert full.hit_rate >= 0.95 * bound.hit_rate
    assert full.hit_rate > small_sim.tier(DEVICE_HOST).hit_rate > small_sim.tier(DEVICE).hit_rate


def test_the_kv_check_catches_corruption():
    torch.set_num_threads(1)
    w = Workload(clients=2, rounds=2, request_length=16, output_length=4, system_prompt_length=16)
    model = TinyModel(vocab=w.vocab)
    ref = reference_run(model, w)
    engine = ChatEngine(Tier("t", 256, 512), w, model, 8, "page_first", "cpu")
    try:
        schedule = w.schedule()
        for key in schedule[:2]:
            engine.serve(ref.prompts[key], ref.outputs[key])
        assert engine.result.kv_mismatches == 0
        engine.pool.kv.add_(1.0)  # every cached page now differs from what the model wrote
        engine.serve(ref.prompts[schedule[2]], ref.outputs[schedule[2]])
        assert engine.result.kv_mismatches > 0
    finally:
        engine.cache.close()


def test_oracle_keys_whole_prefixes():
    o = KVOracle(2)
    k = torch.arange(8, dtype=torch.float32).view(1, 4, 1, 2)
    o.record([1, 2, 3, 4], 0, 4, k, k)
    assert o.check([1, 2, 3, 4], k, k) == 0
    assert o.check([9, 2, 3, 4], k, k) == 2  # same pages after another first page: other prefixes
    assert o.check([1, 2, 3, 4], k + 1, k) == 2


def test_workload_schedules():
    w = Workload(clients=3, rounds=4, arrival="random", seed=5)
    order = w.schedule()
    assert sorted(order) == sorted((c, r) for c in range(3) for r in range(4))
    for c in range(3):
        assert [r for cc, r in order if cc == c] == [0, 1, 2, 3]
    assert order == Workload(clients=3, rounds=4, arrival="random", seed=5).schedule()
    rr = Workload(clients=2, rounds=2).schedule()
    assert rr == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert w.user_turn(0, 1) == Workload(clients=3, rounds=4, arrival="random", seed=5).user_turn(0, 1)


def test_bad_options():
    with pytest.raises(ConfigError):
        Workload(clients=0)
    with pytest.raises(ConfigError):
        Workload(arrival="poisson")
    with pytest.raises(ConfigError):
        Options(SMALL, device_tokens=100, page_size=8)  # not a page multiple
    with pytest.raises(ConfigError):
        Options(SMALL, device_tokens=64, host_tokens=128, page_size=8)  # cannot hold one conversation
    with pytest.raises(ConfigError, match="host_tokens 3072 must be larger than device_tokens 3584"):
        Options(SMALL, device_tokens=3584, host_tokens=3072)
    with pytest.raises(ConfigError, match="must be larger"):
        Options(SMALL, device_tokens=1024, host_tokens=1024)
    with pytest.raises(ConfigError, match="model must be one of"):
        Options(SMALL, model="gpt")


def test_cli_json_is_the_whole_stdout(capsys, tmp_path):
    rc = main(["simulate", "--clients", "2", "--rounds", "2", "--request-length", "16", "--output-length", "4",
               "--system-prompt-length", "16", "--page-size", "8", "--device-tokens", "64", "--host-tokens", "128",
               "--storage-url", f"file://{tmp_path}/l3", "--device", "cpu", "--no-progress", "--json"])
    captured = capsys.readouterr()
    assert rc == 0
    result = json.loads(captured.out)  # stdout is the JSON object alone, ready for a pipe
    assert result["kv_mismatches"] == 0 and result["requests"] == 4
    assert "token hit rate" in captured.err  # the human-readable table went to stderr


def test_plot_without_matplotlib(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    rc = main(["simulate", "--plot", str(tmp_path / "x.png"), "--no-progress"])
    assert rc == 1  # a missing extra, as with --model llama (tests/test_counts_input.py)
    assert "pip install" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_cli_rejects_bad_sizes(capsys):
    assert main(["simulate", "--device-tokens", "100", "--no-progress"]) == 2
    assert "multiple of page_size" in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_small_simulation_on_cuda(tmp_path):
    """Model and device pool on CUDA: loads wait per layer on the load stream's events."""
    sim = run_simulation(small_options(tmp_path, device="cuda"))
    assert sim.device == "cuda"
    assert sim.kv_mismatches == 0
    assert sim.hierarchy.hit_rate >= sim.tier(DEVICE).hit_rate
    assert sum(t.kv_checked_pages for t in sim.tiers) > 0


def test_sweep_leaves_out_capacities_whose_host_is_not_larger(tmp_path):
    from hicache_fsm.simulate import capacity_grid, hit_rate_sweep

    torch.set_num_threads(1)
    w = Workload(clients=2, rounds=2, request_length=16, output_length=4, system_prompt_length=16)
    options = Options(w, device_tokens=64, host_tokens=128, page_size=8, device="cpu", storage=False)
    devices, hosts = capacity_grid(options)
    sweep = hit_rate_sweep(options, reference_run(TinyModel(vocab=w.vocab), w))
    for label, points in sweep["by_device"].items():
        if label != "device only":
            host = int(label.split()[1])
            assert [d for d, _ in points] == [d for d in devices if d < host]
    assert [h for h, _ in sweep["by_host"]["device 64"]] == [h for h in hosts if h > 64]
    assert sweep["skipped"] and all("must be larger" in s for s in sweep["skipped"])


def test_simulate_modules_form_no_import_cycle():
    """simulate imports its parts (and simulate_tp, lazily); no part imports simulate back, not even for types."""
    import ast
    import pathlib

    import hicache_fsm

    root = pathlib.Path(hicache_fsm.__file__).parent
    for path in root.glob("simulate_*.py"):
        imported = {n.module for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom)}
        assert "hicache_fsm.simulate" not in imported, path.name
        assert len(path.read_text().splitlines()) < 800
    assert len((root / "simulate.py").read_text().splitlines()) < 800


def test_tp_table_says_its_byte_rows_are_per_rank(small_sim):
    import attrs

    from hicache_fsm.commands.simulate import format_table

    rows = [line for line in format_table(attrs.evolve(small_sim, tp=2)).splitlines() if line.startswith("bytes ")]
    assert len(rows) == 4 and all("(per rank, of 2)" in line for line in rows)
    assert not any("per rank" in line for line in format_table(small_sim).splitlines())


def test_table_and_summary_report_prefill_and_time_to_first_token(small_sim):
    from hicache_fsm.commands.simulate import format_table, summary

    table = format_table(small_sim)
    for row in ("prefill tokens reused", "prefill tokens computed", "prefill work (counted)", "model prefill time",
                "time to first token mean", "time to first token p90", "match+insert", "KV copies us/request"):
        assert row in table
    text = summary(small_sim)
    assert "prefill: " in text and "fewer tokens" in text and "on device only" in text
    assert "the loop `bench controller` times" in text and "Not in it: KV copies" in text
    saved = small_sim.prefill_saved()
    dev, full = small_sim.tier(DEVICE), small_sim.hierarchy
    assert saved["tokens"] == pytest.approx(1 - full.computed_tokens / dev.computed_tokens)
    split = full.controller_split_us()
    assert split["token_checks"] > 0  # the engine packs each request's ids once, timed as controller time
    assert sum(split.values()) == pytest.approx(full.controller_us_per_request, rel=1e-6, abs=1.0)


def test_settled_storage_hits_do_not_depend_on_the_storage_speed():
    """``settle_storage``: every backup lands before the next request, so slow storage threads change nothing."""
    from hicache_fsm.simulate import run_tier
    from hicache_fsm.storage.faults import Fault, FaultyBackend
    from hicache_fsm.storage.memory import MemoryBackend

    w = Workload(clients=3, rounds=3, request_length=16, output_length=4, system_prompt_length=16)
    reference = reference_run(TinyModel(vocab=w.vocab), w)

    def served(backend) -> tuple:
        r = run_tier(Tier(FULL, 80, 128, backend), w, reference, None, 8, device="cpu", settle_storage=True)
        return r.device_hit_tokens, r.host_hit_tokens, r.storage_hit_tokens, r.prefetches, r.prefetch_timeouts

    fast = served(MemoryBackend())
    slow = served(FaultyBackend(MemoryBackend(), [Fault("slow", method="batch_set_from", delay=0.05)]))
    assert fast == slow
    assert fast[2] > 0 and fast[4] == 0  # storage served something, and no prefetch was given up


def test_an_observer_that_cannot_be_called_is_refused_before_the_run():
    with pytest.raises(ConfigError, match="observe must be callable"):  # a TypeError at the first tier before
        run_simulation(Options(SMALL, device="cpu", storage=False), observe="record")


def test_a_second_run_on_the_same_store_starts_from_an_empty_key_space(tmp_path):
    """Every run wrote under one key prefix: a second run on the same directory read the first run's pages
    (a hit rate above the infinite cache's bound, and pages of another run counted as KV mismatches)."""
    if not storage_available():
        pytest.skip("no storage tier in this build")
    torch.set_num_threads(1)
    options = small_options(tmp_path, storage_url=f"file://{tmp_path}/shared")
    first = run_simulation(options, settle_storage=True)
    again = run_simulation(options, settle_storage=True)
    for sim in (first, again):
        assert sim.kv_mismatches == 0 and sim.output_mismatches == 0
        assert sim.tier(FULL).hit_rate <= sim.tier(INFINITE).hit_rate
    assert again.tier(FULL).storage_hit_tokens == first.tier(FULL).storage_hit_tokens
