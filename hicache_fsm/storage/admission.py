"""Prefetch admission and its lifecycle on the scheduler's thread: admit, act on thread events, end.

``prefetch`` admits a request's prefetch (validates the match, pins or locks
its anchor, reserves host slots, queues the hit query); ``query_*`` and
``batch_landed`` move the op through the ``prefetch`` machine as the storage
threads' events arrive (agreed first with a rank group); ``prefetch_ready`` and
``abort_prefetch`` end it. ``StorageTier`` inherits these; the op's records
and the machine's runtime are in :mod:`hicache_fsm.storage.prefetch`.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Hashable
from typing import Any, Callable

from hicache_fsm.bindings.residency import ON_HOST
from hicache_fsm.errors import BadIndices
from hicache_fsm.interfaces import TierContext
from hicache_fsm.storage.keys import PageKeyChain
from hicache_fsm.storage.link import StorageLink
from hicache_fsm.storage.prefetch import PrefetchError, PrefetchOp, PrefetchRuntime
from hicache_fsm.tokens import ID_BYTES, TokenIds, pack_token_ids

log = logging.getLogger("hicache_fsm.storage.tier")


class PrefetchCalls:
    """The prefetch side of ``StorageTier`` (engine calls and thread events), on the scheduler's thread."""

    ctx: TierContext
    page_size: int
    link: StorageLink
    runtime: PrefetchRuntime
    agreement: Any  # TierAgreement, or None
    healthy: bool
    counters: Counter[str]
    _cv: threading.Condition
    _query_q: deque[tuple[int, PrefetchOp]]
    _gen: int
    _check_open: Callable[[], None]
    _drain: Callable[[], None]
    now: Callable[[], float]
    prior_key: Callable[..., str | None]
    _readable: Callable[[list[str], int], int]

    def query_started(self, op: PrefetchOp) -> None:
        if op.state == "admitted":
            self.runtime.fire(op, "start_query")

    def query_answered(self, op: PrefetchOp, keys: tuple[str, ...]) -> None:
        if op.state != "querying":
            return
        op.hit_keys = keys
        op.hit_tokens = len(keys) * self.page_size
        self.counters["prefetch_found_tokens"] += op.hit_tokens  # found, not yet a hit: hits are pages inserted
        t = self.runtime.fire(op, "query_done")
        if t.dest == "revoked":
            self.counters["prefetch_revoked"] += 1
            log.info("prefetch %r revoked: %d hit tokens < threshold %d", op.request_id, op.hit_tokens,
                     self.runtime.threshold_tokens)
            self.runtime.release(op)

    def query_failed(self, op: PrefetchOp, error: str) -> None:
        if op.state != "querying":
            return
        op.error = error
        self.counters["prefetch_query_failures"] += 1
        log.warning("prefetch %r: storage hit query failed: %s", op.request_id, error)
        self.runtime.fire(op, "query_failed")
        self.runtime.release(op)

    def batch_landed(self, op: PrefetchOp, tokens: int, short: bool, error: str) -> None:
        if op.state != "transferring":
            return
        op.completed_tokens += tokens
        self.counters["prefetch_fetched_tokens"] += tokens
        if short:
            op.error = error
            self.counters["prefetch_short_batches"] += 1
            log.warning("prefetch %r: batch came back short after %d of %d tokens: %s", op.request_id,
                        op.completed_tokens, op.hit_tokens, error or "miss or corrupt page")
            self.runtime.fire(op, "batch_short")
        else:
            self.runtime.fire(op, "batch_done")

    def prefetch(self, request_id: Hashable, tokens: Any, match: Any, namespace: Hashable = None) -> bool:
        """Admit a prefetch of the tokens after ``match``'s in-memory hit; False when not admitted."""
        from hicache_fsm.results import MatchResult

        self._check_open()
        tokens = pack_token_ids(tokens)  # checked once; compared and hashed packed
        if not isinstance(match, MatchResult):
            raise BadIndices(f"prefetch wants the MatchResult of match_prefix, got {type(match).__name__}")
        check_request_id(request_id)
        rt = self.runtime
        if request_id in rt.active:  # before the drain: a refusal applies nothing, whatever the threads did meanwhile
            raise PrefetchError(f"request {request_id!r} already has a prefetch running "
                                "(until prefetch_ready says True or abort_prefetch ends it)")
        self._drain()
        ctx = self.ctx
        tree = ctx.tree
        anchor = match.last_host_node
        if not (anchor is tree.root or tree.owns(anchor)):
            raise BadIndices("the MatchResult is stale: its last node left the tree")
        if not anchor.is_root:
            if namespace is not None and namespace != anchor.namespace:
                raise BadIndices(f"namespace {namespace!r} does not match the matched prefix's {anchor.namespace!r}")
            namespace = anchor.namespace
        start = match.device_hit_length + match.host_hit_length
        prefix = tree.prefix_ids(anchor)
        if len(prefix) != start or tokens.raw[: start * ID_BYTES] != prefix.raw:
            raise BadIndices("the MatchResult does not belong to these tokens (or is stale)")
        ps = self.page_size
        want_ids = TokenIds(tokens.raw[start * ID_BYTES: (len(tokens) - len(tokens) % ps) * ID_BYTES])
        if self.link.state != "attached":
            return self._reject("detached")
        if not self.healthy:
            return self._reject("unhealthy")
        need = len(want_ids)
        if need == 0 or need < rt.threshold_tokens:
            return self._reject("below_threshold")
        if rt.occupied_tokens + need > rt.capacity_tokens:
            return self._reject("capacity")
        prior = self.prior_key(anchor, namespace)
        keys = PageKeyChain(want_ids, ps, prior)  # hashed as the hit query reads them (it stops at a miss)
        self.remember_chain(keys)
        if self._readable([keys[0]], 1) == 0:  # its first page was stored in a format this pool cannot read
            return self._reject("format_mismatch")
        if anchor.is_root:
            pin = None
        elif anchor.state in ON_HOST:
            pin = "host"
            ctx.pin_host(anchor)
        else:
            pin = "lock"
            ctx.lock(anchor)
        host = ctx.host_allocator
        slots = host.alloc(need)
        if slots is None:
            ctx.evict_host(need - host.available_tokens)
            slots = host.alloc(need)
        if slots is None:
            if pin == "host":
                ctx.unpin_host(anchor)
            elif pin == "lock":
                ctx.unlock(anchor)
            return self._reject("host_full")
        op = PrefetchOp(request_id, want_ids, keys, anchor, pin, namespace, slots, ps,
                        self._gen, self.now(), agreed=self.agreement is not None)
        rt.active[request_id] = op
        rt.occupied_tokens += need
        self.counters["prefetch_admitted"] += 1
        self.counters["prefetch_requested_tokens"] += need
        with self._cv:
            self._query_q.append((self._gen, op))
            self._cv.notify_all()
        return True

    def _reject(self, reason: str) -> bool:
        self.counters[f"prefetch_rejected_{reason}"] += 1
        return False

    def prefetch_ready(self, request_id: Hashable) -> bool:
        """Scheduler's per-step check: True once the request may proceed (the prefetch ended and was released)."""
        self._check_open()
        check_request_id(request_id)
        self._drain()
        rt = self.runtime
        op = rt.active.get(request_id)
        if op is None:
            return True
        if op.state in ("failed", "revoked", "aborted", "terminated"):
            rt.release(op)
            return True
        if not rt.machine.can_fire(op, "stop", rt):
            return False
        rt.fire(op, "stop")
        self._count_outcome(op)
        rt.release(op)
        return True

    def _count_outcome(self, op: PrefetchOp) -> None:
        if op.hit_tokens and op.completed_tokens >= op.hit_tokens:
            self.counters["prefetch_completed"] += 1
        elif op.completed_tokens:
            self.counters["prefetch_partial"] += 1
        else:
            self.counters["prefetch_empty"] += 1

    def abort_prefetch(self, request_id: Hashable) -> bool:
        """The request was aborted: end its prefetch and release everything; False if it had none."""
        self._check_open()
        check_request_id(request_id)
        self._drain()
        rt = self.runtime
        op = rt.active.get(request_id)
        if op is None:
            return False
        rt.fire(op, "abort")
        self.counters["prefetch_aborted"] += 1
        rt.release(op)
        return True


def check_request_id(request_id: object) -> None:
    """A prefetch's request id must be hashable (it keys the running prefetches): ``BadIndices`` otherwise."""
    try:
        hash(request_id)
    except TypeError:
        raise BadIndices(f"request ids must be hashable, got {type(request_id).__name__}") from None


__all__ = ["PrefetchCalls"]
