"""``replay`` on traces that are wrong, odd or not files at all: one divergence or one error naming the line.

A completion must agree with the acks its nodes went through, ids must be
comparable, every line must be JSON Python can read safely, only a regular
file is read, and the trace must be one recording in the recorder's order
(header first, ``seq`` the event's position): each was accepted or crashed
with a traceback before.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from hang_guard import raised_by

from hicache_fsm.cli import main
from hicache_fsm.testing import HiCacheAdapter, load_trace, record, replay

HEADER = {"event": "header", "version": 1, "machines": ["residency"]}


def _move(node, trigger: str, source: str, dest: str) -> dict:
    return {"event": "transition", "machine": "residency", "node": node, "trigger": trigger, "source": source,
            "dest": dest}


def _write(tmp_path: Path, events: list[dict]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def _numbered(events: list[dict]) -> list[dict]:
    return [dict(e, seq=i) for i, e in enumerate(events)]


def _exit_status(argv: list[str]) -> int:
    """``main(argv)``'s status, under the hang guard: a FIFO once blocked the command forever."""

    def run() -> None:
        raise SystemExit(main(argv))

    return raised_by(run).code


def _divergence_on_the_command_line(path: Path, line: int, reason: str, capsys) -> None:
    """The command exits 1 and prints the divergence at ``line``, never a traceback."""
    assert main(["replay", str(path)]) == 1
    out, err = capsys.readouterr()
    assert f"line {line}: " in out and reason in out and "Traceback" not in out + err


# ------------------------------------------------------------------ a completion agrees with its acks


@pytest.mark.parametrize("ack, dest, ok", [("write_failed", "device", True), ("write_done", "device_host", False)])
def test_a_completion_whose_ok_disagrees_with_its_nodes_ack_is_a_divergence(tmp_path, capsys, ack, dest, ok):
    """The copy failed (or landed), yet the completion said the opposite: the trace cannot be a run of the cache."""
    events = _numbered([HEADER, _move(1, "insert", "absent", "device"), _move(1, "backup", "device", "writing_host"),
                        {"event": "job", "job": 7, "kind": "d2h", "nodes": [1]}, _move(1, ack, "writing_host", dest),
                        {"event": "completion", "job": 7, "ok": ok}])
    reason = f"job 7 (d2h) completed with ok={json.dumps(ok)} but nodes [1] went through {ack!r}"
    result = replay(events, require_quiescent=True)
    assert not result.ok and result.divergence.line == 6 and result.divergence.reason == reason
    _divergence_on_the_command_line(_write(tmp_path, events), 6, reason, capsys)
    events[-1]["ok"] = not ok  # the completion that agrees replays
    assert replay(events, require_quiescent=True).ok


# ------------------------------------------------------------------ events the replayer cannot hash or order


@pytest.mark.parametrize("events, line, reason", [
    ([HEADER, {"event": ["job"]}], 2, "'event' must be a string, got [\"job\"]"),
    ([HEADER, {"event": "job", "job": 1, "kind": "d2h", "nodes": []},
      {"event": "job", "job": "2", "kind": "d2h", "nodes": []}],
     3, 'job id "2" is a string, but the trace\'s first job id was an integer'),
    ([HEADER, _move(1, "insert", "absent", "device"), _move("2", "insert", "absent", "device")],
     3, 'residency object id "2" is a string, but the trace\'s first residency object id was an integer'),
    ([HEADER, _move(1, "insert", "absent", "device"), {"event": "job", "job": 1, "kind": "bogus", "nodes": [1]}],
     3, "job 1 of unknown kind 'bogus' (kinds: d2h, h2d, h2s, s2h)"),
], ids=["event_a_list", "job_ids_mixed", "node_ids_mixed", "unknown_kind"])
def test_an_event_the_replayer_cannot_hash_order_or_know_is_a_divergence_at_its_line(tmp_path, capsys, events, line,
                                                                                       reason):
    events = _numbered(events)
    result = replay(events, require_quiescent=True)
    assert not result.ok and result.divergence.line == line and reason in result.divergence.reason
    _divergence_on_the_command_line(_write(tmp_path, events), line, reason, capsys)


# ------------------------------------------------------------------ lines JSON cannot read safely


