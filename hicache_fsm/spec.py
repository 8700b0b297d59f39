"""Load and validate state-machine specs written as YAML data.

A spec is untrusted input: it is parsed with PyYAML's safe loader, its strings
are only ever compared against names registered in ``hicache_fsm.registry``,
and nothing in it is imported or evaluated. Every problem is reported as a
``SpecError`` naming the file and the line; a spec that fails validation
builds nothing.
"""

from __future__ import annotations

import bisect
import difflib
import functools
import importlib.resources
import os
import re
from collections import Counter, deque
from pathlib import Path
from typing import Any, Iterable

import attrs
import yaml

from hicache_fsm.errors import SpecError
from hicache_fsm.events.names import parse_event
from hicache_fsm.jobs import JOB_KIND_NAMES
from hicache_fsm.registry import MachineRegistry, registry_for

# The library's own specs ship inside the package (``hicache_fsm/specs/*.yaml``; the
# repository's top-level ``specs/`` links there). Wheels install as plain files, so the
# resource is a real directory.
SPEC_DIR = Path(importlib.resources.files("hicache_fsm") / "specs").resolve()

NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
PLAIN_COLLECTIONS = {"tag:yaml.org,2002:map", "tag:yaml.org,2002:seq"}
# Trigger names become attributes of models in ``transitions``; these would clash.
RESERVED_TRIGGERS = frozenset({"trigger", "state", "machine", "to_state", "may_trigger"})
RESERVED_PREFIXES = ("to_", "may_", "is_", "on_enter", "on_exit", "_")
KNOWN_TAGS = frozenset(
    {"terminal", "in_flight", "on_device", "on_host", "stored", "holds_slots", "host_reserved", "device_reserved"}
)

TOP_KEYS = {"name": str, "doc": str, "initial": str, "states": dict, "transitions": list, "invariants": list}
STATE_KEYS = {"doc": str, "tags": list}
TRANSITION_KEYS = {
    "trigger": str,
    "source": (str, list),
    "dest": str,
    "guards": list,
    "unless": list,
    "effects": list,
    "emits": list,
    "events": list,
    "doc": str,
}
REQUIRED_TOP = ("name", "initial", "states", "transitions")
REQUIRED_TRANSITION = ("trigger", "source", "dest")


@attrs.frozen
class StateSpec:
    name: str
    doc: str = ""
    tags: frozenset[str] = frozenset()
    line: int | None = None

    @property
    def terminal(self) -> bool:
        return "terminal" in self.tags


@attrs.frozen
class TransitionSpec:
    trigger: str
    sources: tuple[str, ...]
    dest: str
    guards: tuple[str, ...] = ()
    unless: tuple[str, ...] = ()
    effects: tuple[str, ...] = ()
    emits: tuple[str, ...] = ()
    doc: str = ""
    line: int | None = None
    events: tuple[str, ...] = ()  # KV events for routers, "stored:device" etc. (hicache_fsm.events.names)


@attrs.frozen
class Spec:
    """A validated state machine: states, transitions, invariants, all by name."""

    name: str
    doc: str
    initial: str
    states: tuple[StateSpec, ...]
    transitions: tuple[TransitionSpec, ...]
    invariants: tuple[str, ...]
    path: str = ""

    @property
    def state_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.states)

    @property
    def triggers(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t.trigger for t in self.transitions))

    def state(self, name: str) -> StateSpec:
        for s in self.states:
            if s.name == name:
                return s
        raise KeyError(name)

    def guard_names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(g for t in self.transitions for g in (*t.guards, *t.unless)))

    def effect_names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(e for t in self.transitions for e in t.effects))

    def transitions_from(self, state: str, trigger: str) -> tuple[TransitionSpec, ...]:
        return tuple(t for t in self.transitions if t.trigger == trigger and state in t.sources)


# --------------------------------------------------------------------------- YAML with lines


class _Lined(dict):
    """A mapping that remembers the line of itself and of each key (1-based)."""

    line: int
    key_lines: dict[str, int]


class _LinedList(list):
    line: int
    item_lines: list[int]


