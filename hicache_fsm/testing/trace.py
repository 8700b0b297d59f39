"""Record a cache's events as JSONL and check that a recording is a valid run of the specs.

Recording: ``TraceRecorder(cache)`` registers an observer (``cache.add_observer``)
and keeps one JSON object per line: a header, then every ``transition``
(machine, object, trigger, source, dest), ``job`` (id, kind, nodes),
``completion`` (job, ok), ``split`` (node, new upper half) and ``removed``
event, each with a sequence number. ``TraceRecorder(cache, path)`` also
writes the lines as they happen.

Replay: ``replay(trace)`` re-checks the recording against the specs alone,
without the cache:

- the trace is one recording: its header first and only there, and each
  event's ``seq``, where it has one, is its position (the recorder numbers
  every event from the header's 0), so a moved, repeated or lost line shows;
- every transition is legal: the object is known (or a new object leaving the
  spec's initial state), its recorded state equals the transition's source,
  and the spec has that (trigger, source -> dest);
- every acknowledgement transition (``write_done``, ``load_failed``, ...) is
  justified by a pending job of the matching kind covering that object
  (nodes split off while a job was in flight are enrolled in it); a CP
  write's per-layer copies (jobs with a ``layer``) justify its one ack once
  they have landed;
- job ids are never reused and are of one JSON type (so are each machine's
  object ids); a job's kind is one the cache emits (``d2h``, ``h2d``, ``h2s``,
  ``s2h``); a completion names a pending job (a second completion of the same
  job is a divergence) and agrees with the acks its nodes went through before
  it: when ``ok``, every live node went through the matching ``*_done``
  transition and none through ``*_failed``; when not, none through ``*_done``;
- a removed node is in a terminal state and never appears again;
- with ``require_quiescent``, no job is left pending and no node is left in a
  copy-in-flight state at the end.

The first violation is reported as a ``Divergence``: the 1-based line, the
event, what was expected, and the few events before it. An empty trace is a
divergence too: it shows nothing was recorded, not that a run was valid.
A trace file must be a regular file (a FIFO or device is refused, never
read) no larger than ``diagram --counts`` reads (1 GiB); a line that is not
JSON, nests deeper than 32 levels or holds a number too long to read is a
``ValueError`` naming its line.
"""

from __future__ import annotations

import io
import json
import sys
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import IO

import attrs

from hicache_fsm.config import check_positive_int
from hicache_fsm.errors import ConfigError
from hicache_fsm.event_trace import MAX_TRACE_BYTES
from hicache_fsm.input_limits import (
    MAX_JSON_DEPTH, InputRefused, check_json_depth, open_regular_text, undecodable_line,
)
from hicache_fsm.jobs import JOB_KIND_NAMES
from hicache_fsm.output_files import open_output_text, write_output_text
from hicache_fsm.spec import Spec, load_builtin

__all__ = ["TRACE_VERSION", "Divergence", "ReplayResult", "TraceRecorder", "load_trace", "record", "replay"]

TRACE_VERSION = 1

# ack trigger -> job kind that justifies it
ACK_KIND = {
    "write_done": "d2h", "write_failed": "d2h",
    "load_done": "h2d", "load_failed": "h2d",
    "store_done": "h2s", "store_failed": "h2s",
}
DONE_TRIGGERS = {"d2h": "write_done", "h2d": "load_done", "h2s": "store_done"}
FAILED_TRIGGERS = {"d2h": "write_failed", "h2d": "load_failed", "h2s": "store_failed"}
# job kind -> residency states that wait for such a job
WAITING = {
    "d2h": {"writing_host"},
    "h2d": {"loading", "loading_storing", "loading_stored"},
    "h2s": {"device_host_storing", "host_storing", "loading_storing"},
}


HEADER_FIELDS = ("seq", "event", "version", "machines")  # the recorder's own: ``meta`` cannot replace them


