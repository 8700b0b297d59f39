"""Prefetch of one request's KV pages from storage (L3) into host memory (L2).

Theory of operation. ``PrefetchRuntime`` is the context of the ``prefetch``
machine (``specs/prefetch.yaml``); each request's ``PrefetchOp`` moves through
it only on the scheduler's thread. Storage threads never fire a trigger: the
query thread reports hits, the I/O thread fills reserved host pages and counts
what landed (``add_landed``), and both post events that the tier turns into
``start_query`` / ``query_done`` / ``batch_done`` / ... when it drains them.

Slots. Admission reserves the host slots for every requested page. Each
reserved page leaves the op exactly once, either into the tree (a fetched page
inserted as a host-only node) or back to the allocator (not hit, not fetched,
or already cached). Pages a storage thread may still write are not freed at
once: they wait in the op's release queue until its transfer job has finished.
``completed_tokens`` only grows while the op is not terminated, and a page is
counted only after its bytes landed, so what ``stop`` inserts is final.

Anchor. The node the fetched pages hang under is protected for the whole
prefetch: its host copy is pinned (``pin_host``); a device-only anchor (no host
copy yet) is locked on the device instead; the root needs nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING

import torch

from hicache_fsm.errors import HiCacheError
from hicache_fsm.jobs import JobKind, TransferJob
from hicache_fsm.machine import compile_machine
from hicache_fsm.slots import page_ids as slot_page_ids
from hicache_fsm.spec import load_builtin
from hicache_fsm.storage.options import TierOptions
from hicache_fsm.tokens import TokenIds

if TYPE_CHECKING:  # pragma: no cover
    from hicache_fsm.interfaces import TierContext
    from hicache_fsm.radix import TreeNode

log = logging.getLogger("hicache_fsm.storage.tier")

_EMPTY = torch.empty(0, dtype=torch.int64)
# states in which a storage thread may still pick the op up or report on it
THREAD_STATES = frozenset({"admitted", "querying", "transferring"})
ENDED = frozenset({"completed", "partial"})


class PrefetchError(HiCacheError):
    """A prefetch call was out of protocol (duplicate request id, ...)."""


class PrefetchOp:
    """One request's prefetch; ``state`` is moved by the ``prefetch`` machine only."""

    def __init__(self, request_id: Hashable, tokens: TokenIds, keys: Sequence[str], anchor: TreeNode,
                 anchor_pin: str | None, namespace: Hashable, host_indices: torch.Tensor, page_size: int,
                 gen: int, start_time: float, agreed: bool = False) -> None:
        self.state = "admitted"
        self.request_id = request_id
        self.tokens = tokens  # the tokens to fetch (after the in-memory hit), whole pages, packed
        self.anchor = anchor
        self.anchor_pin = anchor_pin  # "host", "lock" or None (root)
        self.anchor_pinned = anchor_pin is not None
        self.keys = keys  # chained storage key of every page of ``tokens`` (a PageKeyChain: hashed when read)
        self.namespace = namespace
        self.page_size = page_size
        self.gen = gen
        self.host_indices = host_indices  # slots this op still holds (a prefix of what it reserved)
        self.deferred: list[torch.Tensor] = []  # release queue: freed when the transfer job ends
        self.reserved_pages = set(page_ids(host_indices, page_size))
        self.inserted_pages: set[int] = set()
        self.freed_pages: Counter[int] = Counter()
        self.hit_keys: tuple[str, ...] = ()
        self.hit_tokens = 0
        self.completed_tokens = 0
        self.landed_tokens = 0  # written by the I/O thread under ``_lock``
        self.inserted_tokens = 0
        self.job: TransferJob | None = None
        self.io_active = False
        self.start_time = start_time  # on the runtime's clock
        self.agreed = agreed  # a rank group sets completed_tokens to what every rank landed
        self.error = ""
        self.storage_lost = False  # the backend lost pages since this op began: what it fetched may be gone there
        self._lock = threading.Lock()
        self._terminated = False

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def terminated(self) -> bool:
        return self._terminated

    def add_landed(self, num_tokens: int) -> bool:
        """I/O thread: ``num_tokens`` more arrived; refused (False) once terminated."""
        with self._lock:
            if self._terminated:
                return False
            self.landed_tokens += num_tokens
            return True

    def mark_terminated(self) -> None:
        """Freeze the op: no later page counts; ``completed_tokens`` is what landed."""
        with self._lock:
            self._terminated = True
            if not self.agreed:
                self.completed_tokens = self.landed_tokens

    def fork(self, anchor: TreeNode) -> "PrefetchOp":
        """An independent copy hanging under ``anchor`` (the anchor's copy in a forked tree)."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.anchor = anchor
        new.deferred = list(self.deferred)
        new.reserved_pages = set(self.reserved_pages)
        new.inserted_pages = set(self.inserted_pages)
        new.freed_pages = Counter(self.freed_pages)
        new._lock = threading.Lock()
        return new

    def held_tokens(self) -> int:
        return int(self.host_indices.numel()) + sum(int(t.numel()) for t in self.deferred)

    def __repr__(self) -> str:
        return (f"PrefetchOp({self.request_id!r}, {self.state}, tokens={self.num_tokens}, hit={self.hit_tokens}, "
                f"completed={self.completed_tokens})")


def page_ids(indices: torch.Tensor | None, page_size: int) -> list[int]:
    """Page ids of page-aligned host slot indices (none for None)."""
    return [] if indices is None else slot_page_ids(indices, page_size)


INSERT_EFFECT = "insert_fetched"  # the one effect of the prefetch spec that may insert fetched pages


class PrefetchRuntime:
    """Owner of every running prefetch and context of the ``prefetch`` machine."""

    def __init__(self, ctx: TierContext, submit_transfer: Callable[[PrefetchOp, TransferJob], None],
                 store_again: Callable[[], None]) -> None:
        self.ctx = ctx  # the tier's: tree, driver, host pool and allocator, unpin / unlock
        self.store_again = store_again  # the tier's: back up unstored nodes at the next poll
        self.page_size = ctx.page_size
        self.machine = compile_machine(load_builtin("prefetch"))
        self.options = TierOptions()
        self._submit_transfer = submit_transfer
        self.active: dict[Hashable, PrefetchOp] = {}  # admitted, not yet released
        self.draining: dict[int, PrefetchOp] = {}  # released, transfer job still running (by job id)
        self.occupied_tokens = 0
        self.counters: Counter[str] = Counter()
        self._violations: list[str] = []
        self.clock: Callable[[], float] = time.monotonic  # the tier's agreed clock with a rank group

    # ------------------------------------------------------------------ configuration

    def configure(self, options: TierOptions) -> None:
        self.options = options

    @property
    def threshold_tokens(self) -> int:
        return max(self.options.prefetch_threshold, self.page_size)

    @property
    def capacity_tokens(self) -> int:
        cap = self.options.prefetch_capacity_tokens
        if cap is None:
            cap = int(0.8 * self.ctx.host_pool.size_tokens)
        return cap - cap % self.page_size

    def timeout_for(self, op: PrefetchOp) -> float:
        o = self.options
        tokens = op.hit_tokens if op.hit_tokens else op.num_tokens
        return min(o.timeout_base + o.timeout_per_1k_tokens * tokens / 1024.0, o.timeout_max)

    # ------------------------------------------------------------------ machine

    def fire(self, op: PrefetchOp, trigger: str):
        """Fire ``trigger`` on ``op``; a transition whose spec declares no ``insert_fetched`` inserts nothing.

        The spec's promise that a revoked, failed or aborted prefetch inserts
        nothing is checked as it runs: tokens inserted under any other
        transition are a violation (the explorer and the fuzzer report it).
        """
        inserted = op.inserted_tokens
        transition = self.machine.fire(op, trigger, self)
        if op.inserted_tokens != inserted and INSERT_EFFECT not in transition.spec.effects:
            self._violations.append(f"prefetch {op.request_id!r}: {trigger} from {transition.source} inserted "
                                    f"{op.inserted_tokens - inserted} tokens; its spec declares no {INSERT_EFFECT}")
        for kind in transition.emits:
            if kind is JobKind.S2H:
                self._start_transfer(op)
        return transition

    def _start_transfer(self, op: PrefetchOp) -> None:
        job = TransferJob(JobKind.S2H, (), op.host_indices, keys=op.hit_keys)
        op.job = job
        op.io_active = True
        self._submit_transfer(op, job)

    # guards / effects (bindings/prefetch.py calls these)

    def stop_allowed(self, op: PrefetchOp) -> bool:
        policy = self.options.stop_policy
        if policy == "best_effort":
            return True
        if op.state in ENDED:
            return True
        if policy == "timeout":
            return self.clock() - op.start_time > self.timeout_for(op)
        return False

    def storage_lost(self) -> None:
        """The backend lost pages (a new data epoch, a check that found keys missing): every running prefetch
        may have fetched some of them, so what it inserts is inserted as not stored, to be backed up again."""
        for op in self.active.values():
            op.storage_lost = True

    def trim_to_hits(self, op: PrefetchOp) -> None:
        hit = op.hit_tokens
        extra = op.host_indices[hit:]
        op.host_indices = op.host_indices[:hit]
        self._free(op, extra)
        self.counters["prefetch_trimmed_tokens"] += int(extra.numel())

    def insert_fetched(self, op: PrefetchOp) -> None:
        """Fetched pages become host-only nodes under the anchor; pages the tree already has are freed."""
        done = op.completed_tokens - op.completed_tokens % self.page_size
        done = min(done, int(op.host_indices.numel()))
        if done <= 0:
            return
        slots, op.host_indices = op.host_indices[:done], op.host_indices[done:]
        ctx = self.ctx
        tree = ctx.tree
        driver = ctx.driver
        anchor = op.anchor
        if not (anchor.is_root or tree.owns(anchor)):  # cannot happen while the anchor is pinned
            log.error("prefetch %r: anchor node %d left the tree; dropping %d fetched tokens",
                      op.request_id, anchor.id, done)
            self._free(op, slots)
            return
        prefix = tree.prefix_ids(anchor)
        full = TokenIds(prefix.raw + op.tokens[:done].raw)
        path, matched = driver.walk_splitting(full, op.namespace)
        start = len(prefix)
        if matched < start:  # defensive: the anchor is on every path of its own prefix
            log.error("prefetch %r: prefix walk stopped above the anchor; dropping fetched pages", op.request_id)
            self._free(op, slots)
            return
        dup = matched - start
        if dup:
            self._free(op, slots[:dup])
            self.counters["prefetch_duplicate_tokens"] += dup
        if matched < len(full):
            parent = path[-1] if path else tree.root
            node = driver.add_child(parent, full, op.namespace, matched)
            fetched = slots[dup:]
            node.host_indices = fetched
            first_page = dup // self.page_size
            node.storage_keys = tuple(op.hit_keys[first_page: done // self.page_size])
            driver.touch(node)
            driver.fire(node, "insert_prefetched")
            if op.storage_lost:  # fetched before the backend lost pages: not known to be stored any more
                driver.fire(node, "storage_lost")
                self.counters["prefetch_unstored_tokens"] += node.num_tokens
                self.store_again()
            op.inserted_pages.update(page_ids(fetched, self.page_size))  # the node's pages, not re-expanded
            self.occupied_tokens -= node.num_tokens
            op.inserted_tokens += node.num_tokens
            self.counters["prefetch_inserted_tokens"] += node.num_tokens
            self.counters["prefetch_hit_tokens"] += node.num_tokens  # a hit is a page the tree got, never one asked for

    def release_unused(self, op: PrefetchOp) -> None:
        rest, op.host_indices = op.host_indices, _EMPTY
        if not rest.numel():
            return
        if op.io_active:  # a storage thread may still write these pages: release when its job ends
            op.deferred.append(rest)
        else:
            self._free(op, rest)

    def unpin_anchor(self, op: PrefetchOp) -> None:
        if not op.anchor_pinned:
            return
        op.anchor_pinned = False
        anchor = op.anchor
        if not self.ctx.tree.owns(anchor):
            log.error("prefetch %r: anchor node %d left the tree while pinned", op.request_id, anchor.id)
            return
        held = anchor.host_ref if op.anchor_pin == "host" else anchor.lock_ref
        if held <= 0:  # someone else released our pin: report it, never go below zero
            self._violations.append(f"prefetch {op.request_id!r}: anchor node {anchor.id} lost its pin early")
        elif op.anchor_pin == "host":
            self.ctx.unpin_host(anchor)
        else:
            self.ctx.unlock(anchor)

    def _free(self, op: PrefetchOp, indices: torch.Tensor) -> None:
        if indices is None or not indices.numel():
            return
        pages = page_ids(indices, self.page_size)
        given = set(pages)
        if not given <= op.reserved_pages or not given.isdisjoint(op.inserted_pages) \
                or not given.isdisjoint(op.freed_pages):  # never hand a page back twice (the upstream double free)
            again = [p for p in pages if op.freed_pages[p] or p in op.inserted_pages or p not in op.reserved_pages]
            self._violations.append(f"prefetch {op.request_id!r} tried to release pages {again[:8]} twice")
            return
        self.ctx.host_allocator.free(indices)
        op.freed_pages.update(pages)
        self.occupied_tokens -= int(indices.numel())
        self.counters["prefetch_released_tokens"] += int(indices.numel())

    # ------------------------------------------------------------------ events from the tier

    def transfer_finished(self, op: PrefetchOp) -> None:
        """The op's transfer job ended: the I/O thread is done with its pages."""
        op.io_active = False
        deferred, op.deferred = op.deferred, []
        for t in deferred:
            self._free(op, t)
        if op.job is not None:
            self.draining.pop(op.job.id, None)
        if op.state == "released":
            self._check_done(op)

    def release(self, op: PrefetchOp) -> None:
        """Fire ``release`` (insert what arrived, release the rest, unpin) and forget the op."""
        self.fire(op, "release")
        self.active.pop(op.request_id, None)
        if op.io_active and op.job is not None:
            self.draining[op.job.id] = op
        else:
            self._check_done(op)

    def _check_done(self, op: PrefetchOp) -> None:
        freed, inserted, reserved = op.freed_pages.keys(), op.inserted_pages, op.reserved_pages
        # ``_free`` keeps freed pages reserved ones: disjoint reserved inserted pages that fill the rest account for all
        if len(freed) + len(inserted) == len(reserved) and inserted <= reserved and inserted.isdisjoint(freed):
            return
        accounted = set(op.freed_pages) | op.inserted_pages
        if accounted != op.reserved_pages:
            missing = sorted(op.reserved_pages - accounted)[:8]
            self._violations.append(f"prefetch {op.request_id!r} ended holding pages {missing} (leak)")

    # ------------------------------------------------------------------ invariants

    def ops(self) -> list[PrefetchOp]:
        """Running prefetches in admission order, then released ones whose transfer still runs."""
        return list(self.active.values()) + list(self.draining.values())

    @property
    def violation_count(self) -> int:
        """Protocol violations recorded as they happened (leaks, early unpins), for the explorer's state."""
        return len(self._violations)

    def slot_release_violations(self) -> list[str]:
        problems = list(self._violations)
        for op in self.ops():
            both = set(op.freed_pages) & op.inserted_pages
            if both:
                problems.append(f"prefetch {op.request_id!r}: pages {sorted(both)[:8]} both inserted and freed")
            twice = [p for p, n in op.freed_pages.items() if n > 1]
            if twice:
                problems.append(f"prefetch {op.request_id!r}: pages {twice[:8]} freed twice")
            held = set(page_ids(op.host_indices, self.page_size))
            for t in op.deferred:
                held.update(page_ids(t, self.page_size))
            if held & (set(op.freed_pages) | op.inserted_pages):
                problems.append(f"prefetch {op.request_id!r} still holds pages it released")
            if held | set(op.freed_pages) | op.inserted_pages != op.reserved_pages:
                problems.append(f"prefetch {op.request_id!r}: reserved pages are not all accounted for")
            if op.deferred and not op.io_active:
                problems.append(f"prefetch {op.request_id!r}: release queue waits on a transfer that ended")
        return problems

    def anchor_pin_violations(self) -> list[str]:
        problems = []
        tree = self.ctx.tree
        for op in self.active.values():
            anchor = op.anchor
            if anchor.is_root:
                continue
            if not tree.owns(anchor):
                problems.append(f"prefetch {op.request_id!r}: anchor node {anchor.id} left the tree")
            elif not op.anchor_pinned:
                problems.append(f"prefetch {op.request_id!r}: anchor node {anchor.id} is not pinned")
            elif op.anchor_pin == "host" and anchor.host_ref <= 0:
                problems.append(f"prefetch {op.request_id!r}: anchor node {anchor.id} host copy unpinned")
            elif op.anchor_pin == "lock" and anchor.lock_ref <= 0:
                problems.append(f"prefetch {op.request_id!r}: anchor node {anchor.id} unlocked")
        for op in self.draining.values():
            if op.anchor_pinned:
                problems.append(f"released prefetch {op.request_id!r} still pins its anchor")
        return problems

    def capacity_violations(self) -> list[str]:
        held = sum(op.held_tokens() for op in self.ops())
        problems = []
        if held != self.occupied_tokens:
            problems.append(f"prefetches hold {held} host tokens but the counter says {self.occupied_tokens}")
        if held > self.capacity_tokens:
            problems.append(f"prefetches hold {held} host tokens, over the capacity of {self.capacity_tokens}")
        return problems

    def violations(self) -> list[str]:
        reg = self.machine.registry
        out = []
        for name in self.machine.spec.invariants:
            out += [f"{name}: {p}" for p in reg.invariants[name](self)]
        return out

    def host_owners(self):
        for op in self.ops():
            if op.host_indices.numel():
                yield f"prefetch {op.request_id!r}", op.host_indices
            for i, t in enumerate(op.deferred):
                yield f"prefetch {op.request_id!r} release queue {i}", t

    # ------------------------------------------------------------------ lifecycle

    def fork(self, ctx: TierContext, submit_transfer: Callable[[PrefetchOp, TransferJob], None],
             store_again: Callable[[], None], op_of: Callable[[PrefetchOp], PrefetchOp]) -> "PrefetchRuntime":
        """A copy for the forked cache of ``ctx``; ``op_of`` maps an op to its copy (shared with the tier's queues)."""
        new = PrefetchRuntime(ctx, submit_transfer, store_again)
        new.machine = self.machine
        new.options = self.options
        new.active = {k: op_of(op) for k, op in self.active.items()}
        new.draining = {k: op_of(op) for k, op in self.draining.items()}
        new.occupied_tokens = self.occupied_tokens
        new.counters = Counter(self.counters)
        new._violations = list(self._violations)
        return new

    def clear(self) -> None:
        """Forget every op (the cache is resetting its pools and tree)."""
        self.active.clear()
        self.draining.clear()
        self.occupied_tokens = 0
        self._violations.clear()


__all__ = ["ENDED", "THREAD_STATES", "PrefetchError", "PrefetchOp", "PrefetchRuntime", "page_ids"]
