"""Inputs an outside probe found accepted, truncated, or answered with a raw error: hand-built traces, index lists
of floats, output paths that are FIFOs nobody reads, names and numbers too long to be what they claim.
Each is now a typed error (or a one-line usage error) before any work; each case fails on the old code."""

from __future__ import annotations

import errno
import os
import sys
import threading

import pytest
import torch

from hang_guard import raised_by
from hicache_fsm import cli
from hicache_fsm.allocator import as_index_tensor
from hicache_fsm.cp import CPLayout, CPPageAllocator
from hicache_fsm.errors import BadIndices, ConfigError, TraceError
from hicache_fsm.output_files import NO_READER, open_output_text, write_output_text
from hicache_fsm.trace import Trace, TraceRequest, load_trace, parse_lines

GOOD = TraceRequest(0.0, 16, 0, (1,), 1)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    exc = raised_by(lambda: sys.exit(cli.main(list(argv))))
    out, err = capsys.readouterr()
    assert isinstance(exc, SystemExit), f"{type(exc).__name__}: {exc}"
    return exc.code, out, err


# =========================================================================== traces built by hand


@pytest.mark.parametrize("fields, named", [
    ((-1.0, 16, 0, (1,), 1), "timestamp"),
    ((float("nan"), 16, 0, (1,), 1), "timestamp"),
    ((0.0, "16", 0, (1,), 1), "input_length"),
    ((0.0, 0, 0, (), 1), "input_length"),
    ((0.0, 16, -1, (1,), 1), "output_length"),
    ((0.0, 16, 0, [1], 1), "hash_ids must be a tuple"),
    ((0.0, 16, 0, (1.5,), 1), "hash_ids must be ints"),
    ((0.0, 16, 0, (2**63,), 1), "hash_ids must be ints"),
    ((0.0, 16, 0, (1,), -2), "line"),
    ((0.0, 10**5000, 0, (1,), 1), None),  # accepted here: the Trace refuses its block count (below)
])
def test_a_hand_built_request_is_checked_as_a_trace_line_is(fields, named):
    if named is None:
        request = TraceRequest(*fields)
        with pytest.raises(ConfigError, match="blocks of 16 tokens"):
            Trace("hand-made", 16, (request,))
        return
    with pytest.raises(ConfigError, match=named):
        TraceRequest(*fields)


@pytest.mark.parametrize("kw, named", [
    (dict(path=None), "Trace.path"),
    (dict(block_size=3), "block size"),
    (dict(requests=[GOOD]), "tuple of TraceRequest"),
    (dict(requests=({"timestamp": 0},)), "tuple of TraceRequest"),
    (dict(requests=(TraceRequest(0.0, 17, 0, (1,), 1),)), "1 hash_ids, but input_length 17 makes 2 blocks"),
    (dict(requests=(TraceRequest(5.0, 16, 0, (1,), 1), GOOD)), "before the previous request's"),
])
def test_a_hand_built_trace_is_checked_as_a_file_is(kw, named):
    with pytest.raises(ConfigError, match=named):
        Trace(**{"path": "hand-made", "block_size": 16, "requests": (GOOD,), **kw})


def test_parsing_refuses_what_is_not_lines_of_text():
    with pytest.raises(TraceError, match=r"<trace>:2: a line must be a str, got int"):
        parse_lines(['{"timestamp": 0, "input_length": 4, "output_length": 0, "hash_ids": [1]}', 7], 4)
    for lines in (None, 5, b"{}"):
        with pytest.raises(ConfigError, match="parse_lines takes"):
            parse_lines(lines)
    with pytest.raises(ConfigError, match="where must be a str"):
        parse_lines("{}", where=5)
    with pytest.raises(ConfigError, match="load_trace takes a path"):
        load_trace(b"/no/such/trace.jsonl")


def test_a_huge_length_on_a_trace_line_is_named_not_raised():
    line = '{"timestamp": 0, "input_length": 1' + "0" * 5000 + ', "output_length": 0, "hash_ids": [1]}'
    with pytest.raises(TraceError, match="<trace>:1: not valid JSON"):
        parse_lines(line)


# =========================================================================== indices


@pytest.mark.parametrize("items", [[0.7, 64.0], [1.0], [True, False], [0, 1.5]])
def test_index_lists_of_floats_or_bools_are_refused_not_truncated(items):
    with pytest.raises(BadIndices, match="expected an integer tensor"):
        as_index_tensor(items)


def test_index_lists_of_ints_still_read():
    assert as_index_tensor([]).dtype == torch.int64 and as_index_tensor([]).numel() == 0
    assert as_index_tensor([3, 4]).tolist() == [3, 4]
    assert as_index_tensor(range(2)).tolist() == [0, 1]
    with pytest.raises(BadIndices, match="cannot be read"):
        as_index_tensor([2**70])


def test_cp_page_owners_must_be_ranks_not_fractions():
    allocator = CPPageAllocator(CPLayout(2, 0, 4, 32))
    free = allocator.available_tokens
    with pytest.raises(BadIndices, match="page owners"):
        allocator.alloc_pages_with_owners([0.9, 1.2])  # truncated, they were owners 0 and 1
    assert allocator.available_tokens == free
    assert allocator.alloc_pages_with_owners([0, 1]).numel() == 8