# Bounds on untrusted spec text, checked before anything is built from it. The
# library's own specs are under 8 KB, 700 YAML events and 6 levels deep; these
# limits leave plenty of room while keeping the worst input under a second.
MAX_SPEC_BYTES = 256 * 1024
MAX_EVENTS = 20_000  # scalars, collection starts/ends and aliases, as the parser reports them
MAX_DEPTH = 32  # nested mappings/lists, counting what aliases expand to
MAX_NODES = 50_000  # nodes after alias expansion (stops "billion laughs")
MAX_PROBLEMS = 100  # validation stops collecting (and raises) after this many problems
MAX_TRANSITIONS_PER_KEY = 32  # transitions sharing one (state, trigger): checked pairwise

# libyaml when present (PyYAML ships it): the bounded pre-scan then costs milliseconds.
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
# What YAML allows in a stream (PyYAML's reader refuses the rest, without a line).
_NON_PRINTABLE = re.compile("[^\x09\x0A\x0D\x20-\x7E\x85\xA0-\uD7FF\uE000-\uFFFD\U00010000-\U0010FFFF]")


# The line breaks of a file as editors count them. YAML 1.1 (PyYAML's marks) also breaks lines at U+0085,
# U+2028 and U+2029, which a quoted scalar may hold: counted as breaks, every later line would be off.
_BREAK = re.compile(r"\r\n?|\n")


class _LineIndex:
    """1-based line of a character index of one text, counting only ``\\n``, ``\\r\\n`` and ``\\r``."""

    def __init__(self, text: str) -> None:
        self.starts = [m.end() for m in _BREAK.finditer(text)]  # where each line after the first begins

    def at(self, index: int) -> int:
        return bisect.bisect_right(self.starts, index) + 1

    def of(self, mark: yaml.Mark) -> int:
        """The line of a YAML mark, from its character index (its ``line`` counts YAML's breaks)."""
        return self.at(mark.index)


