"""Diagrams of specs: mermaid and Graphviz dot text, and SVG through Graphviz.

Everything here is derived from a validated ``Spec``; nothing is drawn by hand.
Edge labels read ``trigger [guard, not other] / job, job``: guards a transition
needs, ``not g`` for each guard it lists under ``unless``, then the job kinds it
emits. Mermaid and dot text are pure functions of the spec (stable output, so
generated docs can be checked for drift); only ``to_svg`` runs a program
(Graphviz's ``dot``) and it raises ``DiagramError`` when that is missing.
"""

from __future__ import annotations

import re
import shutil
import subprocess

from hicache_fsm.commands.args import printable
from hicache_fsm.errors import DiagramError
from hicache_fsm.spec import Spec, StateSpec, TransitionSpec

INSTALL_HINT = (
    "Graphviz's `dot` program is needed to render SVG but was not found on PATH; "
    "install Graphviz (Debian/Ubuntu: `apt-get install graphviz`, macOS: `brew install graphviz`) "
    "or use --format mermaid / --format dot, which need nothing extra"
)
DOT_TIMEOUT_S = 30.0
DESCRIPTION_CHARS = 60
# Graphviz refuses a quoted string past 16384 bytes: text capped here stays under it even with every
# character escaped (7 bytes at most, ``\\u202e``) or 4 bytes of UTF-8.
TOOLTIP_CHARS = 1024

# Words the mermaid state-diagram lexer (case-insensitively) reads as keywords
# when they open a statement; a state so named is drawn under a safe id
# (``state "note" as s_note``) and keeps its name as the displayed label.
_MERMAID_KEYWORDS = frozenset(
    {"state", "note", "class", "classdef", "scale", "direction", "hide", "acctitle", "accdescr", "end", "as",
     "statediagram", "style", "click"}
)


def edge_label(t: TransitionSpec) -> str:
    """``trigger [g1, not g2] / d2h (+host)`` for one transition: guards, jobs, KV events."""
    label = t.trigger
    conditions = [*t.guards, *(f"not {u}" for u in t.unless)]
    if conditions:
        label += f" [{', '.join(conditions)}]"
    if t.emits:
        label += f" / {', '.join(t.emits)}"
    if t.events:  # "+device" for stored:device, "-host" for removed:host (a colon would break Mermaid labels)
        label += f" ({', '.join(('+' if e.startswith('stored') else '-') + e.partition(':')[2] for e in t.events)})"
    return label


def short_doc(text: str, limit: int = DESCRIPTION_CHARS) -> str:
    """A doc's first sentence on one line; its first clause if that is too long; cut at a word to ``limit``."""
    text = " ".join(text.split())
    if not text:
        return ""
    first = re.split(r"(?<=[.!?])\s", text, maxsplit=1)[0].rstrip(".")
    if len(first) > limit:
        first = first.split("; ", 1)[0].rstrip(".;")
    if len(first) > limit:
        cut = first[: limit - 3]
        if " " in cut:
            cut = cut[: cut.rindex(" ")]
        first = cut.rstrip(" ,;-") + "..."
    return first


