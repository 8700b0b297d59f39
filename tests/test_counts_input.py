"""``diagram --counts`` with a file that is not a trace: one line naming the file, exit 2, no torch or hypothesis."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache_fsm.cli import main
from hicache_fsm.errors import TraceError
from hicache_fsm.event_trace import MAX_JSON_DEPTH, read_events

GOOD = {"event": "transition", "machine": "residency", "source": "absent", "trigger": "insert", "dest": "device",
        "node": 1}
NOT_NAMES = st.one_of(st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
                      st.floats(allow_nan=False), st.booleans())


def _one_error_line(path, capsys) -> str:
    assert main(["diagram", "residency", "--counts", str(path)]) == 2
    captured = capsys.readouterr()
    [line] = captured.err.splitlines()
    assert str(path) in line and "Traceback" not in captured.err
    return line


@given(st.sampled_from(("machine", "source", "trigger", "dest", "event", "node", "object", "upper")), NOT_NAMES)
def test_a_list_or_dict_where_a_name_belongs_is_refused(tmp_path_factory, field, value):
    if field in ("node", "object", "upper") and isinstance(value, bool) is False and isinstance(value, int):
        return
    path = tmp_path_factory.mktemp("t") / "bad.jsonl"
    path.write_text(json.dumps(dict(GOOD, **{field: value})) + "\n", encoding="utf-8")
    with pytest.raises(TraceError, match=f"{path}:1: field '{field}'"):
        read_events(path)


def test_nested_json_png_fifo_and_missing_files_are_one_line_exit_2(tmp_path, capsys):
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"event": "transition", "machine": ' + "[" * 100_000 + "]" * 100_000 + "}\n", encoding="utf-8")
    assert f"deeper than {MAX_JSON_DEPTH}" in _one_error_line(deep, capsys)
    png = tmp_path / "heat.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    assert "not UTF-8" in _one_error_line(png, capsys)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert "not a regular file" in _one_error_line(fifo, capsys)  # refused without opening: no hang
    listed = tmp_path / "list.jsonl"
    listed.write_text(json.dumps(dict(GOOD, machine=["residency"])) + "\n", encoding="utf-8")
    assert "field 'machine'" in _one_error_line(listed, capsys)
    assert "no such trace file" in _one_error_line(tmp_path / "none.jsonl", capsys)


def test_a_leading_byte_order_mark_is_skipped_and_one_further_on_is_refused_by_line(tmp_path):
    text = json.dumps({"event": "header", "recorded_by": "test"}) + "\r\n" + json.dumps(GOOD) + "\r\n"
    plain, marked = tmp_path / "plain.jsonl", tmp_path / "marked.jsonl"
    plain.write_text(text, encoding="utf-8")
    marked.write_text(text, encoding="utf-8-sig")  # as Notepad saves it
    assert marked.read_bytes().startswith(b"\xef\xbb\xbf")
    assert read_events(marked) == read_events(plain)
    inner = tmp_path / "inner.jsonl"
    inner.write_bytes(plain.read_bytes().replace(b"\r\n", b"\r\n\xef\xbb\xbf", 1))
    with pytest.raises(TraceError, match=f"{inner}:2: not JSON"):
        read_events(inner)


def test_counts_imports_neither_torch_nor_hypothesis(tmp_path):
    trace = tmp_path / "run.jsonl"
    trace.write_text(json.dumps({"event": "header", "recorded_by": "test"}) + "\n" + json.dumps(GOOD) + "\n",
                     encoding="utf-8")
    code = ("import sys; from hicache_fsm.cli import main; "
            f"rc = main(['diagram', 'residency', '--counts', {str(trace)!r}]); "
            "print(rc, 'torch' in sys.modules, 'hypothesis' in sys.modules, file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stderr.split() == ["0", "False", "False"]


@pytest.mark.parametrize("argv, extra", [(["--plot", "hit.png"], "plot"), (["--model", "llama"], "llama")])
def test_missing_extras_exit_alike_and_name_the_wheels_extra(monkeypatch, capsys, tmp_path, argv, extra):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # importing it raises ImportError
    monkeypatch.setitem(sys.modules, "hicache_fsm.llama_model", None)
    assert main(["simulate", "--clients", "1", "--rounds", "1", "--no-progress", *argv]) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert f"pip install 'hicache_fsm[{extra}]'" in line and "-e" not in line.split("pip install")[1]
