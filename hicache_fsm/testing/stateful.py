"""A hypothesis state machine that drives any prefix cache through a ``CacheAdapter``.

Like ``zarr.testing.stateful``, the machine ships inside the package so other
caches can run it: bind it to an adapter factory and get a machine class (or
a ``unittest.TestCase``)::

    from hicache_fsm.testing import CacheProtocolMachine
    TinyMachine = CacheProtocolMachine.bind(lambda: TinyLRUAdapter(capacity=4), name="TinyMachine")
    TestTiny = TinyMachine.TestCase          # collected by pytest / unittest

Rules are what an engine and its executors do: insert a prompt (or a next
turn of one), match, lock / unlock, pin / unpin the host copy, evict either
tier, load back, back up, complete or fail any pending job in any order,
re-deliver a finished job's acknowledgement, poll; storage rules (prefetch,
abort, storage faults) run only when the adapter supports them. After
**every** step the invariant catalogue (``checks.catalogue``) runs: the
adapter's invariants and KV read back from every valid copy of every prompt
seen so far. Each step's own contract is checked by ``checks.perform``.

``run_fuzz`` runs a machine outside pytest with a seed, a progress line and a
failing example turned into a runnable pytest test (``regression_test``).
"""

from __future__ import annotations

import io
import re
import sys
import time
from typing import Any, Callable, Sequence, TextIO

import attrs
from hypothesis import HealthCheck, Phase, Verbosity
from hypothesis import seed as hypothesis_seed
from hypothesis import settings as Settings
from hypothesis import strategies as st
from hypothesis.reporting import with_reporter
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    get_state_machine_test,
    initialize,
    invariant,
    precondition,
    rule,
)

from hicache_fsm.testing.adapter import CacheAdapter, StorageFault
from hicache_fsm.testing.checks import Step, catalogue, perform
from hicache_fsm.testing.paths import CoverageTracker
from hicache_fsm.testing.strategies import pages_to_tokens, prompt_pages, storage_faults

__all__ = ["CacheProtocolMachine", "hicache_machine", "HICACHE_VARIANTS", "FuzzResult", "run_fuzz", "regression_test"]

ALPHABET = 3
MAX_PAGES = 4


def _supports(op: str) -> Callable[[Any], bool]:
    return lambda self: self.adapter is not None and self.adapter.supports(op)


