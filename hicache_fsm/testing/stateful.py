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
re-deliver a finished job's acknowledgement, poll; where the adapter has them, insert at a
priority (``priority_levels``), reset the cache, and use a prompt again right before an
eviction (the order is judged on it). Storage rules run only when the adapter supports
them: prefetch a prompt (or a next turn of one), another instance storing a prompt (or
the next turn of a cached one, then prefetching it), memory pressure then a prefetch of a prompt storage
holds (followed by a drawn script of its storage steps, polls, abort), the
scheduler polling a prefetch (then load back and insert), abort, run or fail
any queued storage step (hit query, transfer, backup, probe), let executors and
storage catch up, arm a storage fault. After
**every** step the invariant catalogue (``checks.catalogue``) runs: the
adapter's invariants and KV read back from every valid copy of every prompt
seen so far. Each step's own contract is checked by ``checks.perform``, and the
victims of each step by ``checks.UseOrder`` when the adapter declares ``eviction_policy()``.

``run_fuzz`` runs a machine outside pytest with a seed, a progress line and a
failing example turned into a runnable pytest test (``regression_test``). It builds
one adapter per variant first: a factory that refuses a variant (a ``HiCacheError``)
raises ``VariantRefused``, one that fails otherwise (a ``TypeError`` for a misspelt
keyword, say) ``BrokenFactory``: mistakes in the call or the factory, not found bugs,
whichever variants the runs draw. A run in which the adapter accepted no insert
changed no cache and checked nothing: it fails (``FuzzResult.checked_nothing``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

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

from hicache_fsm.config import check_positive_int
from hicache_fsm.errors import ConfigError, HiCacheError
from hicache_fsm.testing.adapter import CacheAdapter, StorageFault, check_variants
from hicache_fsm.testing.checks import Step, UseOrder, catalogue, judged
from hicache_fsm.testing.fixed_draws import without_local_constants
from hicache_fsm.testing.paths import CoverageTracker
from hicache_fsm.testing.regression_code import FuzzResult, failing_program, regression_test
from hicache_fsm.testing.strategies import pages_to_tokens, prompt_pages, storage_faults

__all__ = [
    "CP_VARIANTS", "HICACHE_VARIANTS", "BrokenFactory", "CacheProtocolMachine", "FuzzResult", "Tally",
    "VariantRefused", "cp_machine", "hicache_machine", "protocol_test_case", "regression_test", "run_fuzz",
]

ALPHABET = 3
MAX_PAGES = 4
REQUEST_ACTIONS = ("step", "step", "step", "fail", "partial", "ready", "abort")


def _supports(op: str) -> Callable[[Any], bool]:
    return lambda self: self.adapter is not None and self.adapter.supports(op)


class VariantRefused(ConfigError):
    """The adapter factory refused a variant: ``run_fuzz`` raises it instead of reporting a failing run."""


class BrokenFactory(ConfigError):
    """The adapter factory failed with an error of its own (not a ``HiCacheError`` refusal) or made no
    ``CacheAdapter``: a bug in the factory or its call, so ``run_fuzz`` raises it instead of reporting a found bug."""


@attrs.define
class Tally:
    """Steps that changed a cache over a whole run (``run_fuzz`` shares one among the machines of a class
    with an ``UNCHECKED`` message): with none, the run checked nothing."""

    changes: int = 0


class CacheProtocolMachine(RuleBasedStateMachine):
    """Drive ``adapter_factory(**variant)`` with engine and executor steps; check everything after each.

    Class attributes (set by ``bind``): ``adapter_factory``, ``variants`` (a
    tuple of keyword dicts; the ``setup`` step draws one), ``coverage`` (a
    ``CoverageTracker`` fed by the adapter's compiled machines).
    """

    adapter_factory: Callable[..., CacheAdapter] | None = None
    variants: tuple[dict, ...] = ({},)
    coverage: CoverageTracker | None = None
    UNCHECKED = "the adapter accepted no insert, so no step changed a cache"  # run_fuzz's floor (``Tally``)
    # skip a step the adapter says cannot run now (``applicable``): for adapters whose engine steps must
    # wait for a condition (CP ranks agreeing on what is on the device), as the explorer does
    respect_applicable: bool = False

    prompts = Bundle("prompts")

    def __init__(self) -> None:
        super().__init__()
        self.adapter: CacheAdapter | None = None
        self.order: UseOrder | None = None  # the pages' uses, when the adapter declares an eviction policy
        self.tally = Tally()
        self.seen: list[tuple[int, ...]] = []
        self.remote: list[tuple[int, ...]] = []  # prompts only other instances stored

    @classmethod
    def bind(cls, factory: Callable[..., CacheAdapter], *, variants: Sequence[dict] = ({},), name: str | None = None,
             coverage: CoverageTracker | None = None, settings: Settings | None = None,
             respect_applicable: bool = False) -> type[CacheProtocolMachine]:
        """A subclass driving ``factory``; its ``TestCase`` runs it under unittest / pytest.

        ``variants``: one or more dicts of ``factory``'s keywords (a run picks one per example).
        """
        attrs_ = {"adapter_factory": staticmethod(factory), "variants": check_variants(variants), "coverage": coverage,
                  "respect_applicable": respect_applicable}
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
        if self.respect_applicable and not self.adapter.applicable(op, args):
            return None
        prompts = self.seen + [args[0]] if op in ("insert", "match", "lock") and args[0] not in self.seen else self.seen
        out = judged(self.adapter, Step(op, args), self.order, prompts, catch=False)
        assert not out.problems, "\n".join(out.problems)
        if op == "insert" and out.result:
            self.tally.changes += 1
        return out.result

    def _remember(self, tokens: tuple[int, ...]) -> None:
        if tokens and tokens not in self.seen:
            self.seen.append(tokens)

    # ------------------------------------------------------------------ setup / teardown

    @classmethod
    def build(cls, variant: dict) -> CacheAdapter:
        """``adapter_factory(**variant)``. Its refusal (``VariantRefused``) or failure (``BrokenFactory``) is a
        mistake in the call or the factory, not a bug the run found."""
        try:
            made = cls.adapter_factory(**variant)
        except HiCacheError as exc:  # the adapter refuses this variant: a mistake in the call, not a found bug
            raise VariantRefused(f"variant {variant!r}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - the user's factory failing to build is a broken factory
            raise BrokenFactory(f"the adapter factory raised {type(exc).__name__} building variant {variant!r}: "
                                f"{exc}") from None
        if not isinstance(made, CacheAdapter):
            raise BrokenFactory(f"the adapter factory returned {type(made).__name__} for variant {variant!r}, "
                                f"not a CacheAdapter")
        try:
            UseOrder.of(made)
        except ConfigError as exc:  # a policy the toolkit cannot judge: the adapter's mistake, not a found bug
            made.close()
            raise BrokenFactory(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - the adapter's eviction_policy failing is a broken adapter
            raise BrokenFactory(f"the adapter's eviction_policy raised {type(exc).__name__}: {exc}") from None
        return made

    @classmethod
    def build_each_variant(cls) -> None:
        """Build (and close) one adapter per variant, so that a refused or broken variant is found whichever
        variants a run draws."""
        for variant in cls.variants:
            made = cls.build(variant)
            try:
                made.close()
            except Exception as exc:  # noqa: BLE001 - the adapter's close failing is a broken adapter
                raise BrokenFactory(f"the adapter's close raised {type(exc).__name__}: {exc} (variant "
                                    f"{variant!r})") from None

    # a wide draw taken modulo the number of variants: each variant about equally likely, however many there are
    # (a draw of 0..63 favoured the variants its small and boundary values fall on)
    @initialize(target=prompts, variant=st.integers(0, 65535), pages=prompt_pages(ALPHABET, 1, MAX_PAGES))
    def setup(self, variant: int, pages: list[int]) -> tuple[int, ...]:
        """Build the cache (one of ``variants``) and insert a first prompt."""
        self.variant = self.variants[variant % len(self.variants)]
        self.adapter = self.build(self.variant)
        self.order = UseOrder.of(self.adapter)
        if self.coverage is not None:
            self.coverage.attach_all(self.adapter.machines())
        return self.insert(pages)

    def expect_variant(self, expected: dict) -> None:
        """A generated regression test's guard: its variant number still builds the variant it was found in."""
        if self.variant != expected:
            raise ConfigError(f"this test was generated for variant {expected!r}, but its variant number now "
                              f"builds {self.variant!r} (the variants changed): generate it again")

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

    @precondition(lambda self: self.adapter is not None and self.adapter.supports("priority_levels")
                  and self.adapter.priority_levels() > 1)
    @rule(target=prompts, pages=prompt_pages(ALPHABET, 1, 2), priority=st.integers(1, 3))
    def insert_prioritised(self, pages: list[int], priority: int) -> tuple[int, ...]:
        """An insert at a priority above 0, where the cache ranks by priority (``priority_levels``)."""
        tokens = self._tokens(pages)
        self._do("insert", tokens, priority % self.adapter.priority_levels())
        self._remember(tokens)
        return tokens

    @precondition(_supports("reset"))
    @rule(acked=st.booleans(), now=st.integers(0, 3))
    def reset(self, acked: bool, now: int) -> None:
        """The engine flushes its cache (one draw in four: a reset empties it, so it stays rare); the jobs in
        flight end acknowledged or failed, their acks arriving after the reset."""
        if now == 0:
            self._do("reset", acked)

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

    @precondition(_supports("evict"))
    @rule(tokens=prompts, again=st.booleans(), pages=st.integers(1, 2))
    def reuse_then_evict(self, tokens: tuple[int, ...], again: bool, pages: int) -> None:
        """A prompt is used again (inserted again, or matched), then memory pressure evicts a page or two: the
        eviction order is judged right after a use that should have moved the prompt to the back. When the
        toolkit judges victims (``UseOrder``: only pages that leave the cache are judged) the host tier is emptied
        too, so that what the device eviction moved down is judged."""
        self._do("insert" if again else "match", tokens)
        self.check()
        self._do("evict", pages * self.adapter.page_size)
        if self.order is not None and self.adapter.supports("evict_host"):
            self.check()
            occupied = self.adapter.occupancy().host_tokens if self.adapter.supports("occupancy") else 0
            self._do("evict_host", max(occupied, pages * self.adapter.page_size))

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

    # ------------------------------------------------------------------ the adapter's own steps

    @precondition(lambda self: self.adapter is not None and bool(self.adapter.extra_steps()))
    @rule(pick=st.integers(0, 15))
    def extra_step(self, pick: int) -> None:
        """One of the steps the adapter adds (``extra_steps``: a CP layer finishing its forward pass, the
        prefetch timeout expiring, the storage backend losing its pages)."""
        steps = self.adapter.extra_steps()
        step = steps[pick % len(steps)]
        self._do(step.op, *step.args)

    @precondition(_supports("prompt_steps"))
    @rule(tokens=prompts, pick=st.integers(0, 7))
    def prompt_step(self, tokens: tuple[int, ...], pick: int) -> None:
        """One of the steps the adapter adds for a prompt (``prompt_steps``: a CP host reservation)."""
        steps = self.adapter.prompt_steps(tokens)
        if steps:
            step = steps[pick % len(steps)]
            self._do(step.op, *step.args)

    # ------------------------------------------------------------------ storage steps (when supported)

    @precondition(_supports("prefetch"))
    @rule(base=prompts, pages=prompt_pages(ALPHABET, 0, 2))
    def prefetch(self, base: tuple[int, ...], pages: list[int]) -> None:
        """A request arrives (a known prompt, or a next turn of one): prefetch from storage what memory
        lacks of it; a cached prefix becomes the prefetch's anchor."""
        self._do("prefetch", base + self._tokens(pages))

    def _refetch(self, tokens: tuple[int, ...], device: int, host: int) -> None:
        """Memory pressure: evict ``device`` then ``host`` pages at a time until ``tokens`` is no longer
        wholly in memory (or nothing more goes); then a request for ``tokens`` prefetches what is missing."""
        ps = self.adapter.page_size
        for _ in range(8):
            if len(self.adapter.read_kv(tokens)) < len(tokens):
                break
            freed = 0
            if self.adapter.supports("evict"):
                freed += self._do("evict", device * ps) or 0
                self.check()
            if self.adapter.supports("evict_host"):
                freed += self._do("evict_host", host * ps) or 0
                self.check()
            if not freed:
                break
        if len(self.adapter.read_kv(tokens)) < len(tokens):  # else nothing is missing: no prefetch
            self._do("prefetch", tokens)

    def _stored(self) -> list[tuple[int, ...]]:
        if self.adapter is None or not self.adapter.supports("stored_prefix"):
            return []
        return [p for p in self.seen + self.remote if self.adapter.stored_prefix(p)]

    @precondition(_supports("store_remote"))
    @rule(base=prompts, pages=prompt_pages(ALPHABET, 0, 2))
    def store_remote(self, base: tuple[int, ...], pages: list[int]) -> None:
        """Another engine instance sharing the storage tier backs a prompt (or a next turn of it) up."""
        tokens = base + self._tokens(pages)
        self._do("store_remote", tokens)
        if tokens not in self.remote and tokens not in self.seen:
            self.remote.append(tokens)

    @precondition(lambda self: bool(self._stored()))
    @rule(pick=st.integers(0, 15), device=st.integers(1, 3), host=st.integers(1, 3),
          script=st.lists(st.sampled_from(REQUEST_ACTIONS), max_size=3), query=st.sampled_from(REQUEST_ACTIONS))
    def refetch_stored(self, pick: int, device: int, host: int, script: list[str], query: str) -> None:
        """Memory pressure pushes prompts off the device and out of host memory, then a request for a prompt
        whose pages backups put in storage prefetches it (L3 -> L2 again). ``query`` then ``script`` is
        what happens to that request next: its storage step (the hit query, then the transfer) runs
        (``step``), fails (``fail``) or lands one page short (``partial``, a transfer only), the scheduler polls it (``ready``: once it ended, load back and
        insert), or it is aborted (``abort``)."""
        stored = self._stored()
        before = {r.id for r in self.adapter.prefetching()}
        self._refetch(stored[pick % len(stored)], device, host)
        new = [r.id for r in self.adapter.prefetching() if r.id not in before]
        if not new:
            return
        self._follow(new[0], [query, *script])

    @precondition(lambda self: self.adapter is not None and self.adapter.supports("store_remote")
                  and self.adapter.supports("prefetch"))
    @rule(base=prompts, pages=prompt_pages(ALPHABET, 1, 2),
          script=st.lists(st.sampled_from(REQUEST_ACTIONS), max_size=3))
    def remote_turn(self, base: tuple[int, ...], pages: list[int], script: list[str]) -> None:
        """Another instance stored the next turn of a cached prompt; a request for it prefetches that turn
        anchored at the cached prefix, and its hit query and transfer run before ``script`` (the fetched pages
        must hang under the anchor)."""
        tokens = base + self._tokens(pages)
        self._do("store_remote", tokens)
        if tokens not in self.remote and tokens not in self.seen:
            self.remote.append(tokens)
        before = {r.id for r in self.adapter.prefetching()}
        self._do("prefetch", tokens)
        new = [r.id for r in self.adapter.prefetching() if r.id not in before]
        if new:
            self._follow(new[0], ["step", "step", *script])

    def _follow(self, request: Any, script: Sequence[str]) -> None:
        for action in script:
            self.check()
            ids = [r.id for r in self.adapter.prefetching()]
            if request not in ids:
                return
            if action in ("step", "fail", "partial"):
                steps = self.adapter.storage_steps()
                kinds = ("s2h",) if action == "partial" else ("query", "s2h")
                mine = [i for i, s in enumerate(steps) if s.kind in kinds and s.detail[0] == request]
                if mine and action == "partial" and self.adapter.supports("partial_storage"):
                    self._do("partial_storage", mine[0])
                elif mine:
                    self._do("fail_storage" if action == "fail" else "complete_storage", mine[0])
            elif action == "ready":
                self._ready(ids.index(request))
            else:
                self._do("abort", ids.index(request))

    def _ready(self, i: int) -> None:
        tokens = tuple(self.adapter.prefetching()[i].detail)
        if self._do("prefetch_ready", i):  # the request runs: load its prefix back, insert its prompt
            self.check()
            if self.adapter.supports("load_back"):
                self._do("load_back", tokens)
                self.check()
            self._do("insert", tokens)
            self._remember(tokens)

    @precondition(lambda self: self.adapter is not None and self.adapter.supports("prefetch_ready")
                  and bool(self.adapter.prefetching()))
    @rule(pick=st.integers(0, 7))
    def prefetch_ready(self, pick: int) -> None:
        """The scheduler polls a prefetch; once it ended, the request loads its prefix back (read back after)."""
        self._ready(pick % len(self.adapter.prefetching()))

    @precondition(lambda self: self.adapter is not None and self.adapter.supports("abort")
                  and bool(self.adapter.prefetching()))
    @rule(pick=st.integers(0, 7))
    def abort(self, pick: int) -> None:
        self._do("abort", pick % len(self.adapter.prefetching()))

    @precondition(lambda self: self.adapter is not None and self.adapter.supports("complete_storage")
                  and bool(self.adapter.pending_jobs() or self.adapter.storage_steps()))
    @rule(order=st.permutations(range(8)), rounds=st.integers(1, 3), fail_at=st.none() | st.integers(0, 7))
    def catch_up(self, order: list[int], rounds: int, fail_at: int | None) -> None:
        """The executors and the storage threads catch up with the engine: every pending job completes,
        then every queued storage step runs (the ``fail_at``-th fails), ``rounds`` times (a backup
        follows its host copy's ack, a transfer its hit query)."""
        for r in range(rounds):
            if not (self.adapter.pending_jobs() or self.adapter.storage_steps()):
                return
            if self.adapter.pending_jobs():
                self.ack_round(order, 0)
            self.storage_round(order, 1, fail_at if r == 0 else None)

    @precondition(lambda self: self.adapter is not None and self.adapter.supports("storage_fault")
                  and bool(self.adapter.storage_steps()))
    @rule(fault=storage_faults(max_after=4))
    def storage_fault(self, fault: StorageFault) -> None:
        self._do("storage_fault", fault)

    @precondition(lambda self: self.adapter is not None and self.adapter.supports("complete_storage")
                  and bool(self.adapter.storage_steps()))
    @rule(pick=st.integers(0, 15), fail=st.sampled_from([False, False, False, True]))
    def storage_step(self, pick: int, fail: bool) -> None:
        """Run one queued storage step of the drawn position (hit query, transfer, backup, probe), or fail it."""
        op = "fail_storage" if fail and self.adapter.supports("fail_storage") else "complete_storage"
        self._do(op, pick % len(self.adapter.storage_steps()))

    @precondition(lambda self: self.adapter is not None and self.adapter.supports("partial_storage")
                  and bool(self.adapter.storage_steps()))
    @rule(pick=st.integers(0, 15))
    def partial_storage(self, pick: int) -> None:
        """Run one queued storage step whose backend answers one page short (a per-key partial result)."""
        self._do("partial_storage", pick % len(self.adapter.storage_steps()))

    @precondition(_supports("detach_storage"))
    @rule(attach_first=st.booleans(), fail=st.sampled_from([False, False, True]))
    def storage_link(self, attach_first: bool, fail: bool) -> None:
        """The operator detaches the storage tier (refused with transfers in flight) or attaches it again
        (``fail``: the attach fails and rolls back)."""
        if attach_first:
            self._do("attach_storage", fail)
        else:
            self._do("detach_storage")

    @precondition(lambda self: self.adapter is not None and self.adapter.supports("complete_storage")
                  and bool(self.adapter.storage_steps()))
    @rule(order=st.permutations(range(8)), rounds=st.integers(1, 3), fail_at=st.none() | st.integers(0, 7))
    def storage_round(self, order: list[int], rounds: int, fail_at: int | None = None) -> None:
        """Run every queued storage step in a drawn order, ``rounds`` times (a finished hit query queues
        its transfer for the next round); the ``fail_at``-th step run fails."""
        n = 0
        for _ in range(rounds):
            steps = self.adapter.storage_steps()
            if not steps:
                return
            ranked = sorted(range(len(steps)), key=lambda i: order[i % 8] + 8 * (i // 8))
            for step_id in [steps[i].id for i in ranked]:
                current = [s.id for s in self.adapter.storage_steps()]
                if step_id not in current:
                    continue
                fail = n == fail_at and self.adapter.supports("fail_storage")
                n += 1
                self._do("fail_storage" if fail else "complete_storage", current.index(step_id))
                self.check()


def protocol_test_case(factory: Callable[..., CacheAdapter], *, variants: Sequence[dict] = ({},), name: str = "CacheProtocol",
                  examples: int = 60, steps: int = 40, **settings_kw: Any):
    """A ``unittest.TestCase`` running the protocol machine against ``factory`` (collect it as a test class)."""
    machine = CacheProtocolMachine.bind(factory, variants=variants, name=name,
                                        settings=default_settings(examples, steps, **settings_kw))
    return machine.TestCase


def default_settings(examples: int = 60, steps: int = 40, **kw: Any) -> Settings:
    return Settings(max_examples=examples, stateful_step_count=steps, deadline=None,
                    suppress_health_check=list(HealthCheck), **kw)


# =========================================================================== HiCache binding

_MEMORY_VARIANTS: tuple[dict, ...] = tuple(  # pages of two tokens over two layers first: a token offset taken for
    # a page offset, or one layer's slots for another's, cannot show with one of each (shrinking tends to 0)
    {"write_policy": w, "eviction_policy": "lru", "device_pages": 3, "host_pages": 3, "page_size": 2, "layers": 2}
    for w in ("write_through", "write_back")
) + tuple(
    {"write_policy": w, "eviction_policy": e, "device_pages": d, "host_pages": h}
    for w in ("write_through", "write_back", "write_through_selective", "write_behind")
    for e, d, h in (("lru", 3, 3), ("lfu", 4, 2), ("lru", 2, 4), ("priority", 5, 5))
) + tuple(  # the recency families' shape: no backup due on insert, so every device node is a candidate at once
    {"write_policy": "write_through_selective", "eviction_policy": e, "device_pages": 3, "host_pages": 2}
    for e in ("lru", "lfu", "priority")
)
# the same shapes with an L3 tier (memory:// behind a FaultyBackend, run step by step), one prefetch stop
# policy per eviction policy: LRU ends prefetches whenever the scheduler asks (best_effort), LFU once the
# transfer ended (wait_complete), priority once it ended or timed out (timeout)
_STORAGE_VARIANTS: tuple[dict, ...] = tuple(
    dict(v, storage=True, host_pages=v["host_pages"] + 3,
         stop_policy={"lru": "best_effort", "lfu": "wait_complete"}.get(v["eviction_policy"], "timeout"))
    for v in _MEMORY_VARIANTS
)
# two tree namespaces (``testing.namespaces``): prompts starting with 1 and 2 are the same tokens as two
# tenants'. These, the layouts' and the options' come last, so a generated regression test whose variant number
# is below the old count keeps its meaning (a larger draw is taken modulo the count: its ``expect_variant`` guard
# says when to generate it again)
_NAMESPACE_VARIANTS: tuple[dict, ...] = tuple(  # write_through / LRU and write_back / LFU in memory;
    # write_through / LRU and write_behind / LFU with storage
    dict(v, namespaces=2) for v in (_MEMORY_VARIANTS[2], _MEMORY_VARIANTS[7], _STORAGE_VARIANTS[2],
                                    _STORAGE_VARIANTS[15]))
# the shapes with pages of two tokens over two layers on page_first hosts, whose copies index pages and layers
# each its own way
_LAYOUT_VARIANTS: tuple[dict, ...] = tuple(
    dict(v, host_layout=layout) for v in (_MEMORY_VARIANTS[0], _STORAGE_VARIANTS[1])
    for layout in ("page_first", "page_first_direct"))
# the config thresholds and budgets a default config leaves at rest (``option_families`` of ``check``): eviction
# headroom, load-back limits, a write_behind batch smaller than a two-page node (each also with storage but the
# limits), the selective threshold at one hit
_BATCH_OF_ONE = {"write_behind_batch_tokens": 1, "write_behind_idle_steps": 1}
_OPTION_VARIANTS: tuple[dict, ...] = (
    dict(_MEMORY_VARIANTS[2], eviction_headroom_tokens=1),
    dict(_MEMORY_VARIANTS[6], load_back_threshold=2, load_back_max_tokens=2),
    dict(_MEMORY_VARIANTS[14], **_BATCH_OF_ONE),
    dict(_MEMORY_VARIANTS[10], write_through_threshold=1),
    dict(_STORAGE_VARIANTS[2], eviction_headroom_tokens=1),
    dict(_STORAGE_VARIANTS[14], **_BATCH_OF_ONE),
)
# the storage tier's limits where they bind (``storage/prefetch_limits`` of ``check``: a prefetch below the threshold
# or over the capacity refused, a hit query in calls of one page), and another tenant's instance on the same
# storage writing other KV for the same tokens (``storage/foreign_tenant``)
_STORAGE_LIMIT_VARIANTS: tuple[dict, ...] = (
    dict(_STORAGE_VARIANTS[2], prefetch_threshold=2, prefetch_capacity_tokens=3, batch_pages=1),
    dict(_STORAGE_VARIANTS[1], remote_tenant="other"),
)
HICACHE_VARIANTS: tuple[dict, ...] = (_MEMORY_VARIANTS + _STORAGE_VARIANTS + _NAMESPACE_VARIANTS + _LAYOUT_VARIANTS
                                      + _OPTION_VARIANTS + _STORAGE_LIMIT_VARIANTS)


def _hicache(**kw: Any) -> CacheAdapter:
    from hicache_fsm.testing.protocol import ProtocolAdapter

    return ProtocolAdapter(**kw)


def hicache_machine(variants: Sequence[dict] = HICACHE_VARIANTS, coverage: CoverageTracker | None = None,
                    name: str = "HiCacheMachine", **settings_kw: Any) -> type[CacheProtocolMachine]:
    """The machine bound to ``HiCacheAdapter`` over tiny pools, drawing one of ``variants`` per run."""
    settings = default_settings(**settings_kw) if settings_kw else None
    return CacheProtocolMachine.bind(_hicache, variants=variants, name=name, coverage=coverage, settings=settings)


# CP layer writes: one and two ranks, two target layers and one draft layer, a host pool that outgrows a
# rank's device share, one just larger than a rank's share, one single-layer model (a write
# submits all its layers at once), and one rank whose write-through backups press on the host (its
# host holds one page more than its device: once a prompt filled the device and was backed up, a
# two-page prompt evicts it to host and finds one free host page, so its reservation fails and host
# KV is evicted for it); engine steps wait until the ranks agree on what is on the device and what
# has a host copy
CP_VARIANTS: tuple[dict, ...] = (
    {"world_size": 1, "device_pages": 2, "host_pages": 3, "write_policy": "write_back"},
    {"world_size": 2, "device_pages": 2, "host_pages": 3, "write_policy": "write_back"},
    {"world_size": 2, "device_pages": 2, "host_pages": 2, "write_policy": "write_back"},
    {"world_size": 2, "device_pages": 2, "host_pages": 3, "write_policy": "write_through", "layers": 1,
     "draft_layers": 0},
    {"world_size": 1, "device_pages": 2, "host_pages": 3, "write_policy": "write_through", "layers": 1,
     "draft_layers": 0},
)


def _cp(**kw: Any) -> CacheAdapter:
    from hicache_fsm.testing.cp import CPAdapter

    return CPAdapter(**kw)


def cp_machine(variants: Sequence[dict] = CP_VARIANTS, coverage: CoverageTracker | None = None,
               name: str = "CPMachine", **settings_kw: Any) -> type[CacheProtocolMachine]:
    """The machine bound to ``CPAdapter`` (``fuzz --cp``), drawing one of ``variants`` per run."""
    settings = default_settings(**settings_kw) if settings_kw else None
    return CacheProtocolMachine.bind(_cp, variants=variants, name=name, coverage=coverage, settings=settings,
                                     respect_applicable=True)


# =========================================================================== running outside pytest


def run_fuzz(machine: type[CacheProtocolMachine], *, examples: int = 100, steps: int = 40, seed: int = 0,
             progress: TextIO | None = None, shrink: bool = True, machine_import: str | None = None,
             wrap: str | None = None) -> FuzzResult:
    """Run ``machine`` like hypothesis would under pytest, outside pytest.

    Deterministic for a given ``seed``, whatever the process imported before
    (``fixed_draws``). On failure, ``steps`` holds the shrunk falsifying
    program and ``test_code`` a pytest test that replays it. A protocol machine
    first builds each variant (``VariantRefused`` / ``BrokenFactory``), and a run
    whose adapters accepted no insert fails as having checked nothing.
    """
    if not (isinstance(machine, type) and issubclass(machine, RuleBasedStateMachine)):
        raise ConfigError(f"run_fuzz runs a state machine class (hicache_machine(), cp_machine(), "
                          f"CacheProtocolMachine.bind(...), blockstore's store_machine(...)), got {machine!r}")
    check_positive_int("examples", examples)
    check_positive_int("steps", steps)
    if isinstance(seed, bool) or not isinstance(seed, int) or not -(1 << 63) <= seed < (1 << 63):
        raise ConfigError(f"seed must be a 64-bit int (the same seed, the same runs), got {seed!r:.40}")
    if issubclass(machine, CacheProtocolMachine):
        machine.build_each_variant()
    unchecked = getattr(machine, "UNCHECKED", None)  # why a run of this machine that changed nothing is no pass
    tally = Tally()
    count = [0]
    t0 = time.perf_counter()
    last = [t0]
    # A terminal gets a bar redrawn in place; a file or pipe gets a plain line now and then.
    live = progress is not None and progress.isatty()
    every = 0.5 if live else 10.0

    def factory() -> CacheProtocolMachine:
        count[0] += 1
        now = time.perf_counter()
        if progress is not None and (now - last[0] >= every or count[0] == 1):
            last[0] = now
            done = min(count[0], examples)
            if live:
                bar = "#" * (20 * done // max(1, examples))
                print(f"\rfuzz [{bar:<20}] {done}/{examples} examples, {now - t0:.1f}s", end="", file=progress,
                      flush=True)
            else:
                print(f"fuzz: {done}/{examples} examples, {now - t0:.1f}s", file=progress, flush=True)
        made = machine()
        if unchecked is not None:
            made.tally = tally
        return made

    def attempt(phases: list[Phase], lines: list[str]) -> BaseException | None:
        """One hypothesis run over ``phases`` from ``seed``; the failure it ends with, its report in ``lines``."""
        settings = Settings(max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
                            suppress_health_check=list(HealthCheck), phases=phases, print_blob=False,
                            verbosity=Verbosity.normal, report_multiple_bugs=False)
        test = hypothesis_seed(seed)(get_state_machine_test(factory, settings=settings))
        with with_reporter(lines.append):
            try:
                test()
            except BaseException as exc:
                if isinstance(exc, (KeyboardInterrupt, VariantRefused, BrokenFactory)):
                    raise
                lines.extend(getattr(exc, "__notes__", ()))
                return exc
        return None

    # Runs to the first failure are counted without shrinking (whose tries are runs too); the same seed
    # then finds that failure again and shrinks it.
    finding = [Phase.explicit, Phase.reuse, Phase.generate]
    lines: list[str] = []
    result = FuzzResult(True, 0, 0.0, seed)
    with without_local_constants():
        failure = attempt(finding, lines)
        runs = count[0]
        if failure is not None and shrink:
            shrunk: list[str] = []
            again = attempt([*finding, Phase.shrink], shrunk)
            if again is not None and failing_program(shrunk):  # a shrink that lost the program (flaky): the find
                failure, lines = again, shrunk
    if failure is not None:
        result.ok = False
        result.failure = f"{type(failure).__name__}: {failure}"
    if live:
        print(file=progress)
    # hypothesis builds a few machines it then discards (overruns): never count more runs than were asked
    result.examples = min(runs, examples)
    result.seconds = time.perf_counter() - t0
    if machine.coverage is not None:
        result.coverage = machine.coverage.report()
    if result.ok and unchecked is not None and not tally.changes:  # no failing program to show: nothing was checked
        result.ok = False
        result.checked_nothing = f"in {result.examples} runs {unchecked}"
        result.failure = f"checked nothing: {result.checked_nothing}"
    elif not result.ok and not failing_program(lines):  # nothing to replay: a test of no steps would not parse
        result.failure = (f"not reproducible: the same steps did not fail the same way twice, so there is no "
                          f"failing program or regression test to show (an adapter that depends on time, "
                          f"randomness or state outside it?)\n{result.failure}")
    elif not result.ok:
        result.steps = failing_program(lines)
        name = machine.__name__
        imp = machine_import or (f"from hicache_fsm.testing.stateful import hicache_machine\n"
                                 f"{name} = hicache_machine(name={name!r})")
        result.test_code = regression_test(result.steps, machine_import=imp, machine_name=name,
                                           failure=result.failure, wrap=wrap,
                                           variants=machine.variants if issubclass(machine, CacheProtocolMachine)
                                           else None)
    return result