@pytest.mark.parametrize("text, message", [
    ('{"seq": 1, "event": "job", "job": 1, "kind": "d2h", "nodes": ' + "[" * 50_000 + "]" * 50_000 + "}",
     "JSON nested 50001 levels deep (limit 32)"),  # json.loads recursed until RecursionError
    ('{"seq": 1, "event": "job", "job": ' + "1" * 5000 + ', "kind": "d2h", "nodes": []}',
     "a number longer than 4300 digits"),  # json's own ValueError, which named no line
], ids=["deep", "long_number"])
def test_a_line_json_cannot_read_safely_is_refused_by_its_number(tmp_path, capsys, text, message):
    path = tmp_path / "odd.jsonl"
    path.write_text(json.dumps(dict(HEADER, seq=0)) + "\n" + text + "\n")
    with pytest.raises(ValueError, match="^" + re.escape(f"trace line 2: {message}")):
        load_trace(path)
    assert main(["replay", str(path)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"hicache-fsm replay: trace line 2: {message}"]


# ------------------------------------------------------------------ only a regular file is read


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_is_refused_without_opening_it(tmp_path, capsys):
    fifo = tmp_path / "trace.jsonl"
    os.mkfifo(fifo)
    err = raised_by(load_trace, fifo)
    assert isinstance(err, ValueError) and "not a regular file" in str(err)
    assert _exit_status(["replay", str(fifo)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"hicache-fsm replay: trace {fifo}: not a regular file (a FIFO, socket or device is never read)"]


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_a_device_is_refused_without_reading_it():
    """/dev/zero has no line end: reading it filled memory."""
    err = raised_by(load_trace, "/dev/zero")
    assert isinstance(err, ValueError) and "not a regular file" in str(err)


# ------------------------------------------------------------------ one recording, in the recorder's order


def _recording() -> list[dict]:
    adapter = HiCacheAdapter(device_pages=4, host_pages=4)
    with record(adapter.cache) as rec:
        adapter.insert((1, 2))
        adapter.insert((3, 4))
        for job in adapter.pending_jobs():
            adapter.complete_job(job.id)
    return [json.loads(line) for line in rec.lines()]


def _swapped(events: list[dict]) -> list[dict]:  # node 1's backup and node 2's insert: each still legal alone
    events[3], events[4] = events[4], events[3]
    return events


def _dropped(events: list[dict]) -> list[dict]:  # the first completion: nothing after it needs it
    del events[8]
    return events


def _second_header(events: list[dict]) -> list[dict]:
    return [*events, dict(events[0], seq=len(events))]


def _seq_a_string(events: list[dict]) -> list[dict]:
    events[5]["seq"] = "5"
    return events


def _headless(events: list[dict]) -> list[dict]:
    return _numbered(events[1:])


@pytest.mark.parametrize("tamper, line, reason", [
    (_swapped, 4, "seq 4 where 3 was due"),
    (_dropped, 9, "seq 9 where 8 was due"),
    (_second_header, 12, "a second header"),
    (_seq_a_string, 6, "'seq' must be an integer, got \"5\""),
    (_headless, 1, "the trace starts with a 'transition' event, not with its header"),
], ids=["swapped", "dropped", "second_header", "seq_a_string", "headless"])
def test_a_trace_out_of_the_recorders_order_is_a_divergence_at_its_line(tmp_path, capsys, tamper, line, reason):
    """Each tampered trace is still legal event by event: only the order the recorder wrote tells.

    ``seq`` may be left out (as the tiny cache example's hand-written trace does): then the events alone are checked.
    """
    events = _recording()
    assert replay(events).ok and replay([{k: v for k, v in e.items() if k != "seq"} for e in events]).ok
    tampered = tamper(events)
    result = replay(tampered)
    assert not result.ok and result.divergence.line == line and reason in result.divergence.reason
    _divergence_on_the_command_line(_write(tmp_path, tampered), line, reason, capsys)


@pytest.mark.parametrize("text", ["", "\n\n"], ids=["no_bytes", "blank_lines"])
def test_an_empty_trace_is_a_divergence_not_a_valid_run(tmp_path, capsys, text):
    path = tmp_path / "empty.jsonl"
    path.write_text(text)
    result = replay(path)
    assert not result.ok and result.events == 0 and "the trace is empty" in result.divergence.reason
    _divergence_on_the_command_line(path, 1, "the trace is empty", capsys)


@pytest.mark.parametrize("version", [True, 1.0, "1"])
def test_a_header_version_of_another_json_type_is_a_divergence(tmp_path, capsys, version):
    """``true`` and ``1.0`` equal 1 in Python: a trace that says neither replayed as ok."""
    path = _write(tmp_path, _numbered([dict(HEADER, version=version)]))
    result = replay(path)
    assert not result.ok and "trace version" in result.divergence.reason
    _divergence_on_the_command_line(path, 1, "trace version", capsys)
