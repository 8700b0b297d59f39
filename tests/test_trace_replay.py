"""Trace replay through the four cache configurations, the sweep, and `simulate --trace`."""

from __future__ import annotations

import io
import json
from pathlib import Path

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_fsm.cli import main
from hicache_fsm.errors import ConfigError
from hicache_fsm.simulate import DEVICE, DEVICE_HOST, FULL, INFINITE, device_only, storage_available
from hicache_fsm.trace import BlockTokens, load_trace, parse_lines, prefix_bound
from hicache_fsm.trace_gen import TraceShape, write
from hicache_fsm.trace_replay import CostModel, ReplayProgress, TraceOptions, replay, run_trace, sweep_capacities
from redis_fixture import redis_server  # noqa: F401  (fixture)

SHIPPED = Path(__file__).resolve().parent.parent / "examples" / "traces" / "synthetic-chat.jsonl"
needs_storage = pytest.mark.skipif(not storage_available(), reason="this build has no storage tier")


@pytest.fixture(scope="module")
def shipped_sim():
    torch.set_num_threads(1)
    trace = load_trace(SHIPPED)
    return run_trace(TraceOptions(trace, device_tokens=16384, host_tokens=65536, storage_url="memory://",
                                  device="cpu"))


@pytest.fixture
def small_trace(tmp_path) -> Path:
    shape = TraceShape(requests=40, sessions=4, turns=3, system_prompts=2, system_length=64, user_length=48,
                       output_length=16, block_size=32, seed=1)
    path = tmp_path / "small.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        write(shape, f)
    return path


def test_shipped_trace_through_every_configuration(shipped_sim):
    sim = shipped_sim
    trace = sim.trace
    names = [t.name for t in sim.tiers]
    assert names == [DEVICE, DEVICE_HOST, FULL, INFINITE] if storage_available() else [DEVICE, DEVICE_HOST, INFINITE]
    for t in sim.tiers:
        assert t.requests == len(trace.requests) == 300
        assert t.prompt_tokens == trace.input_tokens  # the rate's denominator: every input token
        assert t.hit_tokens + t.computed_tokens == t.prompt_tokens
    rates = [t.hit_rate for t in sim.tiers]
    assert rates == sorted(rates), rates  # device <= device+host <= device+host+storage <= infinite
    device, both, bound = sim.tier(DEVICE), sim.tier(DEVICE_HOST), sim.tier(INFINITE)
    assert device.host_hit_tokens == 0 and device.bytes["d2h"] == 0
    assert both.hit_rate > device.hit_rate and both.host_hit_tokens > 0  # the workload does not fit the device
    # the infinite cache hits exactly what the hash ids say, and never evicts
    assert bound.hit_tokens == sim.bound.hit_tokens == prefix_bound(trace, 16).hit_tokens
    assert bound.alloc_failures == 0 and bound.counters.get("evicted_device_tokens", 0) == 0
    if storage_available():
        full = sim.tier(FULL)
        assert full.storage_hit_tokens > 0 and full.prefetches > 0
        assert full.hit_rate >= 0.95 * bound.hit_rate  # storage is unbounded here


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=4), st.integers(1, 16)),
                min_size=1, max_size=10),
       st.sampled_from([4, 8, 16]))
def test_an_infinite_cache_hits_the_bound(requests, page):
    """Whatever the trace, HiCache with room for everything hits exactly what the hash ids say."""
    lines = [json.dumps({"timestamp": i, "input_length": (len(ids) - 1) * 16 + cut, "output_length": 1,
                         "hash_ids": ids}) for i, (ids, cut) in enumerate(requests)]
    trace = parse_lines(lines, 16)
    bound = prefix_bound(trace, page)
    [result] = replay([device_only(INFINITE, bound.unique_tokens + page, page)], trace, BlockTokens(16), page)
    assert result.hit_tokens == bound.hit_tokens
    assert result.alloc_failures == 0


