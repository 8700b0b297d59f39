"""Heat maps of a recorded run: how often each transition fired and where the objects sat.

A trace (JSONL, ``hicache_fsm.testing.trace``; written by ``simulate``, ``fuzz``
or ``check`` with ``--record``) lists every fired transition with its machine,
trigger, source and destination. ``tally`` folds one machine's transitions into
a ``Heat``:

- ``fired``: times each edge (source, trigger, dest) fired. Two transitions of a
  spec that share all three (they differ only in guards or jobs) are one edge
  of the drawing, as the trace cannot tell them apart.
- per state, ``entered``: times an object entered it (a new object counts as
  entering the state it first appears in; a split node as entering its
  parent's state), and, when the trace names the object of every transition,
  its occupancy: the mean and peak number of objects in the state, with the
  trace's events as the clock. A trace header starts a new run: every object
  of the previous run leaves. Traces of ``check`` fork states and name no
  objects, so only ``entered`` is known there.

The drawings are the spec's own (``hicache_fsm.diagrams``) with counts on every
edge and state: line width and colour grow with the fire count, a never-fired
edge is grey and dashed and says so, a state's fill darkens with its mean
occupancy (entries when occupancy is unknown). A legend names the scales.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

import attrs

from hicache_fsm.diagrams import (
    DOT_TIMEOUT_S,
    dot_document,
    dot_quote,
    edge_label,
    legend_node,
    mermaid_ids,
    mermaid_text,
    state_style,
    svg_from_dot,
)
from hicache_fsm.errors import DiagramError
from hicache_fsm.spec import Spec

Edge = tuple[str, str, str]  # (source, trigger, dest)

# White to dark red: state fill and edge colour by heat (fraction of the largest value, log scale).
RAMP = ("#ffffff", "#fee8c8", "#fdbb84", "#fc8d59", "#e34a33", "#b30000")
EDGE_RAMP = ("#4a6fa5", "#7b6fa0", "#b0607a", "#d9534f", "#b30000")
NEVER_COLOUR = "#b0b0b0"
MAX_PENWIDTH = 7.0


class TraceMismatch(DiagramError):
    """The trace names a transition the spec does not have (recorded from another spec or version)."""


@attrs.frozen
class StateHeat:
    entered: int = 0
    mean: float | None = None  # mean objects in the state over the trace's events; None: objects not named
    peak: int | None = None


@attrs.frozen
class Heat:
    """One machine's counts from one trace."""

    machine: str
    fired: dict[Edge, int]
    states: dict[str, StateHeat]
    events: int  # events in the trace (all machines, headers excluded): the occupancy clock
    runs: int  # trace headers: separate runs recorded into one file
    occupancy_known: bool
    recorded_by: str = ""

    @property
    def transitions(self) -> int:
        return sum(self.fired.values())


def spec_edges(spec: Spec) -> dict[Edge, list[str]]:
    """Every (source, trigger, dest) of the spec, in spec order, with the edge labels of the transitions behind it."""
    out: dict[Edge, list[str]] = {}
    for t in spec.transitions:
        for source in t.sources:
            out.setdefault((source, t.trigger, t.dest), []).append(edge_label(t))
    return out


class _Occupancy:
    """Objects per state over a clock that ticks once per trace event."""

    def __init__(self) -> None:
        self.where: dict[object, str] = {}
        self.count: Counter[str] = Counter()
        self.area: Counter[str] = Counter()
        self.since: dict[str, int] = {}
        self.peak: Counter[str] = Counter()
        self.entered: Counter[str] = Counter()
        self.now = 0

    def _move(self, state: str, delta: int) -> None:
        self.area[state] += self.count[state] * (self.now - self.since.get(state, self.now))
        self.since[state] = self.now
        self.count[state] += delta
        self.peak[state] = max(self.peak[state], self.count[state])

    def enter(self, obj: object, state: str) -> None:
        old = self.where.get(obj)
        if old is not None:
            self._move(old, -1)
        self.where[obj] = state
        self._move(state, +1)
        self.entered[state] += 1

    def leave(self, obj: object) -> None:
        old = self.where.pop(obj, None)
        if old is not None:
            self._move(old, -1)

    def leave_all(self) -> None:
        for obj in list(self.where):
            self.leave(obj)

    def mean(self, state: str) -> float:
        self._move(state, 0)
        return self.area[state] / self.now if self.now else 0.0