class TraceRecorder:
    """Collect (and optionally write) a cache's events as JSONL, until ``close`` (or the end of a ``with``)."""

    def __init__(self, cache, out: str | Path | IO[str] | None = None, *, meta: dict | None = None) -> None:
        header = {"event": "header", "version": TRACE_VERSION, "machines": ["residency"]}
        clash = sorted(set(meta or {}) & set(HEADER_FIELDS))
        if clash:  # a recording whose header says another event or version could not be replayed
            raise ConfigError(f"meta cannot set the header's own fields {', '.join(clash)}")
        try:
            json.dumps(meta or {})
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"meta must be JSON: {exc}") from None
        header.update(meta or {})
        self.events: list[dict] = []
        self._seq = 0
        self._file: IO[str] | None = None
        self._owns_file = False
        if isinstance(out, (str, Path)):
            self._file = open_output_text(out)  # closed by close()
            self._owns_file = True
        elif out is not None:
            self._file = out
        self._cache = cache
        try:
            cache.add_observer(self._add)
        except BaseException:
            self._cache = None
            self.close()
            raise
        self._add(header)

    def __enter__(self) -> "TraceRecorder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add(self, event: dict) -> None:
        rec = {"seq": self._seq, **event}
        self._seq += 1
        self.events.append(rec)
        if self._file is not None:
            self._file.write(json.dumps(rec, sort_keys=True) + "\n")
            self._file.flush()

    def lines(self) -> list[str]:
        return [json.dumps(e, sort_keys=True) for e in self.events]

    def text(self) -> str:
        return "".join(line + "\n" for line in self.lines())

    def dump(self, path: str | Path) -> None:
        write_output_text(path, self.text())

    def close(self) -> None:
        """Stop recording (the cache no longer calls the recorder) and close a file it opened; idempotent."""
        if self._cache is not None:
            self._cache.remove_observer(self._add)
            self._cache = None
        if self._owns_file and self._file is not None:
            self._file.close()
        self._file = None


def record(cache, out: str | Path | IO[str] | None = None, **meta) -> TraceRecorder:
    """Start recording ``cache``'s events (see ``TraceRecorder``)."""
    return TraceRecorder(cache, out, meta=meta or None)


def load_trace(source: str | Path | IO[str] | Iterable[str] | Iterable[dict]) -> list[dict]:
    """Events from a JSONL file / path / text lines / already-parsed dicts.

    A ``Path``, or a one-line string that is not a JSON object, names a file:
    a missing one raises ``FileNotFoundError`` (not a parse error about its name);
    one that is not a regular file, or is larger than ``MAX_TRACE_BYTES``, a ``ValueError``.
    """
    if isinstance(source, Path) or (isinstance(source, str) and "\n" not in source
                                    and source.strip() and not source.lstrip().startswith("{")):
        try:
            with open_regular_text(source, MAX_TRACE_BYTES) as f:  # a leading byte-order mark is skipped
                return _parse(f)
        except InputRefused as exc:  # a FIFO would block, /dev/zero would fill memory
            raise ValueError(f"trace {source}: {exc}") from None
        except UnicodeDecodeError as exc:
            bad = undecodable_line(source)
            if bad is None:
                raise ValueError(f"trace: not UTF-8 text: {exc.reason}") from None
            raise ValueError(f"trace line {bad[0]}: not UTF-8 text (byte 0x{bad[1]:02x}; a binary file?)") from None
    if isinstance(source, str):
        return _parse(io.StringIO(source))
    if hasattr(source, "read"):
        return _parse(source)  # type: ignore[arg-type]
    items = list(source)
    if items and isinstance(items[0], dict):
        return [dict(e) for e in items]
    return _parse(items)


def _parse(lines: Iterable[str]) -> list[dict]:
    out = []
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        ev = _decode(line, n)
        if not isinstance(ev, dict) or "event" not in ev:
            raise ValueError(f"trace line {n}: not an event object")
        ev["_line"] = n
        out.append(ev)
    return out