def capped(text: str, limit: int = TOOLTIP_CHARS) -> str:
    """``text`` on one line, cut at a word to ``limit`` characters (a doc of any length is a valid spec)."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[: limit - 3]
    if " " in cut:
        cut = cut[: cut.rindex(" ")]
    return cut + "..."


# --------------------------------------------------------------------------- mermaid


def mermaid_ids(spec: Spec) -> dict[str, str]:
    """State name -> mermaid id; names the lexer would misread get an ``s_`` prefix."""
    names = set(spec.state_names)
    ids = {}
    for name in spec.state_names:
        ident = name
        if name in _MERMAID_KEYWORDS or name.startswith("default"):
            ident = f"s_{name}"
            while ident in names:
                ident = f"s_{ident}"
        ids[name] = ident
    return ids


def mermaid_text(text: str) -> str:
    """Text safe after ``:`` on a mermaid line.

    The lexer ends a description at ``:``, ``;`` or a newline, treats ``%%`` as
    a comment and ``direction XX`` anywhere as a statement; quotes, ``#``, angle
    brackets and braces are replaced too, for the renderers' sake; control characters and bidirectional
    overrides are escaped (``printable``), as everywhere spec text is shown.
    """
    text = printable(" ".join(text.split()))
    text = text.replace(":", " -").replace(";", ",").replace("#", "no.").replace("%", " pct")
    text = text.replace('"', "'").replace("{", "(").replace("}", ")").replace("<", "(").replace(">", ")")
    text = re.sub(r"(?i)\bdirection\b", "heading", text)
    return " ".join(text.split())


def to_mermaid(spec: Spec) -> str:
    """A mermaid ``stateDiagram-v2`` of the spec (ends with a newline).

    ``[*] --> initial``; one ``a --> b : label`` line per (source, transition);
    ``t --> [*]`` for each terminal state; each state's short doc as its
    description; in-flight states drawn dashed.
    """
    ids = mermaid_ids(spec)
    lines = ["stateDiagram-v2"]
    for st in spec.states:
        if ids[st.name] != st.name:
            lines.append(f'    state "{st.name}" as {ids[st.name]}')
    for st in spec.states:
        desc = mermaid_text(short_doc(st.doc))
        if desc:
            lines.append(f"    {ids[st.name]} : {desc}")
    lines.append(f"    [*] --> {ids[spec.initial]}")
    for t in spec.transitions:
        label = mermaid_text(edge_label(t))
        for source in t.sources:
            lines.append(f"    {ids[source]} --> {ids[t.dest]} : {label}")
    for st in spec.states:
        if st.terminal:
            lines.append(f"    {ids[st.name]} --> [*]")
    in_flight = [ids[s.name] for s in spec.states if "in_flight" in s.tags]
    if in_flight:
        lines.append("    classDef in_flight stroke-dasharray: 5 5")
        lines.append(f"    class {','.join(in_flight)} in_flight")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- dot

# Colour of the edges that emit each job kind, and what the legend says the kind is.
JOB_COLOURS = {"d2h": "#1f6fb4", "h2d": "#23922f", "h2s": "#d9730d", "s2h": "#8e44ad"}
JOB_MEANING = {
    "d2h": "device to host copy",
    "h2d": "host to device load",
    "h2s": "host to storage backup",
    "s2h": "storage to host fetch",
}
IN_FLIGHT_FILL = "#fff1c2"
FONT = "Helvetica"


def dot_quote(text: str) -> str:
    """``text`` as a double-quoted dot string, control characters and bidirectional overrides escaped (``printable``)."""
    return '"' + printable(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def html_escape(text: str) -> str:
    """Text safe inside a Graphviz HTML-like label."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def state_style(st: StateSpec) -> list[str]:
    """Dot attributes every drawing of a state shares: dashed amber when in flight, a double border when terminal."""
    styles = ["rounded"]
    attrs = []
    if "in_flight" in st.tags:
        styles += ["dashed", "filled"]
        attrs.append(f"fillcolor={dot_quote(IN_FLIGHT_FILL)}")
    attrs.insert(0, f"style={dot_quote(','.join(styles))}")
    if st.terminal:
        attrs.append("peripheries=2")
    if st.doc:
        attrs.append(f"tooltip={dot_quote(capped(st.doc))}")
    return attrs


def job_colour(emits: tuple[str, ...]) -> str:
    """One colour per emitted job kind; Graphviz draws ``a:b`` as parallel lines."""
    return ":".join(JOB_COLOURS.get(j, "black") for j in emits)


def legend_rows(spec: Spec) -> list[tuple[str, str]]:
    """(sample, meaning) rows, as HTML-label cells, for what this spec's drawing uses."""
    rows = [("<I>trigger [guard, not g] / job</I>", "edge label: guards that must hold, then the jobs it emits")]
    if any("in_flight" in s.tags for s in spec.states):
        rows.append(('<FONT COLOR="#8a6d00">dashed, amber</FONT>', "in-flight state: a copy is running"))
    if any(s.terminal for s in spec.states):
        rows.append(("double border", "terminal state"))
    if any(t.events for t in spec.transitions):
        rows.append(("<I>(+tier, -tier)</I>",
                     "KV events: stored:tier (now readable there) / removed:tier (no longer readable)"))
    used = dict.fromkeys(j for t in spec.transitions for j in t.emits)
    for kind in used:
        colour = JOB_COLOURS.get(kind, "black")
        rows.append((f'<FONT COLOR="{colour}"><B>&#8212;&#8212; / {html_escape(kind)}</B></FONT>',
                     f"emits a {html_escape(kind)} job ({JOB_MEANING.get(kind, kind)})"))
    return rows