def test_json_shape(shipped_sim):
    d = json.loads(json.dumps(shipped_sim.as_dict()))
    assert d["requests"] == 300 and d["page_size"] == 16
    assert d["hit_rate_bound"] == d["hit_rate_analytic_bound"] == round(shipped_sim.bound.hit_rate, 4)
    assert d["hierarchy"] == (FULL if storage_available() else DEVICE_HOST)
    assert d["trace"]["block_size"] == 512 and d["trace"]["input_tokens"] == shipped_sim.trace.input_tokens
    assert d["sweep"] is None
    for name, c in d["configs"].items():
        assert c["name"] == name
        for key in ("hit_rate", "hit_rate_device", "hit_rate_host", "hit_rate_storage", "controller_us_per_request",
                    "controller_us_per_request_by_call", "wall_s", "device_tokens", "host_tokens", "bytes"):
            assert key in c, (name, key)
        assert c["hit_rate"] == pytest.approx(c["hit_rate_device"] + c["hit_rate_host"] + c["hit_rate_storage"],
                                              abs=2e-4)


@needs_storage
@pytest.mark.parametrize("scheme", ["file", "redis"])
def test_storage_backends(scheme, small_trace, tmp_path, request):
    if scheme == "redis":
        url = request.getfixturevalue("redis_server").url
    else:
        url = f"file://{tmp_path}/l3"
    sim = run_trace(TraceOptions(load_trace(small_trace, 32), device_tokens=256, host_tokens=512, storage_url=url,
                                 page_size=8, device="cpu"))
    full, both, bound = sim.tier(FULL), sim.tier(DEVICE_HOST), sim.tier(INFINITE)
    assert full.storage_url == url and full.storage_hit_tokens > 0
    assert both.hit_rate <= full.hit_rate <= bound.hit_rate
    assert full.bytes["h2s"] > 0 and full.bytes["s2h"] > 0


def test_sweep(small_trace):
    trace = load_trace(small_trace, 32)
    bound = prefix_bound(trace, 8)
    sizes = sweep_capacities(trace, 8, bound, points=5)
    assert sizes == sorted(sizes) and len(sizes) <= 5 and all(s % 8 == 0 for s in sizes)
    assert sizes[0] >= trace.max_input_length and sizes[-1] == bound.unique_tokens + 8
    sim = run_trace(TraceOptions(trace, device_tokens=256, host_tokens=512, storage=False, page_size=8,
                                 device="cpu"), sweep=sizes)
    rates = [r for _, r in sim.sweep]
    assert rates == sorted(rates) and rates[-1] == pytest.approx(bound.hit_rate)
    assert sim.as_dict()["sweep"]["device_tokens"] == sizes


def test_bad_options(small_trace):
    trace = load_trace(small_trace, 32)
    with pytest.raises(ConfigError, match="divide the trace's block size"):
        TraceOptions(trace, page_size=6)
    with pytest.raises(ConfigError, match="device_tokens 100 is not a multiple of page_size 8"):
        TraceOptions(trace, device_tokens=100, page_size=8)
    with pytest.raises(ConfigError, match="layout"):
        TraceOptions(trace, layout="sideways", page_size=8)
    with pytest.raises(ConfigError, match="device must be cpu, cuda or cuda:N"):  # was torch's RuntimeError, later
        TraceOptions(trace, device="tpu", page_size=8)


@pytest.mark.parametrize("field, value", [("prefill_s", -1e-6), ("load_s", float("nan")), ("storage_s", "10us"),
                                          ("prefill_s", True), ("load_s", float("inf"))])