def _decode(data: bytes, path: str) -> str:
    """Spec bytes as text: bounded in size, UTF-8, the bad byte's line named."""
    if len(data) > MAX_SPEC_BYTES:
        raise SpecError(path, None, f"spec file is larger than {MAX_SPEC_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        before = data[: exc.start].decode("utf-8")
        line = _LineIndex(before).at(len(before))
        raise SpecError(path, line, f"cannot read spec: not UTF-8 (byte 0x{data[exc.start]:02x})") from None


def _check_text(text: object, path: str) -> str:
    if not isinstance(text, str):
        raise SpecError(path, None, f"spec text must be a str, got {type(text).__name__}")
    if len(text) > MAX_SPEC_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
        raise SpecError(path, None, f"spec is larger than {MAX_SPEC_BYTES} bytes")
    bad = _NON_PRINTABLE.search(text)
    if bad is not None:
        raise SpecError(path, _LineIndex(text).at(bad.start()), f"character {bad.group()!r} is not allowed in YAML (binary data?)")
    return text


def _syntax_error(exc: yaml.YAMLError, path: str, lines: _LineIndex) -> SpecError:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    line = lines.of(mark) if mark is not None else None
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and context_mark is not None and context_mark is not mark:
        problem += f" ({context} started at line {lines.of(context_mark)})"
    return SpecError(path, line, f"YAML syntax error: {problem}")


def _prescan(text: str, path: str, lines: _LineIndex) -> None:
    """Walk the parser's events (no tree is built) and stop at the first bound crossed."""
    events = depth = 0
    try:
        for event in yaml.parse(text, Loader=_Loader):
            events += 1
            if events > MAX_EVENTS:
                raise SpecError(path, lines.of(event.start_mark), f"spec too large: more than {MAX_EVENTS} YAML events")
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_DEPTH:
                    raise SpecError(path, lines.of(event.start_mark), f"spec nested deeper than {MAX_DEPTH} levels")
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
    except yaml.YAMLError as exc:
        raise _syntax_error(exc, path, lines) from None


def _compose(text: str, path: str) -> Any:
    # without its byte-order mark: libyaml's marks skip it, the pure-Python parser's count it
    text = _check_text(text, path).removeprefix("\ufeff")
    lines = _LineIndex(text)
    _prescan(text, path, lines)
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
    except yaml.YAMLError as exc:
        raise _syntax_error(exc, path, lines) from None
    finally:
        loader.dispose()
    if node is None:
        raise SpecError(path, 1, "empty spec file")
    return _convert(node, loader, path, lines)


def _convert(node: yaml.Node, loader: yaml.SafeLoader, path: str, lines: _LineIndex, _walk: dict | None = None) -> Any:
    # ``_walk`` holds the nodes on the current path (a recursive alias would loop
    # forever) and a count of nodes visited (aliases may repeat a node many times).
    walk = _walk if _walk is not None else {"path": set(), "count": 0}
    line = lines.of(node.start_mark)
    walk["count"] += 1
    if walk["count"] > MAX_NODES:
        raise SpecError(path, line, f"spec too large: more than {MAX_NODES} YAML nodes (alias expansion?)")
    if id(node) in walk["path"]:
        raise SpecError(path, line, "recursive YAML alias: a node contains itself")
    if len(walk["path"]) >= MAX_DEPTH and isinstance(node, yaml.CollectionNode):
        raise SpecError(path, line, f"spec nested deeper than {MAX_DEPTH} levels (through aliases)")
    if isinstance(node, yaml.CollectionNode) and node.tag not in PLAIN_COLLECTIONS:
        # a scalar's unknown tag fails construction below; a collection's would be dropped unseen
        raise SpecError(path, line, f"tag {node.tag!r} is not allowed: a spec holds plain mappings and lists")
    if isinstance(node, yaml.MappingNode):
        walk["path"].add(id(node))
        out = _Lined()
        out.line, out.key_lines = line, {}
        for key_node, value_node in node.value:
            key = _convert(key_node, loader, path, lines, walk)
            key_line = lines.of(key_node.start_mark)
            if not isinstance(key, str):
                raise SpecError(path, key_line, f"keys must be strings, got {key!r}")
            if key in out:
                raise SpecError(path, key_line, f"duplicate key {key!r} (first at line {out.key_lines[key]})")
            out[key] = _convert(value_node, loader, path, lines, walk)
            out.key_lines[key] = key_line
        walk["path"].discard(id(node))
        return out
    if isinstance(node, yaml.SequenceNode):
        walk["path"].add(id(node))
        seq = _LinedList(_convert(item, loader, path, lines, walk) for item in node.value)
        seq.line, seq.item_lines = line, [lines.of(item.start_mark) for item in node.value]
        walk["path"].discard(id(node))
        return seq
    try:
        return loader.construct_object(node, deep=True)
    except yaml.YAMLError as exc:
        if node.tag == "tag:yaml.org,2002:merge":
            raise SpecError(path, line, "merge keys (<<) are not allowed in specs: write the fields out") from None
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError(path, line, f"bad scalar: {problem}") from None
    except (ValueError, OverflowError) as exc:  # an int past Python's digit limit, a date like 2001-02-30
        kind = str(node.tag).rsplit(":", 1)[-1]
        reason = str(exc).split(";")[0].splitlines()[0] if str(exc) else type(exc).__name__
        raise SpecError(path, line, f"bad {kind} scalar: {reason}") from None


def _kind(value: Any) -> str:
    """A plain-words type name for messages (never the loader's private classes)."""
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "nothing (null)"
    return type(value).__name__


# --------------------------------------------------------------------------- validation


class _Problems:
    """Collects every problem so ``validate`` can print them all; the first one is raised."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.items: list[tuple[int | None, str]] = []
        self.dropped = False  # a state or transition is missing or names an unknown state: reachability would mislead

    def add(self, line: int | None, message: str) -> None:
        self.items.append((line, message))
        if len(self.items) >= MAX_PROBLEMS:  # enough to act on; validating further costs time for nothing
            self.raise_if_any()

    def raise_if_any(self) -> None:
        if self.items:
            line, message = self.items[0]
            err = SpecError(self.path, line, message)
            err.problems = [SpecError(self.path, ln, msg) for ln, msg in self.items]
            raise err


def _type_name(t: type | tuple[type, ...]) -> str:
    types = t if isinstance(t, tuple) else (t,)
    names = {str: "a string", list: "a list", dict: "a mapping"}
    return " or ".join(names.get(x, x.__name__) for x in types)


def _check_keys(obj: _Lined, allowed: dict[str, Any], what: str, problems: _Problems) -> bool:
    """Report unknown keys and wrongly typed values; False when a value has the wrong type (unusable)."""
    ok = True
    for key, value in obj.items():
        line = obj.key_lines.get(key, obj.line)
        if key not in allowed:
            close = difflib.get_close_matches(key, list(allowed), n=1, cutoff=0.7)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.add(line, f"unknown key {key!r} in {what}{hint}; allowed: {', '.join(sorted(allowed))}")
        elif not isinstance(value, allowed[key]):
            problems.add(line, f"{what} key {key!r} must be {_type_name(allowed[key])}, got {_kind(value)}")
            ok = False
    return ok


def _line_of(obj: Any, default: int | None) -> int | None:
    return getattr(obj, "line", default)


def _str_list(value: Any, what: str, line: int | None, problems: _Problems) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else list(value)
    lines = getattr(value, "item_lines", [line] * len(items))
    out = []
    for item, ln in zip(items, lines):
        if not isinstance(item, str):
            problems.add(ln, f"{what} entries must be strings, got {_kind(item)}")
        else:
            out.append(item)
    return tuple(out)


# What each list of a state or transition holds, in the message for an entry listed twice
_ENTRY_NOUNS = {"tags": "a tag", "source": "a source state", "guards": "a guard", "unless": "a guard under 'unless'",
                "effects": "an effect", "emits": "a job kind", "events": "an event"}


def _check_listed_once(owner: str, lists: dict[str, tuple[str, ...]], line: int | None, problems: _Problems) -> None:
    """Report an entry listed twice: a second emit would emit a second job, a second effect run twice, and
    a set (tags) would drop it unseen, so a repeat is a mistake in every list."""
    for key, items in lists.items():
        twice = [name for name, n in Counter(items).items() if n > 1]
        if twice:
            problems.add(line, f"{owner} lists {_ENTRY_NOUNS[key]} twice: {', '.join(map(repr, twice))}")


def _check_name(name: str, what: str, line: int | None, problems: _Problems) -> None:
    if not NAME_RE.fullmatch(name):  # fullmatch: "$" alone also matches before a final newline
        problems.add(line, f"{what} name {name!r} must match {NAME_RE.pattern}")


def parse_spec(text: str, path: str | os.PathLike[str] = "<string>", registry: MachineRegistry | None = None, *,
               require_bindings: bool | None = None) -> Spec:
    """Parse and validate spec text; raise ``SpecError`` (file:line) on any problem.

    Guards, effects and invariants are checked against Python bindings when
    ``registry`` is given, when the machine is one of the library's own, or
    when ``require_bindings`` is True (an unknown machine then has none); a
    user's spec can be validated and drawn without any. ``require_bindings=False``
    skips the check even for the library's machines. Running a machine always
    needs its bindings (``compile_machine`` checks them again). ``path`` names the text in messages: a str or
    ``os.PathLike``, as ``load_spec`` takes; anything else, or a ``registry`` that is not a ``MachineRegistry``,
    is a ``SpecError`` (not an AttributeError deep inside).
    """
    path = _path_name(path)
    if registry is not None and not isinstance(registry, MachineRegistry):
        raise SpecError(path, None, f"registry must be a MachineRegistry or None, got {type(registry).__name__}")
    raw = _compose(text, path)
    problems = _Problems(path)
    if not isinstance(raw, _Lined):
        raise SpecError(path, _line_of(raw, 1), "a spec must be a mapping at the top level")
    if not _check_keys(raw, TOP_KEYS, "spec", problems):
        problems.raise_if_any()
    for key in REQUIRED_TOP:
        if key not in raw:
            problems.add(raw.line, f"missing required key {key!r}")
    problems.raise_if_any()

    name = raw["name"]
    _check_name(name, "machine", raw.key_lines["name"], problems)
    states = _parse_states(raw["states"], problems)
    transitions = _parse_transitions(raw["transitions"], problems)
    invariants = _str_list(raw.get("invariants", []), "invariants", raw.key_lines.get("invariants"), problems)
    for inv in invariants:
        _check_name(inv, "invariant", raw.key_lines.get("invariants"), problems)
    # no raise here: the graph, bindings and job kinds of what did parse are checked too (one pass)

    spec = Spec(
        name=name,
        doc=str(raw.get("doc", "")).strip(),
        initial=raw["initial"],
        states=states,
        transitions=transitions,
        invariants=invariants,
        path=path,
    )
    _check_graph(spec, raw.key_lines["initial"], problems)
    if registry is None and require_bindings is not False:
        registry = registry_for(spec.name)
    if require_bindings or (require_bindings is None and registry is not None):
        _check_bindings(spec, registry, raw, problems)
    _check_job_kinds(spec, problems)
    _check_events(spec, problems)
    problems.raise_if_any()
    return spec


def _parse_states(raw: _Lined, problems: _Problems) -> tuple[StateSpec, ...]:
    out = []
    if not raw:
        problems.add(raw.line, "a spec needs at least one state")
    for name, body in raw.items():
        line = raw.key_lines[name]
        _check_name(name, "state", line, problems)
        if body is None:
            body = _Lined()
            body.line, body.key_lines = line, {}
        if not isinstance(body, _Lined):
            problems.add(line, f"state {name!r} must be a mapping (doc, tags), got {_kind(body)}")
            problems.dropped = True
            continue
        if not _check_keys(body, STATE_KEYS, f"state {name!r}", problems):
            problems.dropped = True
            continue
        tags = _str_list(body.get("tags", []), "tags", body.key_lines.get("tags"), problems)
        _check_listed_once(f"state {name!r}", {"tags": tags}, body.key_lines.get("tags", line), problems)
        for tag in tags:
            if tag not in KNOWN_TAGS:
                problems.add(body.key_lines.get("tags", line), f"state {name!r}: unknown tag {tag!r}; known: {', '.join(sorted(KNOWN_TAGS))}")
        out.append(StateSpec(name, str(body.get("doc", "")).strip(), frozenset(tags), line))
    return tuple(out)


def _parse_transitions(raw: _LinedList, problems: _Problems) -> tuple[TransitionSpec, ...]:
    out = []
    for item, line in zip(raw, raw.item_lines):
        if not isinstance(item, _Lined):
            problems.add(line, f"each transition must be a mapping, got {_kind(item)}")
            problems.dropped = True
            continue
        if not _check_keys(item, TRANSITION_KEYS, "transition", problems):
            problems.dropped = True
            continue
        missing = [k for k in REQUIRED_TRANSITION if k not in item]
        if missing:
            problems.add(item.line, f"transition is missing {', '.join(missing)}")
            problems.dropped = True
            continue
        trigger = item["trigger"]
        tline = item.key_lines["trigger"]
        _check_name(trigger, "trigger", tline, problems)
        if trigger in RESERVED_TRIGGERS or trigger.startswith(RESERVED_PREFIXES):
            problems.add(tline, f"trigger name {trigger!r} is reserved (it would clash with machine attributes)")
        lists = {
            key: _str_list(item.get(key, []), key, item.key_lines.get(key, item.line), problems)
            for key in ("source", "guards", "unless", "effects", "emits", "events")
        }
        _check_listed_once(f"transition {trigger!r}", lists, item.line, problems)
        for key, what in (("guards", "guard"), ("unless", "guard"), ("effects", "effect")):
            for name in lists[key]:  # a binding's name, never a dotted path: nothing is imported by name
                _check_name(name, what, item.key_lines.get(key, item.line), problems)
        out.append(
            TransitionSpec(
                trigger=trigger,
                sources=lists["source"],
                dest=item["dest"],
                guards=lists["guards"],
                unless=lists["unless"],
                effects=lists["effects"],
                emits=lists["emits"],
                events=lists["events"],
                doc=str(item.get("doc", "")).strip(),
                line=item.line,
            )
        )
    return tuple(out)


def _check_graph(spec: Spec, initial_line: int | None, problems: _Problems) -> None:
    terminal = {st.name for st in spec.states if st.terminal}
    names = set(spec.state_names)
    if spec.initial not in names:
        problems.add(initial_line, f"initial state {spec.initial!r} is not a declared state")
    for t in spec.transitions:
        if not t.sources:
            problems.add(t.line, f"transition {t.trigger!r} has no source state")
        for s in t.sources:
            if s not in names:
                problems.add(t.line, f"transition {t.trigger!r} comes from unknown state {s!r}")
                problems.dropped = True
        if t.dest not in names:
            problems.add(t.line, f"transition {t.trigger!r} goes to unknown state {t.dest!r}")
            problems.dropped = True
        if set(t.guards) & set(t.unless):
            problems.add(t.line, f"transition {t.trigger!r} both requires and forbids {sorted(set(t.guards) & set(t.unless))}")
        for s in t.sources:
            if s in terminal:
                problems.add(t.line, f"transition {t.trigger!r} leaves terminal state {s!r}")
    _check_ambiguity(spec, problems)
    if not problems.dropped and spec.initial in names:  # a misspelt state would make others "unreachable"
        _check_reachability(spec, problems)


def _check_ambiguity(spec: Spec, problems: _Problems) -> None:
    seen: dict[tuple[str, str, frozenset[str], frozenset[str]], TransitionSpec] = {}
    for t in spec.transitions:
        for s in dict.fromkeys(t.sources):  # a source listed twice is reported once, by _check_graph
            key = (s, t.trigger, frozenset(t.guards), frozenset(t.unless))
            first = seen.get(key)
            if first is not None:
                problems.add(
                    t.line,
                    f"transitions on ({s!r}, {t.trigger!r}) at lines {first.line} and {t.line} "
                    "have the same guards: no guard tells them apart",
                )
            else:
                seen[key] = t
    # Guards that can hold at once also make a pair ambiguous unless one forbids what the other needs.
    by_key: dict[tuple[str, str], list[TransitionSpec]] = {}
    for t in spec.transitions:
        for s in dict.fromkeys(t.sources):
            by_key.setdefault((s, t.trigger), []).append(t)
    for (s, trig), group in by_key.items():
        if len(group) > MAX_TRANSITIONS_PER_KEY:
            problems.add(group[MAX_TRANSITIONS_PER_KEY].line,
                         f"more than {MAX_TRANSITIONS_PER_KEY} transitions on ({s!r}, {trig!r})")
            continue
        for i, a in enumerate(group):
            for b in group[i + 1 :]:
                exclusive = set(a.guards) & set(b.unless) or set(a.unless) & set(b.guards)
                same = frozenset(a.guards) == frozenset(b.guards) and frozenset(a.unless) == frozenset(b.unless)
                if not exclusive and not same:
                    problems.add(
                        b.line,
                        f"transitions on ({s!r}, {trig!r}) at lines {a.line} and {b.line} can both be enabled: "
                        "make their guards exclusive (one needs a guard the other lists under 'unless')",
                    )


def _check_reachability(spec: Spec, problems: _Problems) -> None:
    dests: dict[str, set[str]] = {}  # state -> where its transitions go (one pass: linear in the spec)
    for t in spec.transitions:
        for s in t.sources:
            dests.setdefault(s, set()).add(t.dest)
    reached = {spec.initial}
    queue = deque([spec.initial])
    while queue:
        for dest in dests.get(queue.popleft(), ()):
            if dest not in reached:
                reached.add(dest)
                queue.append(dest)
    for st in spec.states:
        if st.name not in reached:
            problems.add(st.line, f"state {st.name!r} is unreachable from the initial state {spec.initial!r}")
        if not st.terminal and not dests.get(st.name, set()) - {st.name}:
            problems.add(st.line, f"state {st.name!r} is not terminal but has no way out (tag it terminal or add a transition)")


def _check_bindings(spec: Spec, registry: MachineRegistry | None, raw: _Lined, problems: _Problems) -> None:
    for t in spec.transitions:
        for g in (*t.guards, *t.unless):
            if registry is None or g not in registry.guards:
                problems.add(t.line, f"guard {g!r} has no registered implementation for machine {spec.name!r}")
        for e in t.effects:
            if registry is None or e not in registry.effects:
                problems.add(t.line, f"effect {e!r} has no registered implementation for machine {spec.name!r}")
    inv_line = raw.key_lines.get("invariants")
    for inv in spec.invariants:
        if registry is None or inv not in registry.invariants:
            problems.add(inv_line, f"invariant {inv!r} has no registered check for machine {spec.name!r}")


def _check_job_kinds(spec: Spec, problems: _Problems) -> None:
    for t in spec.transitions:
        for j in t.emits:
            if j not in JOB_KIND_NAMES:
                problems.add(t.line, f"job kind {j!r} is unknown; known: {', '.join(sorted(JOB_KIND_NAMES))}")


def _check_events(spec: Spec, problems: _Problems) -> None:
    """Every ``events:`` entry is KIND:TIER with a known kind and tier (listed once: ``_check_listed_once``)."""
    for t in spec.transitions:
        for entry in t.events:
            try:
                parse_event(entry)
            except ValueError as exc:
                problems.add(t.line, f"transition {t.trigger!r}: {exc}")


def _path_name(path: object) -> str:
    """``path`` as a str; SpecError for what pathlib refuses (not a str or str os.PathLike, or a NUL inside)."""
    name = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    if not isinstance(name, str):  # None, a number, bytes (or a PathLike of bytes): pathlib takes str only
        raise SpecError(repr(path)[:80], None, f"a spec path must be a str or os.PathLike, got {type(path).__name__}")
    if "\0" in name:
        raise SpecError(repr(name)[:80], None, "a spec path cannot contain a NUL character")
    return name


def _spec_path(path: object) -> Path:
    """``path`` as a Path (``_path_name``'s checks)."""
    return Path(_path_name(path))


def load_spec(path: str | Path, registry: MachineRegistry | None = None, *,
              require_bindings: bool | None = None) -> Spec:
    """Read, parse and validate one spec file (bindings as in ``parse_spec``)."""
    path = _spec_path(path)
    try:
        if path.exists() and not path.is_file():  # a directory, FIFO or device would block or never end
            raise SpecError(str(path), None, "cannot read spec: not a regular file")
        with path.open("rb") as f:
            data = f.read(MAX_SPEC_BYTES + 1)  # never more than the limit, whatever the file is
    except OSError as exc:
        raise SpecError(str(path), None, f"cannot read spec: {exc.strerror or exc}") from None
    return parse_spec(_decode(data, str(path)), str(path), registry, require_bindings=require_bindings)


def spec_paths(directory: str | Path = SPEC_DIR) -> list[Path]:
    return sorted(Path(directory).glob("*.yaml"))


_MACHINE_NAME = re.compile(r"[A-Za-z0-9_]+")  # the library's spec files are NAME.yaml


def load_builtin(name: str) -> Spec:
    """Load one of the library's own specs by machine name.

    Specs are immutable, so a parsed spec is reused until its file changes:
    every ``HiCache`` compiles its machines from these and parsing YAML
    dominates building one.
    """
    path = SPEC_DIR / f"{name}.yaml" if isinstance(name, str) and _MACHINE_NAME.fullmatch(name) else None
    if path is None or not path.is_file():  # a bare name only: a trace's "../x" never leaves the specs
        known = ", ".join(p.stem for p in spec_paths())
        raise SpecError(str(SPEC_DIR), None, f"no spec named {name!r}; known: {known}")
    stat = path.stat()
    return _load_cached(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=32)
def _load_cached(path: str, mtime_ns: int, size: int) -> Spec:
    return load_spec(path)


def load_all(paths: Iterable[str | Path] | None = None) -> list[Spec]:
    """Every spec of ``paths`` (default: the library's own); one path is refused, not read letter by letter."""
    if isinstance(paths, (str, bytes, os.PathLike)):
        raise SpecError(os.fsdecode(paths), None, "load_all takes a list of spec paths: spec_paths(DIR) lists a "
                                                  "directory's, load_spec(PATH) reads one file")
    if paths is not None and not isinstance(paths, Iterable):
        raise SpecError(repr(paths)[:80], None, "load_all takes a list of spec paths, or None for the library's own; "
                                                f"got {type(paths).__name__}")
    return [load_spec(p) for p in (paths if paths is not None else spec_paths())]
