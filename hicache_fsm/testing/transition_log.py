"""Write the transitions a fuzz or check run fires as a trace, for heat maps.

``fuzz`` and ``check`` drive many caches (one per example; forked states in
``check``), so their record is not a single run that ``replay`` could check:
it is every fired transition, each example starting a new run (a trace header).
``RecordingCoverage`` is a ``CoverageTracker`` (what both tools already attach
to every machine they drive) that also writes each transition it sees.

With ``objects=True`` (fuzz: each example is one linear run) events name their
object (``RUN:ID``) so a heat map can show occupancy; ``check`` forks states,
so the same node id lives on several branches and ``objects=False`` leaves
objects out (the heat map then shows entries only).
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path
from typing import IO

from hicache_fsm.output_files import open_output_text
from hicache_fsm.testing.paths import CoverageTracker
from hicache_fsm.testing.trace import TRACE_VERSION

__all__ = ["RecordingCoverage", "TraceWriter", "recording_writer"]


class TraceWriter:
    """Numbered JSONL trace events written to one file."""

    def __init__(self, out: str | Path) -> None:
        self._file: IO[str] = open_output_text(out)  # closed by close()
        self.seq = 0

    def write(self, event: dict) -> None:
        self._file.write(json.dumps({"seq": self.seq, **event}, sort_keys=True) + "\n")
        self.seq += 1

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def recording_writer(path: str | None) -> TraceWriter | None:
    """A writer for ``--record PATH``; None when no path was given."""
    return TraceWriter(path) if path else None


class RecordingCoverage(CoverageTracker):
    """Coverage that also writes every fired transition to a ``TraceWriter``."""

    def __init__(self, writer: TraceWriter, *, recorded_by: str, objects: bool, **meta: object) -> None:
        super().__init__()
        self.writer = writer
        self.objects = objects
        self.recorded_by = recorded_by
        self.meta = meta
        self._seen: weakref.WeakSet = weakref.WeakSet()
        self._listening: list[tuple[object, object]] = []
        self._runs = 0

    def attach(self, machine) -> None:
        super().attach(machine)
        if machine in self._seen:
            return
        self._seen.add(machine)
        if machine.name == "residency" or not self._runs:  # each example brings a new residency machine
            self._runs += 1
            self.writer.write({"event": "header", "version": TRACE_VERSION, "machines": sorted(self.specs),
                               "recorded_by": self.recorded_by, "linear": self.objects, **self.meta})
        run = self._runs
        name = machine.name
        write = self.writer.write
        objects = self.objects

        def listener(obj, transition) -> None:
            event = {"event": "transition", "machine": name, "trigger": transition.trigger,
                     "source": transition.source, "dest": transition.dest}
            if objects:
                ident = getattr(obj, "id", None)
                event["object"] = f"{run}:{id(obj) if ident is None else ident}"
            write(event)

        machine.add_listener(listener)
        self._listening.append((weakref.ref(machine), listener))

    def detach_all(self) -> None:
        super().detach_all()
        for ref, listener in self._listening:
            machine = ref()
            if machine is not None:
                try:
                    machine.remove_listener(listener)
                except ValueError:
                    pass
        self._listening.clear()
