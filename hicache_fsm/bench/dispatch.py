"""Dispatch cost: the compiled table vs `transitions`' own trigger vs a bare dict, same run.

One guarded, job-emitting transition cycle (``start``: guard ``has_room``, emits
``d2h``; then ``finish`` back) is driven over N objects three ways, timed
interleaved in one run so machine noise hits all three alike:

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
import gc
import statistics
import time
from typing import Callable

from hicache_fsm.bench.common import machine_description, report
from hicache_fsm.commands.args import check_fits, positive_int
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
CHUNK = 250  # objects per timed sample
OBJECT_BYTES = 4096  # an object of each variant, with its transitions model (measured 2.6 KB, with room)


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


def _timed_interleaved(
    variants: dict[str, Callable[[int], object]], sizes: list[int], repeats: int, inner: int = 3
) -> dict[str, float]:
    """Median seconds per transition of each variant, all timed in one interleaved sequence.

    ``variants[name](i)`` drives chunk ``i`` through the cycle, ``sizes[i]``
    transitions in all.

    A round drives every chunk of objects through the cycle with every variant:
    per chunk, ``transitions`` once, then ``compiled`` and ``dict`` alternately
    ``inner`` times. Timing chunks (short samples) rather than whole passes
    keeps the median honest on a busy machine: a scheduler preemption lands in
    a few samples of any variant, instead of in most samples of the slower
    one. The collector is paused while timing (as ``timeit`` does) so garbage
    made by one variant is not collected on another's clock.
    """
    samples: dict[str, list[float]] = {name: [] for name in variants}
    run_transitions, run_compiled, run_dict = variants["transitions"], variants["compiled"], variants["dict"]
    t_samples, c_samples, d_samples = samples["transitions"], samples["compiled"], samples["dict"]
    clock = time.perf_counter
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            for i, size in enumerate(sizes):
                start = clock()
                run_transitions(i)
                t_samples.append((clock() - start) / size)
                for _ in range(inner):
                    start = clock()
                    run_compiled(i)
                    c_samples.append((clock() - start) / size)
                    start = clock()
                    run_dict(i)
                    d_samples.append((clock() - start) / size)
    finally:
        if was_enabled:
            gc.enable()
    return {name: statistics.median(ts) for name, ts in samples.items()}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--objects", type=positive_int, default=10_000,
                        help=f"objects driven through the cycle, within what memory holds at {OBJECT_BYTES} bytes an "
                             "object (default 10000)")
    parser.add_argument("--repeats", type=positive_int, default=7, help="timed rounds over all objects (default 7)")
    parser.add_argument("--chunk", type=positive_int, default=CHUNK, help=f"objects per timed sample (default {CHUNK})")


def measure(objects: int = 10_000, repeats: int = 7, chunk: int = CHUNK) -> dict:
    registry = bench_registry()
    spec = bench_spec(registry)
    compiled = CompiledMachine(spec, registry)
    objs = [_Obj(spec.initial) for _ in range(objects)]
    models = [ReferenceModel() for _ in range(objects)]
    reference_machine(spec, models, registry)  # all N models on one machine
    table = {t.trigger: {s: t.dest for s in t.sources} for t in spec.transitions}
    chunk = max(1, min(chunk, objects))
    obj_chunks = [objs[i : i + chunk] for i in range(0, objects, chunk)]
    model_chunks = [models[i : i + chunk] for i in range(0, objects, chunk)]

    def run_compiled(i: int) -> int:
        fire = compiled.fire
        group = obj_chunks[i]
        jobs = 0
        for trigger in TRIGGERS:
            for o in group:
                jobs += len(fire(o, trigger).emits)
        return jobs

    def run_transitions(i: int) -> int:
        group = model_chunks[i]
        for trigger in TRIGGERS:
            for m in group:
                getattr(m, trigger)()
        jobs = 0
        for m in group:
            jobs += len(m.emitted)
            m.emitted.clear()
        return jobs

    def run_dict(i: int) -> None:
        group = obj_chunks[i]
        for trigger in TRIGGERS:
            for o in group:
                o.state = table[trigger][o.state]

    # Correctness before timing: every variant completes the cycle once per object.
    chunks = range(len(obj_chunks))
    jobs_compiled = sum(run_compiled(i) for i in chunks)
    jobs_transitions = sum(run_transitions(i) for i in chunks)
    for i in chunks:
        run_dict(i)
    states = {o.state for o in objs} | {m.state for m in models}
    if jobs_compiled != objects or jobs_transitions != objects or states != {spec.initial}:
        raise RuntimeError(f"bench cycle misbehaved: jobs {jobs_compiled}/{jobs_transitions}, end states {states}")

    variants = {"transitions": run_transitions, "compiled": run_compiled, "dict": run_dict}
    sizes = [len(group) * len(TRIGGERS) for group in obj_chunks]
    secs = _timed_interleaved(variants, sizes, repeats)
    ns = {k: v * 1e9 for k, v in secs.items()}
    return {
        "benchmark": "dispatch",
        "objects": objects,
        "chunk": len(obj_chunks[0]),
        "repeats": repeats,
        "compiled_ns": round(ns["compiled"], 1),
        "transitions_ns": round(ns["transitions"], 1),
        "dict_ns": round(ns["dict"], 1),
        "speedup_vs_transitions": round(ns["transitions"] / ns["compiled"], 2),
        "ratio_vs_dict": round(ns["compiled"] / ns["dict"], 2),
        "targets": {"speedup_vs_transitions_min": 8.0, "ratio_vs_dict_max": 5.0},
        "machine": machine_description(),
    }


def run(args: argparse.Namespace) -> dict:
    check_fits(args.objects, OBJECT_BYTES, "--objects", f"{OBJECT_BYTES} bytes an object")
    result = measure(args.objects, args.repeats, args.chunk)
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
