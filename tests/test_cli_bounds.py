"""Options that size memory, a C integer or a loop have a documented bound, checked before any work.

A value past it (10**30 below) is one usage-error line and exit status 2: never an OverflowError
traceback, a torch allocation failure, or a run that grows until the machine gives out. Options
that would be silently ignored (``--record`` where nothing records) are refused the same way.
Each case runs ``cli.main`` in this process, in a thread, so a regression that hangs fails.
"""

from __future__ import annotations

import json
import sys

import pytest

from hang_guard import raised_by
from hicache_fsm import cli, trace_gen
from hicache_fsm.errors import ConfigError
from hicache_fsm.router.names import MAX_INSTANCES
from hicache_fsm.trace_gen import TraceShape, generate

Z = str(10**30)
HEADER = '{"event": "header", "machines": ["residency"], "recorded_by": "simulate", "seq": 0, "version": 1}\n'
SURROGATE_NODE = ('{"dest": "device", "event": "transition", "machine": "residency", "node": "\\ud800", "seq": 1, '
                  '"source": "device", "trigger": "insert"}\n')


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of ``hicache-fsm ARGV``; an exception other than SystemExit fails the test."""
    exc = raised_by(lambda: sys.exit(cli.main(list(argv))))
    out, err = capsys.readouterr()
    assert isinstance(exc, SystemExit), f"{type(exc).__name__}: {exc}"
    return exc.code, out, err


@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "small.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [0, 1]}\n'
                    '{"timestamp": 5, "input_length": 700, "output_length": 10, "hash_ids": [0, 2]}\n', encoding="utf-8")
    return path


# name -> (argv, a fragment of the one error line); TRACE is replaced by a real Mooncake trace
USAGE_ERRORS: dict[str, tuple[list[str], str]] = {
    "simulate_seed": (["simulate", "--seed", Z], "argument --seed"),
    "simulate_threads": (["simulate", "--threads", Z], "argument --threads"),
    "simulate_model_heads": (["simulate", "--model-heads", "1000000000"], "argument --model-heads"),
    "simulate_model_heads_huge": (["simulate", "--model-heads", Z], "argument --model-heads"),
    "simulate_clients": (["simulate", "--clients", Z], "more than this machine could hold"),
    "cluster_instances": (["simulate", "--trace", "TRACE", "--instances", Z], f"at most {MAX_INSTANCES} instances"),
    "cluster_sweep": (["simulate", "--trace", "TRACE", "--instances", "2", "--sweep", "1000000"],
                      f"at most {MAX_INSTANCES} instances"),
    "replay_context": (["replay", "TRACE", "--context", Z], "argument --context"),
    "record_with_trace": (["simulate", "--trace", "TRACE", "--record", "REC"], "--record"),
    "record_with_instances": (["simulate", "--trace", "TRACE", "--instances", "2", "--record", "REC"], "--record"),
    "record_with_tp": (["simulate", "--tp", "2", "--record", "REC"], "--tp"),
    "record_tier_without_record": (["simulate", "--record-tier", "device"], "--record-tier needs --record"),
    "record_tier_not_run": (["simulate", "--record", "REC", "--record-tier", "device+host+storage", "--no-storage"],
                            "--no-storage"),
    "bench_controller_requests": (["bench", "controller", "--requests", Z, "--tp", ""], "--requests"),
    "bench_controller_tp_requests": (["bench", "controller", "--tp-requests", Z, "--tp", "2"], "--tp-requests"),
    "bench_events_requests": (["bench", "events", "--requests", Z], "--requests"),
    "bench_insert_nodes": (["bench", "insert", "--nodes", Z, "--peer", "none"], "--nodes"),
    "bench_scale_sizes": (["bench", "scale", "--sizes", Z, "--peer", "none"], "--sizes"),
    "bench_scale_sizes_zero": (["bench", "scale", "--sizes", "0"], "at least 64"),
    "bench_scale_headroom": (["bench", "scale", "--headroom-pages", "-1"], "--headroom-pages"),
    "bench_storage_pages": (["bench", "storage", "--pages", Z], "--pages"),
    "bench_storage_one_page_too_big": (["bench", "storage", "--pages", "1", "--layers", "100000000"],
                                       "(--page-tokens x --layers x"),  # the page flags, not --pages
    "bench_dispatch_objects": (["bench", "dispatch", "--objects", Z], "--objects"),
    "bench_copy_seed": (["bench", "copy", "--seed", Z], "argument --seed"),
    "bench_all_output_parent": (["bench", "all", "--quick", "--output", "NODIR/x.md"], "does not exist"),
}


@pytest.mark.parametrize("case", sorted(USAGE_ERRORS))
def test_out_of_bounds_is_one_usage_error_line(capsys, tmp_path, trace_file, case):
    argv, fragment = USAGE_ERRORS[case]
    names = {"TRACE": str(trace_file), "REC": str(tmp_path / "rec.jsonl"), "NODIR/x.md": str(tmp_path / "no" / "x.md")}
    code, out, err = run_cli(capsys, *[names.get(a, a) for a in argv])
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"hicache-fsm {argv[0]}") and ": error: " in lines[0] and fragment in lines[0], err
    assert not (tmp_path / "rec.jsonl").exists()


def test_a_router_refuses_more_instances_than_its_bound():
    from hicache_fsm.router import PrefixIndex, Router

    with pytest.raises(ConfigError, match=f"from 1 to {MAX_INSTANCES}"):
        Router(10**30, "round_robin", PrefixIndex())


def test_simulate_options_refuse_a_model_or_workload_past_their_bounds():
    from hicache_fsm.simulate_config import MAX_MODEL_HEADS, Options
    from hicache_fsm.simulate_workload import Workload

    with pytest.raises(ConfigError, match=f"at most {MAX_MODEL_HEADS}"):
        Options(model_heads=MAX_MODEL_HEADS + 1)
    with pytest.raises(ConfigError, match="the workload's tokens 704000000000000000000000000000256 is more than"):
        Options(Workload(clients=10**30))  # exact: the infinite cache's size is counted in ints, not floats


def test_an_interrupt_while_the_parser_imports_the_command_is_handled(monkeypatch, capsys):
    def interrupted(only=None, benchmark=""):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    try:
        code = cli.main(["simulate", "--no-progress"])
    except KeyboardInterrupt:
        pytest.fail("the interrupt escaped main as a traceback")
    assert code == 130
    assert capsys.readouterr().err == "hicache-fsm simulate: interrupted\n"


def test_replay_prints_a_lone_surrogate_escaped(capsys, tmp_path):
    trace = tmp_path / "sur.jsonl"
    trace.write_text(HEADER + SURROGATE_NODE, encoding="utf-8")
    code, out, _ = run_cli(capsys, "replay", str(trace))
    assert code == 1
    assert "residency object \\ud800 appears in state 'device'" in out


def test_replay_json_is_strict_json_with_a_non_finite_number(capsys, tmp_path):
    trace = tmp_path / "inf.jsonl"
    trace.write_text('{"event": "completion", "job": 1e999}\n', encoding="utf-8")
    code, out, _ = run_cli(capsys, "replay", str(trace), "--json")

    def refuse(constant: str) -> None:
        raise AssertionError(f"stdout holds {constant}, which strict JSON has not")

    report = json.loads(out, parse_constant=refuse)
    assert code == 1 and report["divergence"]["event"]["job"] == "inf"


@pytest.mark.parametrize("fmt", ["mermaid", "svg"])
def test_diagram_heat_map_escapes_a_surrogate_in_the_trace_and_writes_all_of_it(capsys, tmp_path, fmt):
    trace = tmp_path / "rb.jsonl"
    trace.write_text(HEADER.replace('"simulate"', '"\\ud800 x"')
                     + '{"dest": "device", "event": "transition", "node": 1, "source": "absent", "trigger": "insert", '
                       '"machine": "residency", "seq": 1}\n', encoding="utf-8")
    out = tmp_path / f"heat.{fmt}"
    code, _, err = run_cli(capsys, "diagram", "residency", "--counts", str(trace), "-f", fmt, "-o", str(out))
    assert code == 0, err
    assert "\\ud800 x" in out.read_text(encoding="utf-8")


def test_trace_gen_refuses_a_max_input_length_it_cannot_honour(capsys):
    assert trace_gen.main(["-o", "-", "--requests", "3", "--max-input-length", "1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "max_input_length 1 cannot hold a system prompt of up to 1536 tokens" in err


@pytest.mark.parametrize("kw, named", [
    (dict(system_length=10**12), "max_input_length 131072 cannot hold"),  # it generated blocks without end
    (dict(max_input_length=10**30), "max_input_length 10"),
    (dict(output_length=10**30), "output_length 10"),
    (dict(sessions=10**30), "sessions must be at most"),
    (dict(system_prompts=10**30), "system_prompts must be at most"),
])
def test_trace_gen_shapes_past_their_bounds_are_refused(kw, named):
    with pytest.raises(ConfigError, match=named):
        TraceShape(**kw)


@pytest.mark.parametrize("max_input_length", [1, 100, 151])
def test_trace_gen_inputs_never_exceed_max_input_length(max_input_length):
    """Refused, or honoured: a 100-token system prompt once made every input longer than the maximum."""
    try:
        shape = TraceShape(requests=200, sessions=3, turns=6, system_length=100, user_length=80, output_length=40,
                           max_input_length=max_input_length, block_size=16)
    except ConfigError as exc:
        assert "cannot hold a system prompt" in str(exc)
        return
    assert max(r["input_length"] for r in generate(shape)) <= max_input_length


ESCAPES = '"\\u001b[2J\\u202e"'  # clear-screen, then a right-to-left override


def test_replay_escapes_what_a_terminal_would_act_on(capsys, tmp_path):
    """A trace's strings are shown escaped: an ESC in a state name could clear or recolour the terminal."""
    trace = tmp_path / "esc.jsonl"
    trace.write_text(HEADER + '{"dest": ' + ESCAPES + ', "event": "transition", "machine": "residency", "node": 1, '
                     '"seq": 1, "source": "absent", "trigger": "insert"}\n', encoding="utf-8")
    code, out, _ = run_cli(capsys, "replay", str(trace))
    assert code == 1 and "\\x1b[2J\\u202e" in out
    assert "\x1b" not in out and "\u202e" not in out