def tally(events: Iterable[dict], spec: Spec) -> Heat:
    """Count ``spec``'s transitions and state occupancy in trace ``events`` (see the module docstring).

    Raises ``TraceMismatch`` when the trace names a transition the spec lacks.
    """
    edges = spec_edges(spec)
    fired: Counter[Edge] = Counter()
    occ = _Occupancy()
    runs = 0
    named = True
    recorded_by = ""
    for ev in events:
        kind = ev.get("event")
        if kind == "header":
            runs += 1
            occ.leave_all()
            named = named and ev.get("linear", True) is not False
            recorded_by = recorded_by or str(ev.get("recorded_by", ""))
            continue
        _apply(ev, kind, spec, edges, fired, occ)
        named = named and (kind != "transition" or ev.get("machine", "residency") != spec.name
                           or ev.get("node", ev.get("object")) is not None)
        occ.now += 1  # the state after each event holds for one tick
    states = {
        s: StateHeat(occ.entered[s], occ.mean(s), occ.peak[s]) if named else StateHeat(occ.entered[s])
        for s in spec.state_names
    }
    return Heat(spec.name, {e: fired[e] for e in edges}, states, occ.now, runs, named, recorded_by)


def _apply(ev: dict, kind: object, spec: Spec, edges: dict, fired: Counter, occ: _Occupancy) -> None:
    """One non-header trace event's effect on the counts."""
    if kind == "transition" and ev.get("machine", "residency") == spec.name:
        edge = (ev.get("source"), ev.get("trigger"), ev.get("dest"))
        if edge not in edges:
            line = ev.get("_line")
            where = f"trace line {line}: " if line is not None else ""
            raise TraceMismatch(
                f"{where}{spec.name!r} has no transition {edge[0]} --{edge[1]}--> {edge[2]}; "
                "was the trace recorded from another version of the spec?")
        fired[edge] += 1
        obj = ev.get("node", ev.get("object"))
        if obj is None:
            occ.entered[edge[2]] += 1
            return
        if obj not in occ.where:
            occ.enter(obj, edge[0])
        occ.enter(obj, edge[2])
    elif kind == "split" and spec.name == "residency" and ev.get("node") in occ.where:
        occ.enter(ev.get("upper"), occ.where[ev["node"]])
    elif kind == "removed" and spec.name == "residency":
        occ.leave(ev.get("node"))


def machines_in(events: Iterable[dict]) -> list[str]:
    """Machines with at least one transition in the trace, in order of first appearance."""
    return list(dict.fromkeys(ev.get("machine", "residency") for ev in events if ev.get("event") == "transition"))


# --------------------------------------------------------------------------- scales


def _fraction(value: float, top: float) -> float:
    """``value`` against ``top`` on a log scale, in [0, 1]."""
    if value <= 0 or top <= 0:
        return 0.0
    return math.log1p(value) / math.log1p(top)


def _pick(ramp: tuple[str, ...], fraction: float) -> str:
    return ramp[min(len(ramp) - 1, int(fraction * (len(ramp) - 1) + 0.5))]


def _state_value(heat: Heat, state: str) -> float:
    sh = heat.states[state]
    return sh.mean if heat.occupancy_known and sh.mean is not None else sh.entered


def _fmt(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".") if x else "0"


def state_summary(sh: StateHeat) -> str:
    """``entered 12, mean 3.4, peak 7`` (occupancy parts only when known)."""
    text = f"entered {sh.entered}"
    if sh.mean is not None:
        text += f", mean {_fmt(sh.mean)}, peak {sh.peak}"
    return text


def fired_text(count: int) -> str:
    return f"fired {count}" if count else "never fired"


def _title(heat: Heat) -> str:
    source = f" recorded by {heat.recorded_by}" if heat.recorded_by else ""
    runs = f"{heat.runs} runs, " if heat.runs > 1 else ""
    return f"Heat map of {heat.machine}: {heat.transitions} transitions{source} ({runs}{heat.events} trace events)"


# --------------------------------------------------------------------------- dot / svg