def _decode(line: str, n: int) -> object:
    """Line ``n``'s JSON, or a ``ValueError`` naming the line (json's RecursionError and digit limit do not)."""
    try:
        if line.count("[") + line.count("{") > MAX_JSON_DEPTH:  # fewer openers cannot nest deeper
            check_json_depth(line)
        return json.loads(line)
    except InputRefused as exc:
        raise ValueError(f"trace line {n}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"trace line {n}: not JSON: {exc}") from None
    except ValueError:  # json.loads refuses an integer longer than Python converts
        raise ValueError(f"trace line {n}: a number longer than {sys.get_int_max_str_digits()} digits") from None


@attrs.frozen
class Divergence:
    index: int  # 0-based position in the events
    line: int  # 1-based line in the file
    event: dict
    reason: str
    context: tuple[dict, ...] = ()

    def format(self) -> str:
        clean = {k: v for k, v in self.event.items() if k != "_line"}
        lines = [f"line {self.line}: {self.reason}", f"  event: {json.dumps(clean, sort_keys=True)}"]
        if self.context:
            lines.append("  after:")
            for e in self.context:
                c = {k: v for k, v in e.items() if k != "_line"}
                lines.append(f"    line {e.get('_line', '?')}: {json.dumps(c, sort_keys=True)}")
        return "\n".join(lines)


@attrs.define
class ReplayResult:
    events: int = 0
    transitions: int = 0
    jobs: int = 0
    completions: int = 0
    objects: int = 0
    pending_jobs: list[int] = attrs.Factory(list)
    divergence: Divergence | None = None

    @property
    def ok(self) -> bool:
        return self.divergence is None

    def to_json(self) -> dict:
        out = {"ok": self.ok, "events": self.events, "transitions": self.transitions, "jobs": self.jobs,
               "completions": self.completions, "objects": self.objects, "pending_jobs": self.pending_jobs}
        if self.divergence is not None:
            d = self.divergence
            out["divergence"] = {"line": d.line, "index": d.index, "reason": d.reason,
                                 "event": {k: v for k, v in d.event.items() if k != "_line"}}
        return out


class _Diverged(Exception):
    def __init__(self, reason: str) -> None:
        self.reason = reason


# What each event type must carry, checked before the event is replayed (a trace is untrusted input):
# field -> (the JSON types it may have, whether it must be there). Ids are ints or strings.
_ID = (int, str)
_SHAPES: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    "transition": {"machine": ((str,), False), "trigger": ((str,), True), "source": ((str,), True),
                   "dest": ((str,), True)},
    "job": {"job": (_ID, True), "kind": ((str,), True), "nodes": ((list,), False)},
    "completion": {"job": (_ID, True), "ok": ((bool,), False)},
    "split": {"node": (_ID, True), "upper": (_ID, True)},
    "removed": {"node": (_ID, True)},
}
_JSON_NAMES = {bool: "true or false", int: "an integer", str: "a string", list: "a list"}


def _check_shape(ev: dict) -> None:
    """``_Diverged`` naming the first field of ``ev`` that is missing or of the wrong JSON type."""
    kind = ev.get("event")
    for field, (types, required) in _SHAPES.get(kind, {}).items():
        if field not in ev:
            if required:
                raise _Diverged(f"{kind} event without {field!r}")
            continue
        _check_type(kind, field, ev[field], types)
    if kind == "transition":
        field = "node" if "node" in ev else "object"
        if field not in ev:
            raise _Diverged("transition event without 'node' or 'object'")
        _check_type(kind, field, ev[field], _ID)
    for n in ev.get("nodes", ()) if kind == "job" else ():
        _check_type(kind, "nodes", n, _ID)


def _check_order(index: int, ev: dict) -> None:
    """``_Diverged`` unless ``ev`` sits where the recorder puts it: the header first and only there, ``seq`` its index.

    The recorder numbers every event from the header's 0, so a line moved, repeated or
    lost shows; ``seq`` may be left out (a hand-written trace), never wrong.
    """
    kind = ev.get("event")
    if not isinstance(kind, str):
        raise _Diverged(f"'event' must be a string, got {json.dumps(kind)}")
    if index == 0 and kind != "header":
        raise _Diverged(f"the trace starts with a {kind!r} event, not with its header")
    if index > 0 and kind == "header":
        raise _Diverged("a second header: a trace is one recording (fuzz and check --record files hold many runs, "
                        "for diagram --counts)")
    seq = ev.get("seq", index)
    if isinstance(seq, bool) or not isinstance(seq, int):
        raise _Diverged(f"'seq' must be an integer, got {json.dumps(seq)}")
    if seq != index:
        raise _Diverged(f"seq {seq} where {index} was due: the recorder numbers events 0, 1, 2, ... "
                        "(a line moved, repeated or lost?)")


def _check_type(kind: str, field: str, value: object, types: tuple[type, ...]) -> None:
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        want = " or ".join(_JSON_NAMES[t] for t in types)
        raise _Diverged(f"{kind} event: {field!r} must be {want}, got {json.dumps(value)}")


@attrs.define
class _Job:
    kind: str
    nodes: set
    acked: dict = attrs.Factory(dict)  # node -> the ack trigger it went through for this job
    layer: bool = False  # a CP per-layer copy: its write is acked once, after every layer landed


