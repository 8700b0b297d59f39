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

from hicache_fsm.errors import DiagramError
from hicache_fsm.spec import Spec, StateSpec, TransitionSpec

INSTALL_HINT = (
    "Graphviz's `dot` program is needed to render SVG but was not found on PATH; "
    "install Graphviz (Debian/Ubuntu: `apt-get install graphviz`, macOS: `brew install graphviz`) "
    "or use --format mermaid / --format dot, which need nothing extra"
)
DOT_TIMEOUT_S = 30.0
DESCRIPTION_CHARS = 60

# Words the mermaid state-diagram lexer (case-insensitively) reads as keywords
# when they open a statement; a state so named is drawn under a safe id
# (``state "note" as s_note``) and keeps its name as the displayed label.
_MERMAID_KEYWORDS = frozenset(
    {"state", "note", "class", "classdef", "scale", "direction", "hide", "acctitle", "accdescr", "end", "as",
     "statediagram", "style", "click"}
)


def edge_label(t: TransitionSpec) -> str:
    """``trigger [g1, not g2] / d2h`` for one transition."""
    label = t.trigger
    conditions = [*t.guards, *(f"not {u}" for u in t.unless)]
    if conditions:
        label += f" [{', '.join(conditions)}]"
    if t.emits:
        label += f" / {', '.join(t.emits)}"
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


# --------------------------------------------------------------------------- mermaid


def _mermaid_ids(spec: Spec) -> dict[str, str]:
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


def _mermaid_text(text: str) -> str:
    """Text safe after ``:`` on a mermaid line.

    The lexer ends a description at ``:``, ``;`` or a newline, treats ``%%`` as
    a comment and ``direction XX`` anywhere as a statement; quotes, ``#``, angle
    brackets and braces are replaced too, for the renderers' sake.
    """
    text = " ".join(text.split())
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
    ids = _mermaid_ids(spec)
    lines = ["stateDiagram-v2"]
    for st in spec.states:
        if ids[st.name] != st.name:
            lines.append(f'    state "{st.name}" as {ids[st.name]}')
    for st in spec.states:
        desc = _mermaid_text(short_doc(st.doc))
        if desc:
            lines.append(f"    {ids[st.name]} : {desc}")
    lines.append(f"    [*] --> {ids[spec.initial]}")
    for t in spec.transitions:
        label = _mermaid_text(edge_label(t))
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


def _dot_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ") + '"'


def _dot_node(st: StateSpec) -> str:
    attrs = []
    styles = ["rounded"]
    if "in_flight" in st.tags:
        styles.append("dashed")
    attrs.append(f"style={_dot_quote(','.join(styles))}")
    if st.terminal:
        attrs.append("peripheries=2")
    if st.doc:
        attrs.append(f"tooltip={_dot_quote(' '.join(st.doc.split()))}")
    return f"  {_dot_quote(st.name)} [{', '.join(attrs)}];"


def to_dot(spec: Spec) -> str:
    """A Graphviz ``digraph`` of the spec (ends with a newline)."""
    lines = [
        f"digraph {_dot_quote(spec.name)} {{",
        "  rankdir=LR;",
        '  node [shape=box, fontname="Helvetica", fontsize=11];',
        '  edge [fontname="Helvetica", fontsize=9];',
        '  "__start__" [shape=point, width=0.15, label=""];',
    ]
    for st in spec.states:
        lines.append(_dot_node(st))
    lines.append(f"  \"__start__\" -> {_dot_quote(spec.initial)};")
    for t in spec.transitions:
        attrs = [f"label={_dot_quote(edge_label(t))}"]
        if t.doc:
            attrs.append(f"tooltip={_dot_quote(' '.join(t.doc.split()))}")
        for source in t.sources:
            lines.append(f"  {_dot_quote(source)} -> {_dot_quote(t.dest)} [{', '.join(attrs)}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- svg


def dot_available() -> bool:
    return shutil.which("dot") is not None


def to_svg(spec: Spec, timeout: float = DOT_TIMEOUT_S) -> str:
    """Render the spec to SVG with Graphviz's ``dot -Tsvg``.

    Raises ``DiagramError`` when ``dot`` is missing (with how to install it),
    fails, or takes longer than ``timeout`` seconds.
    """
    exe = shutil.which("dot")
    if exe is None:
        raise DiagramError(INSTALL_HINT)
    try:
        proc = subprocess.run(
            [exe, "-Tsvg"],
            input=to_dot(spec),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise DiagramError(f"Graphviz `dot` took longer than {timeout:g}s to draw {spec.name!r}") from None
    except OSError as exc:
        raise DiagramError(f"could not run Graphviz `dot`: {exc}; {INSTALL_HINT}") from None
    if proc.returncode != 0:
        detail = proc.stderr.strip() or f"exit status {proc.returncode}"
        raise DiagramError(f"Graphviz `dot` failed on {spec.name!r}: {detail}")
    return proc.stdout


RENDERERS = {"mermaid": to_mermaid, "dot": to_dot, "svg": to_svg}


def render(spec: Spec, fmt: str) -> str:
    """The diagram of ``spec`` in ``fmt`` (mermaid, dot or svg)."""
    try:
        renderer = RENDERERS[fmt]
    except KeyError:
        raise DiagramError(f"unknown diagram format {fmt!r}; known: {', '.join(RENDERERS)}") from None
    return renderer(spec)