def heat_dot(spec: Spec, heat: Heat) -> str:
    """The spec's Graphviz drawing with ``heat``'s counts on every state and edge, and a legend."""
    top_state = max((_state_value(heat, s) for s in spec.state_names), default=0)
    top_edge = max(heat.fired.values(), default=0)
    nodes = []
    for st in spec.states:
        sh = heat.states[st.name]
        fraction = _fraction(_state_value(heat, st.name), top_state)
        fill = _pick(RAMP, fraction)
        attrs_ = [a for a in state_style(st) if not a.startswith(("style=", "fillcolor="))]
        styles = "rounded,filled" + (",dashed" if "in_flight" in st.tags else "")
        attrs_ += [f"style={dot_quote(styles)}", f"fillcolor={dot_quote(fill)}",
                   f"label={dot_quote(st.name + chr(10) + state_summary(sh))}"]
        if fraction > 0.7:
            attrs_.append('fontcolor="white"')
        if not sh.entered and st.name != spec.initial:
            attrs_.append(f"color={dot_quote(NEVER_COLOUR)}")
        nodes.append(f"  {dot_quote(st.name)} [{', '.join(attrs_)}];")
    edges = []
    for (source, trigger, dest), labels in spec_edges(spec).items():
        count = heat.fired[(source, trigger, dest)]
        label = "\n".join(labels) + "\n" + fired_text(count)
        if count:
            fraction = _fraction(count, top_edge)
            colour = _pick(EDGE_RAMP, fraction)
            attrs_ = [f"penwidth={1 + (MAX_PENWIDTH - 1) * fraction:.2f}", f"color={dot_quote(colour)}",
                      f"fontcolor={dot_quote(colour)}"]
        else:
            attrs_ = ['style="dashed"', f"color={dot_quote(NEVER_COLOUR)}", 'fontcolor="#808080"']
        edges.append(f"  {dot_quote(source)} -> {dot_quote(dest)} [label={dot_quote(label)}, {', '.join(attrs_)}];")
    occupancy = ("mean objects in the state over the run (darker: more)" if heat.occupancy_known
                 else "times an object entered the state (darker: more)")
    rows = [
        (f'<FONT COLOR="{EDGE_RAMP[-1]}"><B>&#8212;&#8212; fired N</B></FONT>',
         f"line width and colour grow with the fire count (most: {top_edge})"),
        (f'<FONT COLOR="{NEVER_COLOUR}">- - - never fired</FONT>', "no run took this transition"),
        (f'<FONT COLOR="{RAMP[-2]}"><B>&#9608;</B></FONT> node fill', occupancy),
        ("entered, mean, peak", "entries; objects in the state on average and at most"
         if heat.occupancy_known else "entries (this trace does not name objects)"),
    ]
    if any("in_flight" in s.tags for s in spec.states):
        rows.append(("dashed border", "in-flight state: a copy is running"))
    return dot_document(spec, nodes, edges, legend_node(_title(heat), rows))


def heat_svg(spec: Spec, heat: Heat, timeout: float = DOT_TIMEOUT_S) -> str:
    return svg_from_dot(heat_dot(spec, heat), f"heat map of {spec.name}", timeout)


# --------------------------------------------------------------------------- mermaid


def heat_mermaid(spec: Spec, heat: Heat) -> str:
    """A mermaid ``stateDiagram-v2`` with counts in every label and states filled by heat."""
    ids = mermaid_ids(spec)
    lines = ["stateDiagram-v2", f"    %% {mermaid_text(_title(heat))}"]
    for st in spec.states:
        if ids[st.name] != st.name:
            lines.append(f'    state "{st.name}" as {ids[st.name]}')
    for st in spec.states:
        lines.append(f"    {ids[st.name]} : {mermaid_text(state_summary(heat.states[st.name]))}")
    lines.append(f"    [*] --> {ids[spec.initial]}")
    for (source, trigger, dest), labels in spec_edges(spec).items():
        text = mermaid_text(" or ".join(labels) + " - " + fired_text(heat.fired[(source, trigger, dest)]))
        lines.append(f"    {ids[source]} --> {ids[dest]} : {text}")
    for st in spec.states:
        if st.terminal:
            lines.append(f"    {ids[st.name]} --> [*]")
    top = max((_state_value(heat, s) for s in spec.state_names), default=0)
    levels: dict[int, list[str]] = {}
    for st in spec.states:
        levels.setdefault(int(_fraction(_state_value(heat, st.name), top) * (len(RAMP) - 1) + 0.5), []).append(
            ids[st.name])
    for level in sorted(levels):
        colour = "white" if level > 3 else "black"
        lines.append(f"    classDef heat{level} fill:{RAMP[level]},color:{colour}")
        lines.append(f"    class {','.join(levels[level])} heat{level}")
    in_flight = [ids[s.name] for s in spec.states if "in_flight" in s.tags]
    if in_flight:
        lines.append("    classDef in_flight stroke-dasharray: 5 5")
        lines.append(f"    class {','.join(in_flight)} in_flight")
    return "\n".join(lines) + "\n"


HEAT_RENDERERS = {"mermaid": heat_mermaid, "dot": heat_dot, "svg": heat_svg}


def render_heat(spec: Spec, heat: Heat, fmt: str) -> str:
    try:
        renderer = HEAT_RENDERERS[fmt]
    except KeyError:
        raise DiagramError(f"unknown diagram format {fmt!r}; known: {', '.join(HEAT_RENDERERS)}") from None
    return renderer(spec, heat)