def test_a_cost_model_takes_finite_seconds_only(field, value):
    """A negative cost made times to first token negative; a str failed at the first request."""
    with pytest.raises(ConfigError, match=f"CostModel.{field}"):
        CostModel(**{field: value})
    assert CostModel(**{field: 0}).ttft(1, 1, 1) >= 0


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty", [False, True])
def test_progress(tty):
    stream = _Stream(tty)
    p = ReplayProgress(4, stream, every_s=0.0)
    p.every_s = 0.0
    p.set_label("device")
    p.step()
    p.step()
    p.close()
    text = stream.getvalue()
    assert "2/4 requests (50%)" in text and "device" in text
    assert ("\r" in text) == tty and (text.count("\n") == 2) == (not tty)
    quiet = _Stream(tty)
    p = ReplayProgress(4, quiet, enabled=False)
    p.step()
    p.close()
    assert quiet.getvalue() == ""


# ====================================================================== the command line


def cli(trace: Path, *extra: str) -> list[str]:
    return ["simulate", "--trace", str(trace), "--block-size", "32", "--page-size", "8", "--device-tokens", "256",
            "--host-tokens", "512", "--device", "cpu", "--no-progress", *extra]


def test_cli_json_is_the_whole_stdout(small_trace, capsys):
    rc = main(cli(small_trace, "--storage-url", "memory://", "--json", "--sweep", "256,1024"))
    captured = capsys.readouterr()
    assert rc == 0
    result = json.loads(captured.out)
    expected = {DEVICE, DEVICE_HOST, FULL, INFINITE} if storage_available() else {DEVICE, DEVICE_HOST, INFINITE}
    assert set(result["configs"]) == expected
    assert result["requests"] == 40 and result["sweep"]["device_tokens"] == [256, 1024]
    assert "token hit rate" in captured.err and "-> OK" in captured.err


def test_cli_plot(small_trace, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "sweep.png"
    assert main(cli(small_trace, "--no-storage", "--plot", str(png))) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "device-only sweep:" in capsys.readouterr().out
    bare = tmp_path / "sweep"  # no suffix: a PNG, written under the very name the report gives
    assert main(cli(small_trace, "--no-storage", "--plot", str(bare))) == 0
    assert bare.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "sweep.png.png").exists()
    assert f"plot written to {bare}" in capsys.readouterr().out


@pytest.mark.parametrize("target, message", [
    ("{dir}", "is a directory"), ("{dir}/sweep.xyz", "matplotlib cannot write .xyz files"),
    ("{dir}/missing/sweep.png", "no directory"),
])
def test_cli_plot_target_refused_before_the_replay(small_trace, tmp_path, capsys, target, message):
    pytest.importorskip("matplotlib")
    assert main(cli(small_trace, "--no-storage", "--plot", target.format(dir=tmp_path))) == 2
    out, err = capsys.readouterr()
    assert out == "" and message in err and err.count("\n") == 1


