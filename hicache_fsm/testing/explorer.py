"""Exhaustive, bounded exploration of the composed cache protocol.

What is explored. Not one spec in isolation but the *composition* the cache
runs: a radix tree of up to ``nodes`` nodes, each in its own residency state,
over device and host pools of a few pages, with engine-held locks and host
pins, and every job in flight completed or failed in every order. From the
empty cache, every step an engine or an executor can take is tried in every
state (``Bounds`` lists them: insert / match / lock / load back / back up /
pin each prompt of a small alphabet, unlock / unpin each held handle, evict
each tier by 1..N pages, complete or fail each pending job, re-deliver a
finished job's acknowledgement). With ``Bounds(storage=True)`` the cache also
has an L3 tier run step by step (``testing.storage.ManualStorageTier``): every
prompt may be prefetched or stored by another instance, every running prefetch
polled or aborted, every queued storage step (hit query, transfer, backup,
probe) completed, failed or (``partial_storage`` / ``partial_backup``, when
the adapter has them) answered one page short, and storage detached or attached again; the tier and its ``memory://`` pages are forked
with the cache, and the state key then carries the stored keys, the prefetches
and the storage queues (token renaming is off: keys hash token ids).
An adapter adds steps of its own through ``prompt_steps(prompt)`` and
``extra_steps()`` (the CP adapter's ``reserve`` and ``layer_end``).
Breadth-first, so the first trace found to a violation is a shortest one.

Why the real cache and not an abstract model. The explorer drives the real
``HiCache`` through its ``CacheAdapter``, forking the state before each
step (``HiCacheAdapter.clone``: a structural copy in ~100 us; a generic deep
copy costs ~2 ms). A faithful abstract model would be faster but would have
to restate the cache's eviction order, split rules and job bookkeeping, and
would check the model, not the code: a controller bug (the planted
``mutants``) lives in exactly the code a model would paraphrase. Driving the
real code keeps one source of truth; the spec is still the judge, through
the invariants the cache registers from its specs and the adapter's checks.

State identity. States are deduplicated on ``adapter.state_key()``, a
canonical abstraction: the tree by token prefixes (node and job ids and slot
numbers dropped; token ids up to renaming), each node's residency, lock and
pin counts, whether it was ever hit (the hit count up to the threshold under
``write_through_selective``) and its *rank* in the eviction order instead of
clock values, pending jobs by kind and nodes, and the engine's handles. Under
LRU the rank is exact; under LFU two states whose hit counts differ but order
the nodes alike are merged (a documented under-approximation). KV contents are not part of the key, so read-back
is checked after every step, also when it lands on a known key; the key does
carry the free-page counts and job counts, so a leak or a stray job makes a
new state that gets the full invariant check.

Reductions, each reported (``ExploreResult.reductions``, ``check --json``'s ``"reductions"``):
token renaming merges states that differ by a permutation of token ids (the tree's and those stale
KV in free slots still holds), and every kept state is also counted once per distinct renaming
(``raw_states``: what a search without it keeps, exact from the empty cache); ``Bounds.omit``
narrows the action set and ``Bounds.start`` begins the search after a few fixed steps. Slot ids are
not renamed: the allocator sorts released pages by id, so which page comes next depends on the ids
themselves, and no renaming but the identity keeps that order.

Checks in every new state: the adapter's invariant catalogue, KV read-back of
every prompt of the alphabet, and per step the contract of ``checks.perform``
(refusals change nothing, evictions report what they freed, a second ack is
refused, no unexpected exception). An adapter declaring ``eviction_policy()``
has every step's victims judged (``checks.UseOrder``); its state key then also
carries the order in which the explored steps used the pages. A successor larger than ``nodes`` is
checked but not expanded. An adapter method that raises anywhere else (``invariant_violations``,
``state_key``, ...) is reported like a violation, with the trace that led to it; an adapter without
``state_key`` or ``size`` is a ``ConfigError`` before anything runs.

A run that checked nothing is no pass (``ExploreResult.ok`` is False, ``checked_nothing()`` says
why): no step led to a second state, or the adapter accepted none of the inserts it was offered.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import time
import traceback
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from typing import Any, TextIO

import attrs
import torch

from hicache_fsm.config import CacheConfig, check_positive_int
from hicache_fsm.errors import ConfigError, StorageKeyError
from hicache_fsm.storage.keys import KeyNamespace
from hicache_fsm.testing.adapter import CacheAdapter
from hicache_fsm.testing.checks import Step, UseOrder, catalogue, judged, kv_check, replay_steps
from hicache_fsm.testing.kv import MAX_LAYERS
from hicache_fsm.testing.paths import CoverageTracker

__all__ = ["EXPLORER_OPS", "Bounds", "ExploreResult", "Explorer", "Violation", "explore", "hicache_factory",
           "missing_ops", "prompts_for"]

EXPLORER_OPS = ("state_key", "size")  # what the search needs beyond the operations every adapter has


# CacheConfig fields ``Bounds`` names itself (``write_policy``, ``eviction_policy``): not ``cache_options``
_OWN_OPTIONS = ("write_policy", "eviction_policy")


def _option_pairs(options: Any) -> tuple[tuple[str, Any], ...]:
    """``Bounds.cache_options`` / ``storage_options`` as sorted (name, value) pairs, from a mapping or pairs."""
    if isinstance(options, Mapping):
        options = options.items()
    try:
        return tuple(sorted((str(k), v) for k, v in options))
    except (TypeError, ValueError):
        raise ConfigError(f"Bounds options must be a mapping of field names to values, got {options!r}") from None


def check_cache_options(options: dict[str, Any]) -> None:
    """``ConfigError`` unless ``options`` are ``CacheConfig`` fields (other than those ``Bounds`` names) with
    valid values."""
    fields = [f for f in attrs.fields_dict(CacheConfig) if f not in _OWN_OPTIONS]
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise ConfigError(f"Bounds.cache_options: unknown option(s) {', '.join(unknown)}; known: {', '.join(fields)} "
                          f"(write_policy and eviction_policy are bounds of their own)")
    CacheConfig(**options)  # the config's own validators: a typed error naming the field


STORAGE_OPTIONS = ("prefetch_threshold", "prefetch_capacity_tokens", "batch_pages")  # ``Bounds.storage_options``
MAX_PRIORITIES = 16  # ``Bounds.priorities``: each is another insert of every prompt in every state


def check_storage_options(options: dict[str, Any], storage: bool) -> None:
    """``ConfigError`` unless ``options`` are the tier options ``Bounds`` sets (``STORAGE_OPTIONS``) with valid
    values, and a storage tier is attached to take them."""
    from hicache_fsm.storage.options import TierOptions

    unknown = sorted(set(options) - set(STORAGE_OPTIONS))
    if unknown:
        raise ConfigError(f"Bounds.storage_options: unknown option(s) {', '.join(unknown)}; known: "
                          f"{', '.join(STORAGE_OPTIONS)}")
    if options and not storage:
        raise ConfigError("Bounds.storage_options need a storage tier (storage=True)")
    TierOptions(**options)  # the tier's own validators


@attrs.frozen
class Bounds:
    """How far to explore.

    ``alphabet`` distinct token ids, prompts of 1..``max_len`` pages (default:
    ``min(nodes, device_pages)``, the longest prompt that fits on the device),
    at most ``max_locks`` engine locks and ``max_pins`` host pins held at once,
    evictions of 1..``device_pages`` / 1..``host_pages`` pages. ``track_hits``
    keeps "was this node ever hit" in the state key even when the policy does
    not read hit counts (LRU, not selective), to explore hit-count bookkeeping.
    ``max_depth``: every state within this many steps of the empty cache is reached and checked,
    those at the bound are not expanded (a model bound: the run is *complete to depth N*, and
    ``ExploreResult.depth_bounded`` says that states at the bound were left, so deeper ones may
    exist). ``max_states`` stops the search early (then it is incomplete).
    ``max_seconds`` is a safety stop only: a run it stops is incomplete and ``check`` fails, so no
    verdict depends on the clock.
    ``storage`` attaches an L3 tier run step by step (``ManualStorageTier`` over ``memory://``):
    then every prompt may also be prefetched or stored by another instance (``store_remote``),
    each running prefetch (at most ``max_prefetches``) polled or aborted, and each queued storage
    step completed or failed; ``stop_policy`` is the prefetch stop policy.
    ``omit``: operations never tried (a narrower action set, named in the report). ``start``: steps run
    on the empty cache before the search (each checked); depth counts from the state they reach, and a
    counterexample's trace begins with them.
    ``priorities``: inserts also run at priorities 1..``priorities - 1`` (for the ``priority`` eviction
    policy). ``max_resets``: at most this many ``reset`` steps per path (the adapter's ``resets``; each
    tried with the jobs in flight acknowledged and failed).
    ``namespaces``: a prompt's first token also names its tree namespace (``testing.namespaces``): with 2,
    prompts that start with 1 and 2 are the same cache tokens in two namespaces. ``host_layout``: the host
    pool's layout (``pools.LAYOUTS``), whose copies index pages and layers each its own way.
    ``cache_options``: other ``CacheConfig`` fields for the cache under test, as (name, value) pairs (a
    mapping is accepted and sorted): the thresholds and budgets a default config never exercises, such as
    ``eviction_headroom_tokens``, ``load_back_threshold`` or ``write_behind_batch_tokens``.
    ``storage_options``: the storage tier's ``prefetch_threshold``, ``prefetch_capacity_tokens`` and
    ``batch_pages`` (``TierOptions``; with ``storage`` only), the same way: by default a prefetch of one page
    and up is admitted, up to the whole host pool, and every storage call takes at most two pages.
    ``remote_tenant``: ``store_remote`` is another tenant's instance on the same storage (with storage only),
    whose pages (other KV for the same tokens) must never be hit.
    """

    nodes: int = 3
    device_pages: int = 2
    host_pages: int = 2
    layers: int = 1
    page_size: int = 1
    alphabet: int = 2
    max_len: int | None = None
    max_locks: int = 1
    max_pins: int = 1
    write_policy: str = "write_through"
    eviction_policy: str = "lru"
    track_hits: bool = False
    redeliver: bool = True
    storage: bool = False
    stop_policy: str = "best_effort"
    max_prefetches: int = 1
    max_depth: int | None = None
    max_states: int | None = None
    max_seconds: float | None = None
    omit: tuple[str, ...] = ()
    start: tuple[Step, ...] = ()
    priorities: int = 1
    max_resets: int = 0
    namespaces: int = 1
    host_layout: str = "layer_first"
    cache_options: tuple[tuple[str, Any], ...] = attrs.field(default=(), converter=_option_pairs)
    storage_options: tuple[tuple[str, Any], ...] = attrs.field(default=(), converter=_option_pairs)
    remote_tenant: str | None = None

    def __attrs_post_init__(self) -> None:
        """Refuse bounds that explore nothing meaningful (a run over them would pass, having checked nothing)."""
        for least, names in ((1, ("nodes", "device_pages", "host_pages", "layers", "page_size", "alphabet",
                                  "max_prefetches", "priorities", "namespaces")),
                             (0, ("max_locks", "max_pins", "max_resets"))):
            for name in names:
                check_positive_int(f"Bounds.{name}", getattr(self, name), least)
        for name in ("max_len", "max_depth", "max_states"):
            if getattr(self, name) is not None:
                check_positive_int(f"Bounds.{name}", getattr(self, name), 1)
        if self.priorities > MAX_PRIORITIES:
            raise ConfigError(f"Bounds.priorities must be at most {MAX_PRIORITIES}, got {self.priorities}")
        if self.layers > MAX_LAYERS:  # the test KV encodes the layer in each value (testing.kv): no more fit
            raise ConfigError(f"Bounds.layers must be at most {MAX_LAYERS}, got {self.layers}")
        seconds = self.max_seconds
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                    or not seconds > 0):
            raise ConfigError(f"Bounds.max_seconds must be a number > 0 or None, got {seconds!r}")
        for name in ("track_hits", "redeliver", "storage"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"Bounds.{name} must be True or False, got {getattr(self, name)!r}")
        check_cache_options(dict(self.cache_options))
        check_storage_options(dict(self.storage_options), self.storage)
        if self.remote_tenant is not None:
            if not self.storage:
                raise ConfigError("Bounds.remote_tenant needs a storage tier (storage=True)")
            try:
                KeyNamespace("default", tenant=self.remote_tenant)  # a tenant name storage keys accept
            except StorageKeyError as exc:
                raise ConfigError(f"Bounds.remote_tenant: {exc}") from None

    @property
    def prompt_pages(self) -> int:
        return self.max_len if self.max_len is not None else max(1, min(self.nodes, self.device_pages))


def prompts_for(bounds: Bounds) -> list[tuple[int, ...]]:
    """Every prompt of 1..prompt_pages pages over the alphabet (each page repeats one token id)."""
    out = []
    ps = bounds.page_size
    for n in range(1, bounds.prompt_pages + 1):
        for pages in itertools.product(range(bounds.alphabet), repeat=n):
            out.append(tuple(t for p in pages for t in [p + 1] * ps))
    return out


@contextlib.contextmanager
def quiet_cache_logs() -> Iterator[None]:
    """Failed jobs are the point of fuzzing: keep the cache's per-failure warnings out of the output."""
    logger = logging.getLogger("hicache_fsm")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def hicache_factory(bounds: Bounds) -> CacheAdapter:
    from hicache_fsm.testing.adapter import HiCacheAdapter

    adapter = HiCacheAdapter(device_pages=bounds.device_pages, host_pages=bounds.host_pages,
                             page_size=bounds.page_size, layers=bounds.layers, write_policy=bounds.write_policy,
                             eviction_policy=bounds.eviction_policy, storage=bounds.storage,
                             stop_policy=bounds.stop_policy, namespaces=bounds.namespaces,
                             host_layout=bounds.host_layout, remote_tenant=bounds.remote_tenant,
                             **dict(bounds.cache_options), **dict(bounds.storage_options))
    adapter.track_hits = bounds.track_hits
    return adapter


@attrs.frozen
class Violation:
    problems: tuple[str, ...]
    trace: tuple[Step, ...]

    def to_json(self) -> dict:
        return {"problems": list(self.problems), "trace": [s.to_json() for s in self.trace],
                "steps": [str(s) for s in self.trace]}

    def format(self) -> str:
        lines = [f"violation after {len(self.trace)} steps:"]
        lines += [f"  {i + 1:2d}. {s}" for i, s in enumerate(self.trace)]
        lines += [f"  ! {p}" for p in self.problems]
        return "\n".join(lines)


@attrs.define
class ExploreResult:
    bounds: Bounds
    adapter: str = ""
    states: int = 0
    transitions: int = 0
    pruned: int = 0
    skipped: int = 0
    max_depth: int = 0
    raw_states: int = 0  # states counted once per distinct token renaming (what the renaming merged)
    inserts: int = 0  # inserts the adapter accepted (a run with none changed no cache: it checked nothing)
    seconds: float = 0.0
    complete: bool = False  # every state within the bounds (the depth bound included) was reached and checked
    depth_bounded: bool = False  # states at ``max_depth`` were left unexpanded: deeper states may exist
    stopped_by: str = ""  # "", "max_states", "max_seconds", "violation" or "interrupted": why the frontier was left
    violations: list[Violation] = attrs.Factory(list)
    coverage: dict = attrs.Factory(dict)

    @property
    def ok(self) -> bool:
        """No violation, and the run checked something (a search that found no new state proves nothing)."""
        return not self.violations and not self.checked_nothing()

    def checked_nothing(self) -> str:
        """Why this run is no evidence although it found nothing ("" when it checked something): no step led
        to a second state, or the adapter refused every insert it was offered."""
        if self.states <= 1:
            return "no step led to a second state"
        if not self.inserts and "insert" not in self.bounds.omit:
            return "the adapter accepted no insert"
        return ""

    def reductions(self) -> dict:
        """What the search left out, per reduction: token renaming (states kept, and counted once per
        distinct renaming: what a search without it would keep, exact when the start state is the empty
        cache), the operations a narrower action set omits, and the steps run before the search."""
        return {"token_renaming": {"states": self.states, "without": self.raw_states or self.states},
                "omitted_ops": list(self.bounds.omit), "start_steps": len(self.bounds.start)}

    def to_json(self) -> dict:
        return {
            "adapter": self.adapter,
            "bounds": attrs.asdict(self.bounds),
            "states": self.states,
            "transitions": self.transitions,
            "pruned": self.pruned,
            "max_depth": self.max_depth,
            "reductions": self.reductions(),
            "complete": self.complete,
            "depth_bounded": self.depth_bounded,
            "checked_nothing": self.checked_nothing(),
            "stopped_by": self.stopped_by,
            "violations": len(self.violations),
            "counterexamples": [v.to_json() for v in self.violations],
            "coverage": self.coverage,
        }


def missing_ops(adapter: CacheAdapter) -> list[str]:
    """The operations the explorer needs that ``adapter`` lacks: ``state_key`` (its visited set), ``size``
    (its node bound)."""
    return [op for op in EXPLORER_OPS if not adapter.supports(op)]


def adapter_error(where: str, exc: Exception) -> str:
    """An adapter method that raised outside a step's own call, as a problem: the adapter's failure, reported
    with the trace that led to it (kind ``adapter_error``, so a method that always raises is reported once)."""
    tb = traceback.extract_tb(exc.__traceback__)
    at = f" at {tb[-1].name}:{tb[-1].lineno}" if tb and tb[-1].filename != __file__ else ""
    return f"adapter_error: {where}: raised {type(exc).__name__}: {exc}{at}"


def guarded(where: str, check: Callable[[], list[str]]) -> list[str]:
    """``check()``'s problems, or the exception an adapter method raised in it as one problem."""
    try:
        return check()
    except Exception as exc:  # noqa: BLE001 - the user's adapter: any exception is its failure, not ours
        return [adapter_error(where, exc)]


class Explorer:
    """Breadth-first search over ``factory(bounds)``'s reachable states (see the module docstring)."""

    def __init__(self, factory: Callable[[Bounds], CacheAdapter] = hicache_factory, bounds: Bounds = Bounds(), *,
                 stop_on_first: bool = False, max_violations: int = 5, progress: TextIO | None = None,
                 progress_every: float = 1.0, progress_label: str = "explore",
                 coverage: CoverageTracker | None = None) -> None:
        self.factory = factory
        self.bounds = bounds
        self.stop_on_first = stop_on_first
        self.max_violations = max_violations
        self.progress = progress
        self.progress_every = progress_every
        self.progress_label = progress_label  # what each progress line starts with (a family's name in a portfolio)
        self.coverage = coverage
        self.prompts = prompts_for(bounds)

    def steps(self, adapter: CacheAdapter) -> list[Step]:
        b = self.bounds
        sup = adapter.supports
        out: list[Step] = []
        for p in self.prompts:
            out.append(Step("insert", (p,)))
            out += [Step("insert", (p, k)) for k in range(1, b.priorities)]
            out.append(Step("match", (p,)))
            if sup("lock") and len(adapter.held_locks()) < b.max_locks:
                out.append(Step("lock", (p,)))
            if sup("load_back"):
                out.append(Step("load_back", (p,)))
            if sup("backup"):
                out.append(Step("backup", (p,)))
            if sup("pin_host") and len(adapter.held_pins()) < b.max_pins:
                out.append(Step("pin_host", (p,)))
            if sup("prefetch") and len(adapter.prefetching()) < b.max_prefetches:
                out.append(Step("prefetch", (p,)))
            if sup("store_remote"):
                out.append(Step("store_remote", (p,)))
            out += adapter.prompt_steps(p)
        if sup("poll"):  # an engine step with nothing else to do (``applicable`` says whether it can matter)
            out.append(Step("poll"))
        if sup("unlock"):
            out += [Step("unlock", (i,)) for i in range(len(adapter.held_locks()))]
        if sup("unpin_host"):
            out += [Step("unpin_host", (i,)) for i in range(len(adapter.held_pins()))]
        ps = adapter.page_size
        if sup("evict"):
            out += [Step("evict", (k * ps,)) for k in range(1, b.device_pages + 1)]
        if sup("evict_host"):
            out += [Step("evict_host", (k * ps,)) for k in range(1, b.host_pages + 1)]
        jobs = adapter.pending_jobs()
        for i in range(len(jobs)):
            if sup("complete_job"):
                out.append(Step("complete_job", (i,)))
            if sup("fail_job"):
                out.append(Step("fail_job", (i,)))
        for i in range(len(adapter.prefetching())):
            if sup("prefetch_ready"):
                out.append(Step("prefetch_ready", (i,)))
            if sup("abort"):
                out.append(Step("abort", (i,)))
        for i in range(len(adapter.storage_steps())):
            if sup("complete_storage"):
                out.append(Step("complete_storage", (i,)))
            if sup("fail_storage"):
                out.append(Step("fail_storage", (i,)))
        for i in range(len(adapter.storage_steps())):
            if sup("partial_storage"):
                out.append(Step("partial_storage", (i,)))
            if sup("partial_backup"):
                out.append(Step("partial_backup", (i,)))
        if sup("detach_storage"):
            out.append(Step("detach_storage"))
        if sup("attach_storage"):
            out += [Step("attach_storage"), Step("attach_storage", (True,))]
        out += adapter.extra_steps()
        if b.max_resets and sup("reset") and getattr(adapter, "resets", 0) < b.max_resets:
            out += [Step("reset", (True,)), Step("reset", (False,))]
        if b.redeliver and sup("redeliver") and adapter.finished_jobs():
            out.append(Step("redeliver", (len(adapter.finished_jobs()) - 1,)))
        return [s for s in out if s.op not in b.omit] if b.omit else out

    def run(self) -> ExploreResult:
        """Explore; torch runs single-threaded and the cyclic GC runs rarely meanwhile (tiny tensors,
        many short-lived object graphs), both restored afterwards."""
        threads = torch.get_num_threads()
        gc_threshold = gc.get_threshold()
        torch.set_num_threads(1)
        gc.set_threshold(max(gc_threshold[0], 20000), 50, 50)
        try:
            with quiet_cache_logs():
                return self._run()
        finally:
            torch.set_num_threads(threads)
            gc.set_threshold(*gc_threshold)

    def _root(self) -> tuple[CacheAdapter, UseOrder | None]:
        """``factory(bounds)`` and its use order (when it declares an eviction policy); ``ConfigError`` when it
        lacks what the search needs or declares a policy the toolkit cannot judge (not a traceback mid-run)."""
        root = _users("factory", lambda: self.factory(self.bounds))
        if not isinstance(root, CacheAdapter):
            raise ConfigError(f"the adapter factory returned {type(root).__name__}, not a CacheAdapter")
        missing = missing_ops(root)
        try:
            if missing:
                raise ConfigError(f"{_users('describe', root.describe)}: the explorer needs the adapter's "
                                  f"{' and '.join(missing)} (its visited set and node bound); it lacks them")
            return root, _users("eviction_policy", lambda: UseOrder.of(root))
        except ConfigError:
            _users("close", root.close)
            raise

    def _run(self) -> ExploreResult:
        b = self.bounds
        t0 = time.perf_counter()
        root, order = self._root()
        result = ExploreResult(b, adapter=_users("describe", root.describe))
        if not self._start(root, order, result):
            return self._finish(result, t0, 0, False)
        if self.coverage is not None:
            self.coverage.attach_all(root.machines())
        search = _Search(self, root, result)
        problems = guarded("the start state", lambda: search.begin(root, order))
        if problems and (search.report(problems, ()) or not search.queue):  # no key: nothing to search from
            result.stopped_by = "violation"
            return self._finish(result, t0, len(search.parents), False)
        last = t0
        try:  # Ctrl-C (or SIGTERM, as the command maps it) ends the search with what it found
            while search.queue and not search.stop:
                world, key, depth, order = search.queue.popleft()
                search.expand(world, key, depth, order)
                now = time.perf_counter()
                if self.progress is not None and now - last >= self.progress_every:
                    last = now
                    print(f"{self.progress_label}: {len(search.parents)} states, {result.transitions} transitions, "
                          f"frontier {len(search.queue)}, depth {depth}, {now - t0:.1f}s", file=self.progress,
                          flush=True)
                if b.max_states is not None and len(search.parents) >= b.max_states:
                    result.stopped_by = "max_states"
                    break
                if b.max_seconds is not None and now - t0 >= b.max_seconds:
                    result.stopped_by = "max_seconds"
                    break
        except KeyboardInterrupt:
            result.stopped_by = "interrupted"
            return self._finish(result, t0, len(search.parents), False)
        if search.stop:
            result.stopped_by = "violation"
        return self._finish(result, t0, len(search.parents), not search.queue and not search.stop)

    def _start(self, root: CacheAdapter, order: UseOrder | None, result: ExploreResult) -> bool:
        """Run ``Bounds.start`` on ``root``, each step checked; False (its violation recorded) when one fails."""
        for n, step in enumerate(self.bounds.start):
            out = judged(root, step, order, self.prompts)
            if step.op == "insert" and out.result:
                result.inserts += 1
            problems = out.problems or guarded(f"after start step {n + 1} {step}",
                                               lambda: catalogue(root, self.prompts))
            if out.skipped or out.rejected is not None:
                problems = problems or [f"start: step {n + 1} {step} was {'skipped' if out.skipped else 'refused'}"]
            if problems:
                result.violations.append(Violation(tuple(problems), self.bounds.start[: n + 1]))
                result.stopped_by = "violation"
                return False
        return True

    def _finish(self, result: ExploreResult, t0: float, states: int, complete: bool) -> ExploreResult:
        result.states = states
        result.complete = complete  # the frontier ran dry (states with violations are not expanded)
        result.seconds = time.perf_counter() - t0
        if self.coverage is not None:
            result.coverage = self.coverage.report()
        if self.progress is not None:
            print(f"{self.progress_label}: done: {states} states, {result.transitions} transitions, "
                  f"{len(result.violations)} violations, {result.seconds:.1f}s", file=self.progress, flush=True)
        return result

    def replay(self, trace: Iterable[Step]) -> list[str]:
        """Re-run a counterexample on a fresh adapter; the problems it ends with."""
        return replay_steps(self.factory(self.bounds), trace, self.prompts)


class _Search:
    """One breadth-first run: the states seen (``parents``: key -> (parent key, step), each new state's first
    way in), those larger than ``Bounds.nodes`` (``outside``), the frontier, and what was reported."""

    def __init__(self, explorer: Explorer, root: CacheAdapter, result: ExploreResult) -> None:
        self.explorer, self.bounds, self.result = explorer, explorer.bounds, result
        # an adapter that checks every entry's KV at once needs no prompt read back
        self.kv_prompts = () if root.supports("kv_violations") else explorer.prompts
        keyed = getattr(root, "state_key_orbit", None) is not None
        self.key_orbit = (lambda w: w.state_key_orbit()) if keyed else (lambda w: (w.state_key(), 1))
        self.parents: dict = {}
        self.outside: set = set()
        self.queue: deque = deque()
        self.seen_problems: set[str] = set()
        self.stop = False

    def begin(self, root: CacheAdapter, order: UseOrder | None) -> list[str]:
        """Key, queue and check the start state; its problems."""
        key, orbit = self.key(root, order)
        self.parents[key] = (None, None)
        self.result.raw_states = orbit
        self.queue.append((root, key, 0, order))
        return catalogue(root, self.explorer.prompts)

    def key(self, world: CacheAdapter, order: UseOrder | None) -> tuple[Hashable, int]:
        """The state's key (with the pages' use order, when victims are judged) and orbit size; a key that
        cannot be hashed is the adapter's failure, named."""
        key, orbit = self.key_orbit(world)
        try:
            hash(key)
        except TypeError:
            raise TypeError(f"state_key() returned {key!r:.80}, which is not hashable") from None
        return (key, order.rank()) if order is not None else key, orbit

    def trace(self, key) -> tuple[Step, ...]:
        """The steps from the empty cache (``Bounds.start`` first) to the state ``key``."""
        steps = []
        while True:
            parent, step = self.parents[key]
            if parent is None:
                return self.bounds.start + tuple(reversed(steps))
            steps.append(step)
            key = parent

    def report(self, problems: list[str], trace: tuple[Step, ...]) -> bool:
        """Record a violation (one per set of problem kinds unless stopping on the first); True: stop."""
        kinds = {p.split(":")[0] for p in problems}
        if not self.explorer.stop_on_first and kinds <= self.seen_problems:
            return False
        self.seen_problems.update(kinds)
        self.result.violations.append(Violation(tuple(problems), trace))
        self.stop = self.explorer.stop_on_first or len(self.result.violations) >= self.explorer.max_violations
        return self.stop

    def expand(self, world: CacheAdapter, key, depth: int, order: UseOrder | None) -> None:
        """Try every step of ``world``; an adapter method that raises is reported like a violation."""
        try:
            steps = self.explorer.steps(world)
        except Exception as exc:  # noqa: BLE001 - the user's adapter listing what it holds: its failure
            self.report([adapter_error("listing the next steps", exc)], self.trace(key))
            return
        for step in steps:
            problems = guarded(f"after {step}", lambda: self.visit(world, key, depth, order, step))
            if problems and self.report(problems, self.trace(key) + (step,)):
                return

    def visit(self, world: CacheAdapter, key, depth: int, order: UseOrder | None, step: Step) -> list[str]:
        """Run ``step`` on a fork of ``world``; keep, check and queue the state it reaches; its problems."""
        r, b = self.result, self.bounds
        if not world.applicable(step.op, step.args):
            r.skipped += 1
            return []
        child = world.clone()
        order = order.copy() if order is not None else None
        out = judged(child, step, order, self.explorer.prompts, before=world.snapshot)
        if out.skipped:
            r.skipped += 1
            return []
        r.transitions += 1
        if out.problems:
            return out.problems
        if step.op == "insert" and out.result:
            r.inserts += 1
        ckey, orbit = self.key(child, order)
        if ckey in self.parents or ckey in self.outside:
            # KV contents are not in the key: a step that corrupts a copy can land on a key
            # first reached with good data, so read-back is checked after every step
            return kv_check(child, self.kv_prompts)
        too_big = child.size() > b.nodes
        if too_big:
            self.outside.add(ckey)
            r.pruned += 1
        else:
            self.parents[ckey] = (key, step)
            r.raw_states += orbit
        problems = catalogue(child, self.kv_prompts)
        if problems:
            return problems
        r.max_depth = max(r.max_depth, depth + 1)
        if too_big:
            return []
        if b.max_depth is not None and depth + 1 >= b.max_depth:
            r.depth_bounded = True  # a state at the bound, left unexpanded: deeper ones may exist
        else:
            self.queue.append((child, ckey, depth + 1, order))
        return []


def _users(what: str, call: Callable[[], Any]) -> Any:
    """``call()`` of the user's adapter code before the search: its failure is a ``ConfigError`` naming ``what``
    (the search itself reports an adapter that raises mid-step as a violation)."""
    try:
        return call()
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's code: any failure is a broken adapter
        raise ConfigError(f"the adapter's {what} raised {type(exc).__name__}: {exc}") from None


def explore(bounds: Bounds = Bounds(), factory: Callable[[Bounds], CacheAdapter] = hicache_factory, **kw) -> ExploreResult:
    """Run an ``Explorer``; keyword arguments go to its constructor."""
    return Explorer(factory, bounds, **kw).run()
