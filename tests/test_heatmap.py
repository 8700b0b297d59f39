"""Heat maps of recorded runs: counts equal the run's own tallies, every transition is named with its count."""

from __future__ import annotations

import json
import re
import shutil
import xml.etree.ElementTree as ET
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_fsm.cli import main
from hicache_fsm.heatmap import TraceMismatch, heat_dot, heat_mermaid, heat_svg, spec_edges, tally
from hicache_fsm.spec import load_builtin
from hicache_fsm.testing.trace import load_trace, replay
from test_diagrams import check_mermaid

RESIDENCY = load_builtin("residency")
SMALL_RUN = ["--clients", "3", "--rounds", "3", "--request-length", "16", "--output-length", "4",
             "--system-prompt-length", "16", "--page-size", "8", "--device-tokens", "80", "--host-tokens", "96",
             "--device", "cpu", "--no-progress", "--json"]


def edge_name(edge) -> str:
    source, trigger, dest = edge
    return f"{source} --{trigger}--> {dest}"


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    """A small ``simulate --record`` run: its trace events and the tally its JSON reports."""
    tmp = tmp_path_factory.mktemp("sim")
    trace = tmp / "run.jsonl"
    args = ["simulate", *SMALL_RUN, "--storage-url", f"file://{tmp}/l3", "--record", str(trace)]
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(args) == 0
    report = json.loads(out.getvalue())
    return trace, load_trace(trace), report["recorded"]


def test_trace_of_simulate_replays_and_its_heat_equals_the_runs_tally(simulated):
    trace, events, recorded = simulated
    assert recorded["tier"] == "device+host+storage" and recorded["events"] == len(events)
    assert replay(events).ok
    heat = tally(events, RESIDENCY)
    fired = {edge_name(e): n for e, n in heat.fired.items() if n}
    assert fired == recorded["transitions"]["residency"]
    assert heat.transitions == sum(1 for e in events if e["event"] == "transition")
    assert heat.occupancy_known and heat.runs == 1