def test_error_lines_escape_what_a_terminal_would_act_on(capsys, tmp_path):
    trace = tmp_path / "esc.jsonl"
    trace.write_text(HEADER + '{"dest": ' + ESCAPES + ', "event": "transition", "machine": "residency", "node": 1, '
                     '"seq": 1, "source": "absent", "trigger": "insert"}\n', encoding="utf-8")
    code, _, err = run_cli(capsys, "diagram", "residency", "--counts", str(trace), "-o", str(tmp_path / "h.mmd"))
    assert code == 1 and "\\x1b[2J\\u202e" in err and "\x1b" not in err
    code, _, err = run_cli(capsys, "replay", str(tmp_path / "\x1b[2Jmissing.jsonl"))
    assert code == 2 and "\\x1b[2Jmissing.jsonl" in err and "\x1b" not in err
    code, _, err = run_cli(capsys, "simulate", "--trace", str(tmp_path / "\x1b[2Jmissing.jsonl"))
    assert code == 2 and "\\x1b[2Jmissing.jsonl" in err and "\x1b" not in err


def test_diagram_without_a_spec_is_a_usage_error(capsys):
    code, _, err = run_cli(capsys, "diagram")
    assert code == 2 and err.startswith("hicache-fsm diagram: error: give one NAME|PATH, or --all")
