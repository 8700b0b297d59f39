"""Untrusted traces are bounded before any work: special files, JSON depth, line length, token counts, sizes.

Each bound refuses with one TraceError / ConfigError naming the limit; the
command prints one line and exits 2. Bounds on memory are relative to what the
machine has available, so the tests pin that figure.
"""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hang_guard import raised_by as refused

from hicache_fsm import cli, input_limits
from hicache_fsm.errors import ConfigError, TraceError
from hicache_fsm.trace import MAX_BLOCK_SIZE, MAX_LINE_CHARS, TOKEN_BYTES, load_trace, parse_request

GIB = 1 << 30


@pytest.fixture
def four_gib(monkeypatch):
    """The machine has 4 GiB available: the budget is 2 GiB, so 2**26 tokens of TOKEN_BYTES."""
    monkeypatch.setattr(input_limits, "available_memory_bytes", lambda: 4 * GIB)
    return 2 * GIB // TOKEN_BYTES


def line(n_in=8, n_out=1, ids=(1, 2)) -> str:
    return json.dumps({"timestamp": 0, "input_length": n_in, "output_length": n_out, "hash_ids": list(ids)})


def test_nested_json_is_refused_before_parsing():
    deep = '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with pytest.raises(TraceError, match=r"<trace>:1: JSON nested 100001 levels deep \(limit 32\)"):
        parse_request(deep, 4)
    brackets_in_strings = json.dumps({"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [1, 2],
                                      "note": "[" * 1000})
    assert parse_request(brackets_in_strings, 4).hash_ids == (1, 2)


def test_a_billion_token_line_is_refused_by_what_memory_holds(four_gib):
    with pytest.raises(TraceError, match=f"more than this machine could hold \\(limit {four_gib}"):
        parse_request(line(n_in=10**9, ids=range(10**9 // 4096)), 4096)
    assert parse_request(line(n_in=4096 * 2, ids=(1, 2)), 4096).input_length == 8192


def test_the_whole_trace_is_bounded_too(four_gib, tmp_path):
    per_line = four_gib // 3 + 1
    blocks = -(-per_line // MAX_BLOCK_SIZE)
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(line(n_in=per_line, n_out=0, ids=range(blocks)) for _ in range(3)) + "\n")
    err = refused(load_trace, path, MAX_BLOCK_SIZE)
    assert isinstance(err, TraceError) and err.line == 3 and "the trace's tokens so far" in str(err)


def test_block_sizes_past_the_limit_are_refused():
    with pytest.raises(ConfigError, match=f"over the limit of {MAX_BLOCK_SIZE} tokens"):
        load_trace("unused", 2**20)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_is_refused_without_opening_it(tmp_path):
    fifo = tmp_path / "trace.jsonl"
    os.mkfifo(fifo)
    err = refused(load_trace, fifo)
    assert isinstance(err, TraceError) and "not a regular file" in str(err)


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_devices_and_directories_are_refused(tmp_path):
    assert "not a regular file" in str(refused(load_trace, "/dev/zero"))
    assert "is a directory" in str(refused(load_trace, tmp_path))


def test_a_file_of_zero_bytes_without_newlines_stops_at_the_line_limit(tmp_path, monkeypatch):
    monkeypatch.setattr("hicache_fsm.trace.MAX_LINE_CHARS", 1000)
    path = tmp_path / "zeros.jsonl"
    path.write_bytes(b"\0" * 5000)
    err = refused(load_trace, path)
    assert isinstance(err, TraceError) and "line longer than 1000 characters" in str(err)
    assert MAX_LINE_CHARS >= 1 << 20


def test_a_file_past_the_size_bound_is_refused_before_reading(tmp_path, monkeypatch):
    monkeypatch.setattr(input_limits, "available_memory_bytes", lambda: 64 * 1024)
    path = tmp_path / "t.jsonl"
    path.write_text((line() + "\n") * 1000)
    err = refused(load_trace, path)
    assert isinstance(err, TraceError) and "limit" in str(err) and err.line is None


@pytest.mark.parametrize("argv, message", [
    (["--block-size", str(2**20)], "over the limit of 4096"),
    (["--sweep", str(2**40)], "--sweep size 1099511627776 is more than this machine could hold"),
    (["--sweep", ",".join(str(4 * i) for i in range(1, 100))], "at most 64 sizes"),
    (["--device-tokens", str(2**50)], "--device-tokens 1125899906842624 is more than"),
], ids=["block_size", "sweep_size", "sweep_count", "device_tokens"])
def test_cli_bounds_print_one_line_and_exit_2(argv, message, tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text(line() + "\n")
    assert cli.main(["simulate", "--trace", str(path), "--page-size", "4", "--block-size", "4", "--no-progress",
                     *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_cli_refuses_a_fifo(tmp_path, capsys):
    fifo = tmp_path / "trace.jsonl"
    os.mkfifo(fifo)
    assert refused(lambda: (_ for _ in ()).throw(SystemExit(cli.main(["simulate", "--trace", str(fifo)])))).code == 2
    assert "not a regular file" in capsys.readouterr().err


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet='[]{}":,0123456789 abtimesp_lnghuo', max_size=200))
def test_any_line_parses_or_is_a_trace_error(text):
    try:
        parse_request(text, 4)
    except TraceError:
        pass


@pytest.mark.parametrize("argv", [["list", "\0"], ["validate", "a\0b"], ["simulate", "--trace", "t\0.jsonl"]])
def test_nul_characters_in_arguments_exit_2(argv, capsys):
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.strip() == "hicache-fsm: error: arguments cannot contain NUL characters"


def test_a_trace_path_with_a_nul_character_is_a_trace_error():
    with pytest.raises(TraceError, match="cannot contain a NUL character"):
        load_trace("trace\0.jsonl")


@pytest.mark.parametrize("page_size", [1, 2, 3])
def test_a_page_smaller_than_a_hash_ids_spelling_is_refused(page_size, tmp_path, capsys):
    """Ids 0 and 65537 share their first token: with pages under four tokens the cache hit a page the bound
    said no two requests share, and a valid trace ended in a bound MISMATCH (exit 1)."""
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": 1024, "output_length": 1,
                                        "hash_ids": [0, h]}) + "\n" for t, h in ((0, 1), (1, 65537))))
    assert cli.main(["simulate", "--trace", str(path), "--page-size", str(page_size), "--no-storage",
                     "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "at least 4" in err and len(err.strip().splitlines()) == 1
    assert cli.main(["simulate", "--trace", str(path), "--page-size", "4", "--no-storage", "--no-progress"]) == 0


@pytest.mark.parametrize("argv, message", [
    (["--tp", "2"], "--tp needs the chat workload"),
    (["--model", "llama"], "--model needs the chat workload"),
    (["--model-heads", "4"], "--model-heads needs the chat workload"),
    (["--instances", "2", "--jobs", "2"], "a cluster replay (--instances) runs in this one"),
    (["--storage-url", "memory://", "--no-storage"], "--no-storage leaves out"),
], ids=["tp", "model", "model_heads", "jobs_with_instances", "storage_url_unused"])
def test_options_a_trace_replay_would_ignore_are_usage_errors(argv, message, tmp_path, capsys):
    """Each was accepted and did nothing (exit 0): a run that looked configured as asked."""
    path = tmp_path / "t.jsonl"
    path.write_text(line() + "\n")
    assert cli.main(["simulate", "--trace", str(path), "--page-size", "4", "--block-size", "4", "--no-progress",
                     *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