def test_every_format_names_every_transition_with_its_count(simulated):
    _, events, recorded = simulated
    heat = tally(events, RESIDENCY)
    tallied = Counter(recorded["transitions"]["residency"])
    dot = heat_dot(RESIDENCY, heat)
    for edge in spec_edges(RESIDENCY):
        source, _, dest = edge
        count = tallied[edge_name(edge)]
        words = f"fired {count}" if count else "never fired"
        pattern = rf'"{source}" -> "{dest}" \[label="{re.escape(edge[1])}[^"]*\\n{words}"'
        assert re.search(pattern, dot), f"{edge_name(edge)} is not drawn with '{words}'"
    parsed = check_mermaid(heat_mermaid(RESIDENCY, heat))
    labels = Counter()
    for kind, fields in parsed:
        if kind == "edge":
            m = re.fullmatch(r"(\w+)(?: .*)? - (?:fired (\d+)|never fired)", fields["label"])
            assert m, fields["label"]
            labels[f"{fields['src']} --{m[1]}--> {fields['dst']}"] = int(m[2] or 0)
    assert {k: v for k, v in labels.items() if v} == dict(tallied)
    assert set(labels) == {edge_name(e) for e in spec_edges(RESIDENCY)}


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` is not installed")
def test_svg_heat_map_parses_and_shows_the_counts(simulated, tmp_path):
    trace, events, recorded = simulated
    out = tmp_path / "heat.svg"
    assert main(["diagram", "residency", "--counts", str(trace), "--format", "svg", "-o", str(out)]) == 0
    root = ET.parse(out).getroot()
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    for name, count in recorded["transitions"]["residency"].items():
        assert f"fired {count}" in texts, name
    assert "never fired" in texts
    assert heat_svg(RESIDENCY, tally(events, RESIDENCY)) == out.read_text(encoding="utf-8")


def test_occupancy_of_a_small_trace():
    events = [
        {"event": "header", "version": 1},
        {"event": "transition", "node": 1, "trigger": "insert", "source": "absent", "dest": "device"},  # t=0
        {"event": "transition", "node": 2, "trigger": "insert", "source": "absent", "dest": "device"},  # t=1
        {"event": "job", "job": 9, "kind": "d2h", "nodes": [1]},  # t=2
        {"event": "transition", "node": 1, "trigger": "backup", "source": "device", "dest": "writing_host"},  # t=3
        {"event": "split", "node": 2, "upper": 3},  # t=4
        {"event": "transition", "node": 3, "trigger": "drop", "source": "device", "dest": "removed"},  # t=5
        {"event": "removed", "node": 3},  # t=6
        {"event": "header", "version": 1},  # a second run: every object of the first leaves
        {"event": "transition", "node": 1, "trigger": "insert", "source": "absent", "dest": "device"},  # t=7
    ]
    heat = tally(events, RESIDENCY)
    assert heat.runs == 2 and heat.events == 8
    device = heat.states["device"]
    # the state after each event holds one tick: in device, node 1 for [0,3), node 2 for [1,7) (the second
    # header ends run one), node 3 for [4,5), node 1 again for [7,8)
    assert device.entered == 4 and device.peak == 2
    assert device.mean == pytest.approx((3 + 6 + 1 + 1) / 8)
    assert heat.states["removed"].entered == 1 and heat.states["removed"].mean == pytest.approx(1 / 8)
    assert heat.fired[("absent", "insert", "device")] == 3


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_tally_counts_random_walks_exactly(data):
    """Random legal walks of several objects: fire counts and entries equal the walk's own counts."""
    by_source: dict[str, list] = {}
    for edge in spec_edges(RESIDENCY):
        by_source.setdefault(edge[0], []).append(edge)
    where = {}
    events, fired, entered = [], Counter(), Counter()
    for _ in range(data.draw(st.integers(0, 40))):
        obj = data.draw(st.integers(0, 4))
        state = where.get(obj, RESIDENCY.initial)
        if state not in by_source:
            continue
        edge = data.draw(st.sampled_from(by_source[state]))
        if obj not in where:
            entered[state] += 1
        events.append({"event": "transition", "node": obj, "source": edge[0], "trigger": edge[1], "dest": edge[2]})
        where[obj] = edge[2]
        fired[edge] += 1
        entered[edge[2]] += 1
    heat = tally(events, RESIDENCY)
    assert {e: n for e, n in heat.fired.items() if n} == dict(fired)
    assert {s: h.entered for s, h in heat.states.items() if h.entered} == dict(entered)
    for h in heat.states.values():
        assert 0 <= h.mean <= h.peak
    assert sum(h.mean for h in heat.states.values()) == pytest.approx(
        sum(len(set(e["node"] for e in events[:i + 1])) for i in range(len(events))) / max(1, len(events)))


def test_a_trace_from_another_spec_is_refused(tmp_path, capsys):
    bad = [{"event": "transition", "node": 1, "trigger": "teleport", "source": "absent", "dest": "device", "_line": 3}]
    with pytest.raises(TraceMismatch, match="trace line 3: 'residency' has no transition absent --teleport--> device"):
        tally(bad, RESIDENCY)
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({k: v for k, v in bad[0].items() if k != "_line"}) + "\n", encoding="utf-8")
    assert main(["diagram", "residency", "--counts", str(path)]) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert "teleport" in line


def test_counts_cli_errors(simulated, tmp_path, capsys):
    trace, _, _ = simulated
    assert main(["diagram", "prefetch", "--counts", str(trace)]) == 1
    assert "records no transitions of prefetch" in capsys.readouterr().err
    assert main(["diagram", "residency", "--counts", str(tmp_path / "none.jsonl")]) == 2  # a bad argument
    assert "no such trace file" in capsys.readouterr().err
    assert main(["diagram", "--all", "--counts", str(trace), "--format", "dot"]) == 0
    assert capsys.readouterr().out.count("digraph") == 1


def test_fuzz_and_check_record_what_their_coverage_reports(tmp_path, capsys):
    fuzz_trace, check_trace = tmp_path / "fuzz.jsonl", tmp_path / "check.jsonl"
    assert main(["fuzz", "--examples", "4", "--steps", "12", "--quiet", "--json", "--record", str(fuzz_trace)]) == 0
    fuzz = json.loads(capsys.readouterr().out)
    assert main(["check", "--nodes", "2", "--device-pages", "1", "--host-pages", "1", "--quiet", "--json",
                 "--record", str(check_trace)]) == 0
    check = json.loads(capsys.readouterr().out)
    for trace, report, linear in ((fuzz_trace, fuzz, True), (check_trace, check, False)):
        events = load_trace(trace)
        heat = tally(events, RESIDENCY)
        cov = report.get("coverage_detail", report["coverage"])["residency"]  # check: counts; detail beside
        assert sum(1 for n in heat.fired.values() if n) == cov["transitions"]
        never = {edge_name(e) for e, n in heat.fired.items() if not n}
        assert never == {f"{s} --{t}--> {d}" for s, t, d in
                         (re.fullmatch(r"(\w+) --(\w+)--> (\w+)", m).groups() for m in cov["missing_transitions"])}
        assert heat.occupancy_known is linear
        assert heat.runs >= 1
