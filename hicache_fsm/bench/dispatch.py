"""Dispatch cost: the compiled table vs `transitions`' own trigger vs a bare dict, same run.

One guarded, job-emitting transition cycle (``start``: guard ``has_room``, emits
``d2h``; then ``finish`` back) is driven over N objects three ways, timed
round-robin so machine noise hits all three alike:

* ``compiled``: ``CompiledMachine.fire(obj, trigger)``, the library's hot path;
  the emitted job kinds are read off the returned transition.
* ``transitions``: ``model.start()`` / ``model.finish()`` on N ``ReferenceModel``
  objects added to one ``transitions.Machine`` built by ``reference_machine``
  (guards as conditions, jobs recorded by an ``after`` callback).
* ``dict``: ``obj.state = table[trigger][obj.state]``, a bare (trigger, state)
  lookup and an attribute store: the floor any table dispatch pays, with no
  guard, no effects and no error path.

Why a small spec written here rather than ``residency``: the figure should be
the cost of dispatch alone. A private two-state spec (parsed with
``parse_spec`` from the text below, bound to a private ``MachineRegistry`` that
is never added to the library's registries) fixes exactly one guard, one emit
and no effects, so neither the bindings of a real machine nor their data
structures enter the measurement, and the benchmark keeps working whatever
the real specs become. Figures are median nanoseconds per transition.
"""

from __future__ import annotations

import argparse

from hicache_fsm.bench.common import interleaved_medians, machine_description, report
from hicache_fsm.machine import CompiledMachine, ReferenceModel, reference_machine
from hicache_fsm.registry import MachineRegistry
from hicache_fsm.spec import Spec, parse_spec

BENCH_SPEC = """\
name: bench_dispatch
doc: A two-state cycle with one guarded, job-emitting transition.
initial: idle
states:
  idle:
    doc: Nothing in flight.
  busy:
    doc: A device-to-host copy in flight.
    tags: [in_flight]
transitions:
  - trigger: start
    source: idle
    dest: busy
    guards: [has_room]
    emits: [d2h]
    doc: Start a copy when there is room.
  - trigger: finish
    source: busy
    dest: idle
    doc: The copy landed.
"""

TRIGGERS = ("start", "finish")


def bench_registry() -> MachineRegistry:
    registry = MachineRegistry("bench_dispatch")

    @registry.guard
    def has_room(obj, ctx) -> bool:
        return True

    return registry


def bench_spec(registry: MachineRegistry | None = None) -> Spec:
    return parse_spec(BENCH_SPEC, "<bench_dispatch>", registry or bench_registry())


class _Obj:
    __slots__ = ("state",)

    def __init__(self, state: str) -> None:
        self.state = state


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--objects", type=int, default=10_000, help="objects driven through the cycle (default 10000)")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds of each variant (default 7)")


def measure(objects: int = 10_000, repeats: int = 7) -> dict:
    registry = bench_registry()
    spec = bench_spec(registry)
    compiled = CompiledMachine(spec, registry)
    objs = [_Obj(spec.initial) for _ in range(objects)]
    models = [ReferenceModel() for _ in range(objects)]
    reference_machine(spec, models, registry)
    table = {t.trigger: {s: t.dest for s in t.sources} for t in spec.transitions}

    def run_compiled() -> int:
        fire = compiled.fire
        jobs = 0
        for trigger in TRIGGERS:
            for o in objs:
                jobs += len(fire(o, trigger).emits)
        return jobs

    def run_transitions() -> int:
        for trigger in TRIGGERS:
            for m in models:
                getattr(m, trigger)()
        jobs = 0
        for m in models:
            jobs += len(m.emitted)
            m.emitted.clear()
        return jobs

    def run_dict() -> None:
        for trigger in TRIGGERS:
            for o in objs:
                o.state = table[trigger][o.state]

    # Correctness before timing: every variant completes the cycle once per object.
    assert run_compiled() == objects and all(o.state == "idle" for o in objs)
    assert run_transitions() == objects and all(m.state == "idle" for m in models)
    run_dict()
    assert all(o.state == "idle" for o in objs)

    secs = interleaved_medians(
        {"compiled": run_compiled, "transitions": run_transitions, "dict": run_dict}, repeats=repeats, warmup=1
    )
    per = objects * len(TRIGGERS)
    ns = {k: v / per * 1e9 for k, v in secs.items()}
    return {
        "benchmark": "dispatch",
        "objects": objects,
        "transitions_per_round": per,
        "compiled_ns": round(ns["compiled"], 1),
        "transitions_ns": round(ns["transitions"], 1),
        "dict_ns": round(ns["dict"], 1),
        "speedup_vs_transitions": round(ns["transitions"] / ns["compiled"], 2),
        "ratio_vs_dict": round(ns["compiled"] / ns["dict"], 2),
        "targets": {"speedup_vs_transitions_min": 8.0, "ratio_vs_dict_max": 5.0},
        "machine": machine_description(),
    }


def run(args: argparse.Namespace) -> dict:
    result = measure(args.objects, args.repeats)
    ok_speed = result["speedup_vs_transitions"] >= 8.0
    ok_ratio = result["ratio_vs_dict"] <= 5.0
    result["meets_targets"] = ok_speed and ok_ratio
    rows = [
        ("objects", str(result["objects"])),
        ("compiled fire", f"{result['compiled_ns']:.0f} ns/transition"),
        ("transitions trigger", f"{result['transitions_ns']:.0f} ns/transition"),
        ("bare dict + setattr", f"{result['dict_ns']:.0f} ns/transition"),
        ("speedup vs transitions", f"{result['speedup_vs_transitions']:.1f}x (target >= 8x{'' if ok_speed else ', MISSED'})"),
        ("ratio vs bare dict", f"{result['ratio_vs_dict']:.2f}x (target <= 5x{'' if ok_ratio else ', MISSED'})"),
    ]
    report("dispatch: one guarded, job-emitting cycle, timed interleaved", rows, result, args.json)
    return result