def legend_node(title: str, rows: list[tuple[str, str]]) -> list[str]:
    """A plaintext node holding an HTML table, kept at the far end of the drawing."""
    cells = "".join(f'<TR><TD ALIGN="LEFT">{a}</TD><TD ALIGN="LEFT">{b}</TD></TR>' for a, b in rows)
    table = (f'<TABLE BORDER="1" CELLBORDER="0" CELLSPACING="0" CELLPADDING="3" COLOR="#999999">'
             f'<TR><TD COLSPAN="2" ALIGN="LEFT"><B>{html_escape(title)}</B></TD></TR>{cells}</TABLE>')
    return [
        f'  "__legend__" [shape=plaintext, fontsize=9, label=<{table}>];',
        '  { rank=sink; "__legend__"; }',
    ]


def dot_document(spec: Spec, nodes: list[str], edges: list[str], legend: list[str]) -> str:
    """The digraph around prepared node and edge lines: start point, layout and fonts shared by every drawing."""
    lines = [
        f"digraph {dot_quote(spec.name)} {{",
        "  rankdir=TB;",
        f'  node [shape=box, fontname="{FONT}", fontsize=11];',
        f'  edge [fontname="{FONT}", fontsize=9];',
        '  "__start__" [shape=point, width=0.15, label=""];',
        *nodes,
        f'  "__start__" -> {dot_quote(spec.initial)};',
        *edges,
        *legend,
        "}",
    ]
    return "\n".join(lines) + "\n"


def to_dot(spec: Spec) -> str:
    """A Graphviz ``digraph`` of the spec (ends with a newline), with a legend.

    In-flight states are dashed and amber; an edge that emits jobs is drawn
    bold in its job kind's colour (one parallel line per kind).
    """
    nodes = [f"  {dot_quote(st.name)} [{', '.join(state_style(st))}];" for st in spec.states]
    edges = []
    for t in spec.transitions:
        attrs = [f"label={dot_quote(capped(edge_label(t)))}"]
        if t.emits:
            colour = job_colour(t.emits)
            attrs += [f"color={dot_quote(colour)}", f"fontcolor={dot_quote(colour.split(':')[0])}", "penwidth=2"]
        if t.doc:
            attrs.append(f"tooltip={dot_quote(capped(t.doc))}")
        for source in t.sources:
            edges.append(f"  {dot_quote(source)} -> {dot_quote(t.dest)} [{', '.join(attrs)}];")
    return dot_document(spec, nodes, edges, legend_node("Legend", legend_rows(spec)))


# --------------------------------------------------------------------------- svg

# Comments Graphviz writes that name its version or restate the title: dropped so that
# the same dot text gives the same SVG bytes wherever this Graphviz version runs.
_GRAPHVIZ_COMMENTS = re.compile(r"<!-- (?:Generated by graphviz[^>]*|Title: .*? Pages: \d+) -->\n")


def svg_from_dot(dot_text: str, what: str = "diagram", timeout: float = DOT_TIMEOUT_S) -> str:
    """Render dot text to SVG with Graphviz's ``dot -Tsvg``, without its version comments.

    Raises ``DiagramError`` when ``dot`` is missing (with how to install it),
    fails, or takes longer than ``timeout`` seconds.
    """
    exe = shutil.which("dot")
    if exe is None:
        raise DiagramError(INSTALL_HINT)
    try:
        proc = subprocess.run(
            [exe, "-Tsvg"],
            input=dot_text,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise DiagramError(f"Graphviz `dot` took longer than {timeout:g}s to draw {what!r}") from None
    except OSError as exc:
        raise DiagramError(f"could not run Graphviz `dot`: {exc}; {INSTALL_HINT}") from None
    if proc.returncode != 0:
        detail = proc.stderr.strip() or f"exit status {proc.returncode}"
        raise DiagramError(f"Graphviz `dot` failed on {what!r}: {detail}")
    return _GRAPHVIZ_COMMENTS.sub("", proc.stdout)


def to_svg(spec: Spec, timeout: float = DOT_TIMEOUT_S) -> str:
    """The spec's dot drawing rendered to SVG by Graphviz (see ``svg_from_dot``)."""
    return svg_from_dot(to_dot(spec), spec.name, timeout)


RENDERERS = {"mermaid": to_mermaid, "dot": to_dot, "svg": to_svg}


def render(spec: Spec, fmt: str) -> str:
    """The diagram of ``spec`` in ``fmt`` (mermaid, dot or svg)."""
    if not isinstance(spec, Spec):
        raise DiagramError(f"render draws a Spec (load_builtin(name), load_spec(path)), got {type(spec).__name__}")
    try:
        renderer = RENDERERS[fmt]
    except KeyError:
        raise DiagramError(f"unknown diagram format {fmt!r}; known: {', '.join(RENDERERS)}") from None
    return renderer(spec)