class _Replayer:
    def __init__(self, specs: dict[str, Spec] | None) -> None:
        self.specs = dict(specs or {})
        self.state: dict[tuple[str, object], str] = {}
        self.removed: set[tuple[str, object]] = set()
        self.jobs: dict[int, _Job] = {}
        self.finished: dict[int, bool] = {}
        self.landed: dict[int, _Job] = {}  # completed CP layer jobs whose write was not acked yet
        self.id_types: dict[str, type] = {}  # "job" / a machine -> the JSON type of its ids
        self.result = ReplayResult()

    def spec(self, machine: str) -> Spec:
        if machine not in self.specs:
            try:
                self.specs[machine] = load_builtin(machine)
            except Exception as exc:  # noqa: BLE001
                raise _Diverged(f"unknown machine {machine!r}: {exc}") from None
        return self.specs[machine]

    def check_id(self, space: str, ident: object, what: str) -> None:
        """Ids of one space share a JSON type: 1 and "1" would be two jobs (or nodes) and cannot be ordered."""
        first = self.id_types.setdefault(space, type(ident))
        if type(ident) is not first:
            raise _Diverged(f"{what} {json.dumps(ident)} is {_JSON_NAMES[type(ident)]}, but the trace's first {what} "
                            f"was {_JSON_NAMES[first]}: one trace names them all alike")

    def node_state(self, node) -> str:
        key = ("residency", node)
        if key in self.removed:
            raise _Diverged(f"node {node} was removed earlier")
        if key not in self.state:
            raise _Diverged(f"node {node} never appeared in the trace")
        return self.state[key]

    # ------------------------------------------------------------------ events

    def on_header(self, ev: dict) -> None:
        version = ev.get("version")
        if type(version) is not int or version != TRACE_VERSION:  # true and 1.0 equal 1 in Python, not in JSON
            raise _Diverged(f"trace version {version!r}, this replayer reads {TRACE_VERSION}")

    def on_transition(self, ev: dict) -> None:
        machine = ev.get("machine", "residency")
        spec = self.spec(machine)
        obj = ev.get("node", ev.get("object"))
        key = (machine, obj)
        trigger, source, dest = ev.get("trigger"), ev.get("source"), ev.get("dest")
        if key in self.removed:
            raise _Diverged(f"{machine} object {obj} fired {trigger!r} after it was removed")
        current = self.state.get(key)
        if current is None:
            if source != spec.initial:
                raise _Diverged(f"{machine} object {obj} appears in state {source!r}; a new object starts in "
                                f"{spec.initial!r}")
            self.check_id(machine, obj, f"{machine} object id")
            current = spec.initial
            self.result.objects += 1
        if current != source:
            raise _Diverged(f"{machine} object {obj} is in {current!r}, the event says it left {source!r}")
        allowed = [t.dest for t in spec.transitions_from(source, trigger)]
        if not allowed:
            legal = sorted({t.trigger for t in spec.transitions if source in t.sources})
            raise _Diverged(f"{machine}: {trigger!r} is not a transition from {source!r} (legal: {', '.join(legal)})")
        if dest not in allowed:
            raise _Diverged(f"{machine}: {source!r} --{trigger}--> goes to {', '.join(allowed)}, not {dest!r}")
        kind = ACK_KIND.get(trigger) if machine == "residency" else None
        if kind is not None:
            self.ack(obj, trigger, kind)
        self.state[key] = dest
        self.result.transitions += 1

    def ack(self, node, trigger: str, kind: str) -> None:
        """Record ``trigger`` on the pending ``kind`` job covering ``node``, for its completion to agree with."""
        covering = [j for j, job in self.jobs.items()
                    if job.kind == kind and node in job.nodes and node not in job.acked]
        if covering:
            self.jobs[covering[0]].acked[node] = trigger
            return
        layers = [j for j, job in self.landed.items() if job.kind == kind and node in job.nodes]
        if not layers:  # a CP write is acked once for all its landed layer copies
            raise _Diverged(f"{trigger!r} on node {node} without a pending {kind} job covering it")
        for j in layers:
            self.landed[j].acked[node] = trigger
            if self.landed[j].nodes <= self.landed[j].acked.keys() | self.gone():
                del self.landed[j]

    def on_job(self, ev: dict) -> None:
        job_id = ev.get("job")
        if job_id in self.jobs or job_id in self.finished:
            raise _Diverged(f"job id {job_id} was used before")
        self.check_id("job", job_id, "job id")
        if ev["kind"] not in JOB_KIND_NAMES:
            raise _Diverged(f"job {job_id} of unknown kind {ev['kind']!r} (kinds: {', '.join(sorted(JOB_KIND_NAMES))})")
        nodes = set(ev.get("nodes", ()))
        for n in nodes:
            self.node_state(n)
        self.jobs[job_id] = _Job(ev.get("kind"), nodes, layer=ev.get("layer") is not None)
        self.result.jobs += 1

    def on_completion(self, ev: dict) -> None:
        job_id = ev.get("job")
        if job_id in self.finished:
            raise _Diverged(f"job {job_id} completed a second time")
        job = self.jobs.pop(job_id, None)
        if job is None:
            raise _Diverged(f"completion of job {job_id}, which was never emitted")
        ok = ev.get("ok") is True
        self.finished[job_id] = ok
        if job.layer:  # the CP write's ack comes once every layer landed
            self.landed[job_id] = job
        elif job.kind in DONE_TRIGGERS:
            self.check_acks(job_id, job, ok)
        self.result.completions += 1

    def check_acks(self, job_id, job: _Job, ok: bool) -> None:
        """The cache acks a job's nodes before reporting its completion: ``ok`` must say what those acks said."""
        done = DONE_TRIGGERS[job.kind]
        wrong = sorted(n for n, trigger in job.acked.items() if (trigger == done) != ok)
        if wrong:
            raise _Diverged(f"job {job_id} ({job.kind}) completed with ok={json.dumps(ok)} but nodes {wrong} went "
                            f"through {FAILED_TRIGGERS[job.kind] if ok else done!r}")
        if ok:
            live = {n for n in job.nodes if ("residency", n) not in self.removed and ("residency", n) in self.state}
            missing = sorted(live - job.acked.keys())
            if missing:
                raise _Diverged(f"job {job_id} ({job.kind}) completed but nodes {missing} never went through "
                                f"{done!r}")

    def on_split(self, ev: dict) -> None:
        node, upper = ev.get("node"), ev.get("upper")
        state = self.node_state(node)
        if ("residency", upper) in self.state or ("residency", upper) in self.removed:
            raise _Diverged(f"split created node {upper}, an id already used")
        self.check_id("residency", upper, "residency object id")
        self.state[("residency", upper)] = state
        self.result.objects += 1
        for job in [*self.jobs.values(), *self.landed.values()]:
            if node in job.nodes:
                job.nodes.add(upper)
                if node in job.acked:
                    job.acked[upper] = job.acked[node]

    def gone(self) -> set:
        return {o for (m, o) in self.removed if m == "residency"}

    def on_removed(self, ev: dict) -> None:
        node = ev.get("node")
        state = self.node_state(node)
        spec = self.spec("residency")
        if not spec.state(state).terminal:
            raise _Diverged(f"node {node} left the tree in state {state!r}, which is not terminal")
        self.removed.add(("residency", node))
        del self.state[("residency", node)]

    def finish(self, require_quiescent: bool) -> None:
        self.result.pending_jobs = sorted(self.jobs)
        if require_quiescent:
            if self.jobs:
                raise _Diverged(f"the trace ends with jobs still pending: {sorted(self.jobs)}")
            busy = sorted(o for (m, o), s in self.state.items()
                          if m == "residency" and any(s in w for w in WAITING.values()))
            if busy:
                raise _Diverged(f"the trace ends with nodes {busy} waiting for copies")