class CacheProtocolMachine(RuleBasedStateMachine):
    """Drive ``adapter_factory(**variant)`` with engine and executor steps; check everything after each.

    Class attributes (set by ``bind``): ``adapter_factory``, ``variants`` (a
    tuple of keyword dicts; the ``setup`` step draws one), ``coverage`` (a
    ``CoverageTracker`` fed by the adapter's compiled machines).
    """

    adapter_factory: Callable[..., CacheAdapter] | None = None
    variants: tuple[dict, ...] = ({},)
    coverage: CoverageTracker | None = None

    prompts = Bundle("prompts")

    def __init__(self) -> None:
        super().__init__()
        self.adapter: CacheAdapter | None = None
        self.seen: list[tuple[int, ...]] = []
        self.requests: list = []

    @classmethod
    def bind(cls, factory: Callable[..., CacheAdapter], *, variants: Sequence[dict] = ({},), name: str | None = None,
             coverage: CoverageTracker | None = None, settings: Settings | None = None) -> type["CacheProtocolMachine"]:
        """A subclass driving ``factory``; its ``TestCase`` runs it under unittest / pytest."""
        attrs_ = {"adapter_factory": staticmethod(factory), "variants": tuple(variants), "coverage": coverage}
        sub = type(name or f"{cls.__name__}Bound", (cls,), attrs_)
        sub.__module__ = cls.__module__
        sub.TestCase.settings = settings or default_settings()
        return sub

    # ------------------------------------------------------------------ plumbing

    def _tokens(self, pages: Sequence[int]) -> tuple[int, ...]:
        return pages_to_tokens(pages, self.adapter.page_size)

    def _cut(self, tokens: tuple[int, ...], cut: int) -> tuple[int, ...]:
        ps = self.adapter.page_size
        keep = max(ps, len(tokens) - cut * ps)
        return tokens[:keep]

    def _do(self, op: str, *args: Any):
        out = perform(self.adapter, Step(op, args), catch=False)
        assert not out.problems, "\n".join(out.problems)
        return out.result

    def _remember(self, tokens: tuple[int, ...]) -> None:
        if tokens and tokens not in self.seen:
            self.seen.append(tokens)

    # ------------------------------------------------------------------ setup / teardown

    @initialize(target=prompts, variant=st.integers(0, 63), pages=prompt_pages(ALPHABET, 1, MAX_PAGES))
    def setup(self, variant: int, pages: list[int]) -> tuple[int, ...]:
        """Build the cache (one of ``variants``) and insert a first prompt."""
        kw = self.variants[variant % len(self.variants)]
        self.adapter = type(self).adapter_factory(**kw)
        if self.coverage is not None:
            self.coverage.attach_all(self.adapter.machines())
        return self.insert(pages)

    def teardown(self) -> None:
        if self.adapter is not None:
            self.adapter.close()

    @invariant()
    def check(self) -> None:
        """The invariant catalogue (also called by generated regression tests after each step)."""
        if self.adapter is None:
            return
        problems = catalogue(self.adapter, self.seen)
        assert not problems, "invariant catalogue:\n  " + "\n  ".join(problems)

    # ------------------------------------------------------------------ engine steps

    @rule(target=prompts, pages=prompt_pages(ALPHABET, 1, MAX_PAGES))
    def insert(self, pages: list[int]) -> tuple[int, ...]:
        tokens = self._tokens(pages)
        self._do("insert", tokens)
        self._remember(tokens)
        return tokens

    @rule(target=prompts, base=prompts, pages=prompt_pages(ALPHABET, 1, 2))
    def next_turn(self, base: tuple[int, ...], pages: list[int]) -> tuple[int, ...]:
        """A multi-turn request: match the history, load it back, lock it, insert history + turn."""
        tokens = base + self._tokens(pages)
        self._do("match", tokens)
        if self.adapter.supports("load_back"):
            self._do("load_back", base)
        self._do("insert", tokens)
        self._remember(tokens)
        return tokens

    @rule(tokens=prompts, cut=st.integers(0, 3))
    def match(self, tokens: tuple[int, ...], cut: int) -> None:
        self._do("match", self._cut(tokens, cut))

    @precondition(_supports("lock"))
    @rule(tokens=prompts, cut=st.integers(0, 3))
    def lock(self, tokens: tuple[int, ...], cut: int) -> None:
        self._do("lock", self._cut(tokens, cut))

    @precondition(lambda self: self.adapter is not None and self.adapter.supports("unlock")
                  and bool(self.adapter.held_locks()))
    @rule(pick=st.integers(0, 7))
    def unlock(self, pick: int) -> None:
        self._do("unlock", pick % len(self.adapter.held_locks()))

    @precondition(_supports("pin_host"))
    @rule(tokens=prompts, cut=st.integers(0, 3))
    def pin_host(self, tokens: tuple[int, ...], cut: int) -> None:
        self._do("pin_host", self._cut(tokens, cut))

    @precondition(lambda self: self.adapter is not None and self.adapter.supports("unpin_host")
                  and bool(self.adapter.held_pins()))
    @rule(pick=st.integers(0, 7))
    def unpin_host(self, pick: int) -> None:
        self._do("unpin_host", pick % len(self.adapter.held_pins()))

    @precondition(_supports("evict"))
    @rule(pages=st.integers(1, 4))
    def evict(self, pages: int) -> None:
        self._do("evict", pages * self.adapter.page_size)

    @precondition(_supports("evict_host"))
    @rule(pages=st.integers(1, 4))
    def evict_host(self, pages: int) -> None:
        self._do("evict_host", pages * self.adapter.page_size)

    @precondition(_supports("load_back"))
    @rule(tokens=prompts, cut=st.integers(0, 3))
    def load_back(self, tokens: tuple[int, ...], cut: int) -> None:
        self._do("load_back", self._cut(tokens, cut))

    @precondition(_supports("backup"))
    @rule(tokens=prompts, cut=st.integers(0, 3))
    def backup(self, tokens: tuple[int, ...], cut: int) -> None:
        self._do("backup", self._cut(tokens, cut))

    # ------------------------------------------------------------------ executor steps

    @precondition(lambda self: self.adapter is not None and self.adapter.supports("complete_job")
                  and bool(self.adapter.pending_jobs()))
    @rule(pick=st.integers(0, 15))
    def complete_job(self, pick: int) -> None:
        self._do("complete_job", pick % len(self.adapter.pending_jobs()))

    @precondition(lambda self: self.adapter is not None and self.adapter.supports("fail_job")
                  and bool(self.adapter.pending_jobs()))
    @rule(pick=st.integers(0, 15))
    def fail_job(self, pick: int) -> None:
        self._do("fail_job", pick % len(self.adapter.pending_jobs()))

    @precondition(lambda self: self.adapter is not None and self.adapter.supports("complete_job")
                  and bool(self.adapter.pending_jobs()))
    @rule(order=st.permutations(range(8)), fail_mask=st.integers(0, 255))
    def ack_round(self, order: list[int], fail_mask: int) -> None:
        """Acknowledge every pending job in a drawn order, failing those the mask says."""
        jobs = self.adapter.pending_jobs()
        ranked = sorted(range(len(jobs)), key=lambda i: order[i % 8] + 8 * (i // 8))
        ids = [jobs[i].id for i in ranked]
        for n, job_id in enumerate(ids):
            current = [j.id for j in self.adapter.pending_jobs()]
            if job_id not in current:
                continue
            fail = bool(fail_mask >> (n % 8) & 1) and self.adapter.supports("fail_job")
            self._do("fail_job" if fail else "complete_job", current.index(job_id))
            self.check()

    @precondition(lambda self: self.adapter is not None and self.adapter.supports("redeliver")
                  and bool(self.adapter.finished_jobs()))
    @rule(pick=st.integers(0, 7))
    def redeliver(self, pick: int) -> None:
        self._do("redeliver", pick % len(self.adapter.finished_jobs()))

    # ------------------------------------------------------------------ storage steps (when supported)

    @precondition(_supports("prefetch"))
    @rule(tokens=prompts)
    def prefetch(self, tokens: tuple[int, ...]) -> None:
        req = self._do("prefetch", tokens)
        if req is not None:
            self.requests.append(req)

    @precondition(lambda self: self.adapter is not None and self.adapter.supports("abort") and bool(self.requests))
    @rule(pick=st.integers(0, 7))
    def abort(self, pick: int) -> None:
        self._do("abort", self.requests.pop(pick % len(self.requests)))

    @precondition(_supports("storage_fault"))
    @rule(fault=storage_faults())
    def storage_fault(self, fault: StorageFault) -> None:
        self._do("storage_fault", fault)


def default_settings(examples: int = 60, steps: int = 40, **kw: Any) -> Settings:
    return Settings(max_examples=examples, stateful_step_count=steps, deadline=None,
                    suppress_health_check=list(HealthCheck), **kw)


# =========================================================================== HiCache binding

HICACHE_VARIANTS: tuple[dict, ...] = tuple(
    dict(write_policy=w, eviction_policy=e, device_pages=d, host_pages=h)
    for w in ("write_through", "write_back", "write_through_selective", "write_behind")
    for e, d, h in (("lru", 3, 3), ("lfu", 4, 2), ("lru", 2, 4), ("priority", 5, 5))
)


def _hicache(**kw: Any) -> CacheAdapter:
    from hicache_fsm.testing.adapter import HiCacheAdapter

    return HiCacheAdapter(**kw)


def hicache_machine(variants: Sequence[dict] = HICACHE_VARIANTS, coverage: CoverageTracker | None = None,
                    name: str = "HiCacheMachine", **settings_kw: Any) -> type[CacheProtocolMachine]:
    """The machine bound to ``HiCacheAdapter`` over tiny pools, drawing one of ``variants`` per run."""
    settings = default_settings(**settings_kw) if settings_kw else None
    return CacheProtocolMachine.bind(_hicache, variants=variants, name=name, coverage=coverage, settings=settings)


# =========================================================================== running outside pytest


@attrs.define
class FuzzResult:
    ok: bool
    examples: int
    seconds: float
    seed: int
    failure: str = ""
    steps: list[str] = attrs.Factory(list)
    test_code: str = ""
    coverage: dict = attrs.Factory(dict)

    def to_json(self) -> dict:
        return {"ok": self.ok, "examples": self.examples, "seconds": round(self.seconds, 3), "seed": self.seed,
                "failure": self.failure, "steps": self.steps, "test": self.test_code, "coverage": self.coverage}


_STEP_LINE = re.compile(r"^(state\b|[a-z_]+_\d+ = state\.|state\.)")


def regression_test(steps: Sequence[str], *, machine_import: str, machine_name: str, failure: str = "",
                    test_name: str = "test_fuzz_regression", wrap: str | None = None) -> str:
    """A runnable pytest test replaying a falsifying example, checking invariants after every step."""
    body = []
    for line in steps:
        if line.strip() == "state.check()":
            continue
        body.append(line)
        if line.startswith("state.") and not line.startswith("state.teardown") or re.match(r"^[a-z_]+_\d+ = state\.", line):
            body.append("state.check()")
    indent = "    " * (2 if wrap else 1)
    lines = ["# Generated by `hicache-fsm fuzz`; the failure it reproduces:"]
    lines += [f"#   {l}" for l in failure.strip().splitlines()[-6:]] if failure else []
    lines += [machine_import, "", "", f"def {test_name}():"]
    if wrap:
        lines.append(f"    with {wrap}:")
    lines += [indent + b for b in body]
    return "\n".join(lines) + "\n"


def run_fuzz(machine: type[CacheProtocolMachine], *, examples: int = 100, steps: int = 40, seed: int = 0,
             progress: TextIO | None = None, shrink: bool = True, machine_import: str | None = None,
             wrap: str | None = None) -> FuzzResult:
    """Run ``machine`` like hypothesis would under pytest, outside pytest.

    Deterministic for a given ``seed``. On failure, ``steps`` holds the shrunk
    falsifying program and ``test_code`` a pytest test that replays it.
    """
    count = [0]
    t0 = time.perf_counter()
    last = [t0]

    def factory() -> CacheProtocolMachine:
        count[0] += 1
        now = time.perf_counter()
        if progress is not None and (now - last[0] >= 0.5 or count[0] == 1):
            last[0] = now
            done = min(count[0], examples)
            bar = "#" * (20 * done // max(1, examples))
            print(f"\rfuzz [{bar:<20}] {done}/{examples} examples, {now - t0:.1f}s", end="", file=progress, flush=True)
        return machine()

    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if shrink else [])
    settings = Settings(max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
                        suppress_health_check=list(HealthCheck), phases=phases, print_blob=False,
                        verbosity=Verbosity.normal, report_multiple_bugs=False)
    test = hypothesis_seed(seed)(get_state_machine_test(factory, settings=settings))
    lines: list[str] = []
    result = FuzzResult(True, 0, 0.0, seed)
    with with_reporter(lines.append):
        try:
            test()
        except BaseException as exc:  # noqa: BLE001 - any failure of the machine is the finding
            if isinstance(exc, KeyboardInterrupt):
                raise
            result.ok = False
            result.failure = f"{type(exc).__name__}: {exc}"
            lines.extend(getattr(exc, "__notes__", ()))
    if progress is not None:
        print(file=progress)
    result.examples = count[0]
    result.seconds = time.perf_counter() - t0
    if machine.coverage is not None:
        result.coverage = machine.coverage.report()
    if not result.ok:
        result.steps = [l for text in lines for l in text.splitlines() if _STEP_LINE.match(l)]
        name = machine.__name__
        imp = machine_import or (f"from hicache_fsm.testing.stateful import hicache_machine\n"
                                 f"{name} = hicache_machine(name={name!r})")
        result.test_code = regression_test(result.steps, machine_import=imp, machine_name=name,
                                           failure=result.failure, wrap=wrap)
    return result
