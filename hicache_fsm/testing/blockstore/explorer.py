"""The bounded explorer: breadth-first over every state a block store reaches, shortest counterexamples.

Bounded by the model only (prompts, jobs in flight, entries, states, depth),
never by the clock: the same bounds give the same verdict on any machine. The
clock only paces the progress line. Ctrl-C (or SIGTERM, when the caller maps it
to ``KeyboardInterrupt``) ends the search with a partial result
(``complete: false``, ``stopped: "interrupted"``).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import TextIO

import attrs

from hicache_fsm.config import check_positive_int
from hicache_fsm.errors import ConfigError
from hicache_fsm.testing.blockstore.adapter import BlockStoreAdapter, Key, chain
from hicache_fsm.testing.blockstore.symmetry import Asymmetric, ReducedKeys, Symmetry
from hicache_fsm.testing.blockstore.world import StoreWorld, format_step

PROGRESS_EVERY_S = 1.0
DEFAULT_DEPTH = 7  # steps from the empty store: the examples' planted bugs need at most 4; vLLM-sized ARC grows ~3x a step


@attrs.frozen
class StoreBounds:
    """Prompts of 1..``max_len`` blocks over ``alphabet`` page ids, at most ``max_jobs`` jobs in flight and
    ``max_entries`` keys held (a state beyond is checked, not expanded); at most ``max_states`` states
    (exactly, the run is then incomplete) and ``max_depth`` steps from the start (None: no limit; a model
    bound, the run stays complete); ``redeliver``: try re-delivering finished acks; ``symmetry``: merge
    states that differ only by the names of block keys (see ``symmetry``)."""

    alphabet: int = 2
    max_len: int = 3
    max_jobs: int = 2
    max_entries: int | None = None
    max_states: int | None = None
    max_depth: int | None = DEFAULT_DEPTH
    redeliver: bool = True
    symmetry: bool = True

    def __attrs_post_init__(self) -> None:
        """Refuse bounds under which a run would pass having explored next to nothing."""
        for name in ("alphabet", "max_len", "max_jobs"):
            check_positive_int(f"StoreBounds.{name}", getattr(self, name), 1)
        for name, least in (("max_entries", 0), ("max_states", 1), ("max_depth", 1)):
            if getattr(self, name) is not None:
                check_positive_int(f"StoreBounds.{name}", getattr(self, name), least)


def prompts_for(bounds: StoreBounds) -> list[tuple[Key, ...]]:
    return [chain(p) for n in range(1, bounds.max_len + 1)
            for p in itertools.product(range(bounds.alphabet), repeat=n)]


@attrs.define
class StoreExploreResult:
    adapter: str
    states: int = 0
    transitions: int = 0
    max_depth: int = 0
    seconds: float = 0.0
    complete: bool = False  # every state within the bounds (depth included) was reached and checked
    stopped: str = "complete"  # complete | violation | max_states | interrupted
    depth_bounded: bool = False  # states at max_depth were left unexpanded (deeper ones may exist)
    entries_bound: int | None = None  # max_entries, when states holding more keys were checked but not expanded
    states_before_symmetry: int = 0  # distinct states met before renamed twins were merged
    symmetry: str = "off"  # "on", "off", or "off: why"
    violations: list[tuple[tuple[str, ...], tuple[tuple, ...]]] = attrs.Factory(list)

    def checked_nothing(self) -> str:
        """Why a run without violations is no evidence ("" when it checked something): a store no step changed
        (one that declines every store, say) passes every check vacuously."""
        return "no step led to a second state" if self.states <= 1 and not self.violations else ""

    @property
    def ok(self) -> bool:
        """No violation, and the run checked something."""
        return not self.violations and not self.checked_nothing()

    def verdict(self) -> str:
        """How far the run went: ``complete``, ``complete to depth N`` (deeper states left), or why it stopped;
        ``CHECKED NOTHING`` before any of them when no step changed the store."""
        if self.checked_nothing():
            return f"CHECKED NOTHING ({self.checked_nothing()})"
        if self.complete:
            verdict = f"complete to depth {self.max_depth}" if self.depth_bounded else "complete"
            if self.entries_bound is not None:  # a bound that cut the search is said, as the depth's is
                verdict += f" within --max-entries {self.entries_bound} (states holding more keys not expanded)"
            return verdict
        return {"violation": "stopped at a violation", "interrupted": "INTERRUPTED",
                "max_states": "INCOMPLETE (--max-states reached)"}.get(self.stopped, "INCOMPLETE")

    def summary(self) -> str:
        """One line: states (and before the symmetry merged renamed twins), transitions, depth, verdict."""
        merged = f" ({self.states_before_symmetry} before symmetry)" if self.symmetry == "on" else ""
        return (f"{self.adapter}: {self.states} states{merged}, {self.transitions} transitions, max depth "
                f"{self.max_depth}, {self.verdict()}, {len(self.violations)} violations, {self.seconds:.1f}s")

    def format_violation(self, i: int = 0) -> str:
        problems, trace = self.violations[i]
        lines = [f"violation after {len(trace)} steps:"]
        lines += [f"  {n + 1:2d}. {format_step(s)}" for n, s in enumerate(trace)]
        return "\n".join(lines + [f"  ! {p}" for p in problems])

    def to_json(self) -> dict:
        return {"adapter": self.adapter, "states": self.states, "transitions": self.transitions,
                "max_depth": self.max_depth, "complete": self.complete, "stopped": self.stopped,
                "seconds": round(self.seconds, 3), "violations": len(self.violations),
                "depth_bounded": self.depth_bounded, "entries_bound": self.entries_bound,
                "checked_nothing": self.checked_nothing(),
                "symmetry": self.symmetry,
                "states_before_symmetry": self.states_before_symmetry,
                "counterexamples": [{"problems": list(p), "steps": [format_step(s) for s in t]}
                                    for p, t in self.violations]}


def explore_store(factory: Callable[[], BlockStoreAdapter], bounds: StoreBounds = StoreBounds(), *,
                  stop_on_first: bool = False, max_violations: int = 5,
                  progress: TextIO | None = None) -> StoreExploreResult:
    """Breadth-first over every state ``factory()`` reaches within ``bounds``; shortest counterexamples.

    ``progress`` gets a line now and then (states, depth, rate) and a last line.
    Job ids are the adapter's; the model keys jobs by kind and keys, so the
    adapter's ``state_key`` should not carry job ids either.
    """
    t0 = time.perf_counter()
    ticker = _Ticker(progress, t0)
    symmetry = Symmetry(prompts_for(bounds)) if bounds.symmetry else None
    why_off = None if symmetry is None else symmetry.why_not
    while True:
        root = StoreWorld(factory(), factory)
        result = StoreExploreResult(_description(root.adapter))
        on = symmetry is not None and why_off is None
        result.symmetry = "on" if on else ("off" if symmetry is None else f"off: {why_off}")
        search = _Search(root, bounds, result, stop_on_first, max_violations, symmetry if on else None, factory)
        try:
            while search.queue and not search.stopped:
                search.expand(*search.queue.popleft())
                ticker.tick(search)
        except KeyboardInterrupt:
            search.stopped = "interrupted"
        except Asymmetric as exc:
            why_off = str(exc)
            continue
        break
    result.states = len(search.parents)
    result.states_before_symmetry = result.states if search.reduced is None else len(search.reduced.seen)
    result.complete = not search.queue and not search.stopped
    result.stopped = search.stopped or "complete"
    result.depth_bounded = search.pruned
    result.entries_bound = bounds.max_entries if search.entries_pruned else None
    result.seconds = time.perf_counter() - t0
    ticker.done(result)
    return result


class _Search:
    """The frontier and what was seen; ``expand`` tries every step of one state."""

    def __init__(self, root: StoreWorld, bounds: StoreBounds, result: StoreExploreResult, stop_on_first: bool,
                 max_violations: int, symmetry: Symmetry | None, factory: Callable[[], BlockStoreAdapter]) -> None:
        self.bounds, self.result = bounds, result
        self.stop_on_first, self.max_violations = stop_on_first, max_violations
        self.prompts = prompts_for(bounds)
        self.reduced = None if symmetry is None else ReducedKeys(symmetry, factory)
        self.key_of = StoreWorld.key if self.reduced is None else self.reduced
        key = self.key_of(root)
        self.parents: dict = {key: (None, None)}
        self.queue = deque([(root, key, 0)])
        self.seen_kinds: set[str] = set()
        self.stopped: str | None = None
        self.pruned = False
        self.entries_pruned = False  # a child held more than max_entries keys: checked, not expanded
        self.depth = 0

    def expand(self, world: StoreWorld, key, depth: int) -> None:
        self.depth = depth
        b = self.bounds
        if b.max_depth is not None and depth >= b.max_depth:
            self.pruned = True
            return
        for step in world.steps(self.prompts, b.max_jobs, b.redeliver):
            child = world.clone()
            problems = child.do(*step)
            self.result.transitions += 1
            if problems:
                self._violation(problems, key, step)
                if self.stopped:
                    return
                continue
            ckey = self.key_of(child)
            if ckey in self.parents:
                continue
            if b.max_states is not None and len(self.parents) >= b.max_states:
                self.stopped = "max_states"
                return
            self.parents[ckey] = (key, step)
            if b.max_entries is None or len(child.model.keys) <= b.max_entries:
                self.queue.append((child, ckey, depth + 1))
                self.result.max_depth = max(self.result.max_depth, depth + 1)
            else:
                self.entries_pruned = True

    def _violation(self, problems: list[str], key, step: tuple) -> None:
        kinds = {p.split(":")[0] for p in problems}
        if not self.stop_on_first and kinds <= self.seen_kinds:
            return
        self.seen_kinds |= kinds
        trace, k = [step], key
        while self.parents[k][0] is not None:
            trace.append(self.parents[k][1])
            k = self.parents[k][0]
        self.result.violations.append((tuple(problems), tuple(reversed(trace))))
        if self.stop_on_first or len(self.result.violations) >= self.max_violations:
            self.stopped = "violation"


def _description(adapter: BlockStoreAdapter) -> str:
    """``adapter.describe()``; its failure is a ``ConfigError`` before the search (not a traceback)."""
    try:
        return adapter.describe()
    except Exception as exc:  # noqa: BLE001 - the user's adapter code
        raise ConfigError(f"the adapter's describe raised {type(exc).__name__}: {exc}") from None


class _Ticker:
    """A progress line about once a second (a terminal gets it redrawn in place)."""

    def __init__(self, out: TextIO | None, t0: float) -> None:
        self.out, self.t0, self.last = out, t0, t0
        self.live = out is not None and out.isatty()

    def tick(self, search: _Search) -> None:
        now = time.perf_counter()
        if self.out is None or now - self.last < PROGRESS_EVERY_S:
            return
        self.last = now
        states = len(search.parents)
        line = (f"explore: {states} states, depth {search.depth}, {len(search.queue)} queued, "
                f"{states / max(now - self.t0, 1e-9):.0f} states/s")
        print(f"\r{line}" if self.live else line, end="" if self.live else "\n", file=self.out, flush=True)

    def done(self, result: StoreExploreResult) -> None:
        if self.out is None:
            return
        print(f"{chr(13) if self.live else ''}explore: {result.summary()}", file=self.out, flush=True)