# =========================================================================== output files


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "out.fifo"
    os.mkfifo(path)
    return path


def test_a_fifo_nobody_reads_is_an_error_not_a_wait(fifo):
    exc = raised_by(open_output_text, fifo)
    assert isinstance(exc, OSError) and exc.errno == errno.ENXIO and NO_READER in str(exc)


def test_a_fifo_somebody_reads_is_written(fifo):
    got: list[str] = []
    opened = threading.Event()

    def reader() -> None:
        with open(fifo, encoding="utf-8") as f:  # blocks until the writer opens
            opened.set()
            got.append(f.read())

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    for _ in range(2000):  # the reader's open must come first; give it until the writer's open succeeds
        try:
            write_output_text(fifo, "hello\n")
            break
        except OSError as exc:
            assert exc.errno == errno.ENXIO
            opened.wait(0.005)
    t.join(60)
    assert got == ["hello\n"]


def test_a_regular_output_file_is_written_and_truncated(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("an older and longer text\n", encoding="utf-8")
    write_output_text(path, "new\n")
    assert path.read_text(encoding="utf-8") == "new\n"


@pytest.mark.parametrize("argv", [
    ["diagram", "residency", "-o", "FIFO"],
    ["fuzz", "--examples", "1", "--record", "FIFO"],
    ["check", "--max-depth", "1", "--record", "FIFO"],
])
def test_commands_writing_a_fifo_nobody_reads_fail_at_once(capsys, fifo, argv):
    code, _, err = run_cli(capsys, *[str(fifo) if a == "FIFO" else a for a in argv])
    assert code == 1 and NO_READER in err


# =========================================================================== names and numbers


def test_a_machine_name_too_long_for_a_file_is_an_unknown_name(capsys):
    code, _, err = run_cli(capsys, "diagram", "a" * 300)
    assert code == 2 and "no machine named" in err and "Errno" not in err


@pytest.mark.parametrize("argv", [
    ["simulate", "--clients", "1" * 5000],
    ["simulate", "--device-tokens", "1" * 5000],
    ["check", "--max-depth", "1" * 5000],
    ["check", "--max-jobs", "1" * 5000],
])
def test_an_integer_of_thousands_of_digits_is_named_as_one_in_a_short_line(capsys, argv):
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and "integer of 5000 digits" in err and len(err) < 400


# =========================================================================== trace tools


def test_block_tokens_refuse_a_length_past_their_ids_alike():
    """``packed`` cut the tokens short without a word where ``tokens`` raised IndexError."""
    from hicache_fsm.trace import BlockTokens

    blocks = BlockTokens(8)
    for make in (blocks.packed, blocks.tokens):
        with pytest.raises(ConfigError, match="1 hash ids name 8 tokens"):
            make((1,), 20)
    assert len(blocks.tokens((1, 2, 3), 20)) == len(blocks.packed((1, 2, 3), 20)) == 20


def test_a_generated_trace_never_holds_timestamps_its_reader_refuses():
    from hicache_fsm.trace_gen import TraceShape

    with pytest.raises(ConfigError, match="past what a trace's timestamps hold"):
        TraceShape(requests=3, rate=1e-300)
    TraceShape(requests=3, rate=1e-6)  # about 3e9 ms: well within


def test_heat_map_events_missing_what_they_name_are_not_a_trace(capsys, tmp_path):
    split = tmp_path / "split.jsonl"
    split.write_text('{"event":"transition","machine":"residency","source":"absent","trigger":"insert",'
                     '"dest":"device","node":1}\n{"event":"split","node":1}\n', encoding="utf-8")
    bare = tmp_path / "bare.jsonl"
    bare.write_text('{"event":"transition","trigger":"insert","dest":"device","node":1}\n', encoding="utf-8")
    for path, named in ((split, "a split event without 'upper'"), (bare, "a transition event without 'source'")):
        code, _, err = run_cli(capsys, "diagram", "residency", "--counts", str(path))
        assert code == 2 and named in err


def test_a_trace_path_with_control_characters_is_printed_escaped(capsys, tmp_path):
    path = tmp_path / "evil\x1b[31m.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 128, "output_length": 4, "hash_ids": [1, 2]}\n',
                    encoding="utf-8")
    code, out, _ = run_cli(capsys, "simulate", "--trace", str(path), "--block-size", "64", "--no-progress",
                           "--no-storage")
    assert code == 0 and "\x1b" not in out and "evil\\x1b[31m.jsonl" in out


def test_a_replay_reports_its_own_ttft_only_and_no_host_where_a_configuration_has_none(capsys, tmp_path):
    import json

    path = tmp_path / "t.jsonl"
    path.write_text("".join(f'{{"timestamp": {i}, "input_length": 128, "output_length": 4, "hash_ids": [1, {i}]}}\n'
                            for i in range(2, 6)), encoding="utf-8")
    code, out, _ = run_cli(capsys, "simulate", "--trace", str(path), "--block-size", "64", "--no-progress",
                           "--no-storage", "--json")
    configs = json.loads(out)["configs"]
    assert code == 0 and configs["device"]["host_tokens"] is None and configs["infinite"]["host_tokens"] is None
    assert configs["device+host"]["host_tokens"] > 0
    for row in configs.values():
        assert "ttft_ms_mean" not in row and row["ttft_mean_s"] > 0