def replay(trace, specs: Iterable[Spec] | None = None, *, require_quiescent: bool = False,
           context: int = 4) -> ReplayResult:
    """Check a recorded trace against the specs; ``result.divergence`` names the first problem.

    ``specs``: the machines to check against (default: the library's own; one ``Spec`` alone is fine).
    """
    check_positive_int("context", context, minimum=0)
    if not isinstance(require_quiescent, bool):
        raise ConfigError(f"require_quiescent must be True or False, got {require_quiescent!r}")
    if isinstance(specs, Spec):
        specs = (specs,)
    elif specs is not None:
        specs = tuple(specs) if not isinstance(specs, (str, bytes)) else (specs,)
        if not all(isinstance(spec, Spec) for spec in specs):
            raise ConfigError("specs must be Spec objects (load_builtin(name), load_spec(path)), not names or paths")
    events = load_trace(trace)
    r = _Replayer({s.name: s for s in specs} if specs is not None else None)
    if not events:  # nothing was recorded: no run to call valid
        r.result.divergence = Divergence(0, 1, {}, "the trace is empty: a recording starts with its header")
        return r.result
    recent: deque[dict] = deque(maxlen=context)
    handlers = {"header": r.on_header, "transition": r.on_transition, "job": r.on_job,
                "completion": r.on_completion, "split": r.on_split, "removed": r.on_removed}
    for i, ev in enumerate(events):
        r.result.events += 1
        try:
            _check_order(i, ev)
            handler = handlers.get(ev["event"])
            if handler is None:
                raise _Diverged(f"unknown event type {ev.get('event')!r}")
            _check_shape(ev)
            handler(ev)
        except _Diverged as d:
            r.result.divergence = Divergence(i, ev.get("_line", i + 1), ev, d.reason, tuple(recent))
            return r.result
        recent.append(ev)
    try:
        r.finish(require_quiescent)
    except _Diverged as d:
        last = events[-1] if events else {}
        r.result.divergence = Divergence(len(events) - 1, last.get("_line", len(events)), last, d.reason, tuple(recent))
    return r.result