@pytest.mark.parametrize("args, message", [
    (["--trace", "{missing}"], "missing.jsonl: no such file"),
    (["--trace", "{bad}"], "bad.jsonl:2: input_length must be an int >= 1"),
    (["--trace", "{good}", "--block-size", "3"], "block size must be an int >= 4"),
    (["--trace", "{good}", "--page-size", "24"], "page size must divide"),
    (["--trace", "{good}", "--clients", "3"], "--clients describes the chat workload"),
    (["--trace", "{good}", "--clients", "3", "--rounds", "2"], "--clients, --rounds describe the chat workload"),
    (["--trace", "{good}", "--sweep", "10,x"], "--sweep wants comma-separated token counts"),
    (["--trace", "{good}", "--sweep", "100"], "--sweep sizes must be positive multiples of page size 16"),
    (["--sweep"], "--sweep needs --trace"),
    (["--block-size", "64"], "--block-size needs --trace"),
    (["--sweep", "--block-size", "64"], "--sweep, --block-size need --trace"),
    # an option written at its default value is given all the same
    (["--block-size", "512"], "--block-size needs --trace"),
    (["--trace", "{good}", "--seed", "0"], "--seed describes the chat workload"),
    (["--trace", "{good}", "--arrival", "round-robin"], "--arrival describes the chat workload"),
    (["--trace", "{good}", "--tp", "1"], "--tp needs the chat workload"),
    (["--trace", "{good}", "--model", "tiny"], "--model needs the chat workload"),
])
def test_cli_usage_errors(args, message, tmp_path, capsys):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}) + "\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(good.read_text() + json.dumps({"timestamp": 1, "input_length": 0, "output_length": 1,
                                                  "hash_ids": []}) + "\n")
    paths = {"missing": tmp_path / "missing.jsonl", "bad": bad, "good": good}
    argv = ["simulate", "--no-progress", *[a.format(**paths) for a in args]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_the_chat_workload_keeps_its_defaults(capsys):
    """--device-tokens/--host-tokens default per mode; the chat workload's stay as they were."""
    assert main(["simulate", "--page-size", "24", "--no-progress"]) == 2  # 1024 is no multiple of 24
    assert "device_tokens 1024" in capsys.readouterr().err



@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_replay_with_the_device_pool_on_cuda(small_trace):
    """The device pool on CUDA: load-backs and backups go through the executor's streams."""
    sim = run_trace(TraceOptions(load_trace(small_trace, 32), device_tokens=256, host_tokens=512, page_size=8,
                                 storage_url="memory://", device="cuda"))
    assert sim.device == "cuda"
    assert sim.tier(INFINITE).hit_tokens == sim.bound.hit_tokens
    rates = [t.hit_rate for t in sim.tiers]
    assert rates == sorted(rates)
    assert sim.tier(DEVICE_HOST).bytes["h2d"] > 0


def test_time_to_first_token_follows_the_cost_model(shipped_sim):
    """Prefill computed + reused covers every input token; TTFT is the cost model's sum, device only the slowest."""
    costs = shipped_sim.costs
    d = shipped_sim.as_dict()
    for t in shipped_sim.tiers:
        lat = shipped_sim.latency[t.name]
        assert t.reused_tokens == t.hit_tokens and not {'computed_tokens', 'reused_tokens'} & set(attrs.fields_dict(type(lat)))
        assert len(lat.ttft_s) == t.requests
        want = costs.ttft(t.computed_tokens, t.host_hit_tokens, t.storage_hit_tokens)
        assert lat.clock_s == pytest.approx(want)
        c = d["configs"][t.name]
        assert c["prefill_tokens_computed"] + c["prefill_tokens_reused"] == t.prompt_tokens
        assert c["ttft_mean_s"] > 0 and c["ttft_p90_s"] == pytest.approx(sorted(lat.ttft_s)[int(0.9 * len(lat.ttft_s))], abs=1e-6)
    device, full = shipped_sim.latency[DEVICE], shipped_sim.latency[shipped_sim.hierarchy.name]
    assert full.clock_s < device.clock_s
    device, full = shipped_sim.tier(DEVICE), shipped_sim.hierarchy
    assert d["prefill_saved_vs_device"] == round(1 - full.computed_tokens / device.computed_tokens, 4) > 0


@needs_storage
def test_storage_replays_on_the_simulated_clock_without_threads(small_trace):
    """The tier starts no storage thread: the replayer runs queued work itself, and every backup lands."""
    import threading

    before = {t.ident for t in threading.enumerate()}
    from hicache_fsm.trace_replay import TraceReplayer

    trace = load_trace(small_trace, block_size=32)
    tier = next(t for t in TraceOptions(trace, device_tokens=256, host_tokens=1024, page_size=16, device="cpu")
                .tiers("memory://", prefix_bound(trace, 16)) if t.name == FULL)
    replayer = TraceReplayer(tier, 16)
    tokens = BlockTokens(32)
    for r in trace.requests:
        replayer.serve(tokens.packed(r.hash_ids, r.input_length - r.input_length % 16), r.input_length)
        assert {t.ident for t in threading.enumerate()} == before  # nothing runs behind the replay
        assert not replayer.cache.storage_transfers_in_flight()  # this request's backups landed already
    result = replayer.finish()
    assert result.storage_hit_tokens > 0 and result.prefetch_timeouts == 0
