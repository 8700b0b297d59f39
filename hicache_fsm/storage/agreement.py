"""Agreement of the storage tier across tensor-parallel ranks (the ``storage`` section).

Each rank's storage threads see their own backend: one rank's hit query finds
fewer pages, one rank's transfer is slower or comes back short, one rank sees
storage go down. With a rank group the tier does not act on these events when
it drains them; it records them here, and at each step the group reduces,
with MIN (see ``hicache_fsm.tp``):

* storage health (unhealthy anywhere = unhealthy everywhere: no backups, no
  prefetch admission) and a clock (the least time elapsed on any rank), which
  times the prefetch ``timeout`` stop policy and backup retries, so those
  decisions are the same everywhere;
* per prefetch, in admission order: query started, the hit count (every rank
  fetches the same pages: the fewest any rank has), pages landed (what a
  terminated prefetch inserts), a short batch, and the end of the rank's
  transfer (only then may its release queue be freed).

Backup completion needs nothing here: H2S acks go through the cache's ack
agreement, so a page counts as stored only once every rank stored its shard.
"""

from __future__ import annotations

import time
from typing import Protocol, Sequence

import attrs

from hicache_fsm.storage.prefetch import PrefetchOp, PrefetchRuntime
from hicache_fsm.tp import digest

ELSEWHERE = "on another rank"


class AgreedTier(Protocol):
    """What the agreement acts on once every rank agreed: the tier's health and its prefetch events."""

    runtime: PrefetchRuntime
    healthy: bool

    def set_health(self, healthy: bool, error: str) -> None: ...

    def query_started(self, op: PrefetchOp) -> None: ...

    def query_answered(self, op: PrefetchOp, keys: tuple[str, ...]) -> None: ...

    def query_failed(self, op: PrefetchOp, error: str) -> None: ...

    def batch_landed(self, op: PrefetchOp, tokens: int, short: bool, error: str) -> None: ...


@attrs.define
class Seen:
    """What this rank's storage threads reported on one prefetch so far."""

    started: bool = False
    hits: int | None = None  # pages in a row that storage has; None until the query answered
    query_error: str = ""
    landed: int = 0  # tokens
    short: str = ""  # why a batch came back short ("" while none did)
    io_done: bool = False


class TierAgreement:
    """Holds this rank's storage observations and applies the group's MIN of them."""

    name = "storage"
    width = 5

    def __init__(self, tier: AgreedTier) -> None:
        self.tier = tier
        self.seen: dict[int, Seen] = {}  # id(op) -> observations
        self.local_health: tuple[bool, str] = (True, "")
        self._start = time.monotonic()
        self._now = 0.0
        self._window: list[PrefetchOp] = []

    def now(self) -> float:
        """The agreed clock: seconds since the tier started, as the slowest rank counts them."""
        return self._now

    def _seen(self, op: PrefetchOp) -> Seen:
        s = self.seen.get(id(op))
        if s is None:
            s = self.seen[id(op)] = Seen()
        return s

    # ------------------------------------------------------------------ this rank's observations

    def observe(self, event: tuple) -> None:
        """A drained thread event (not a job's end): remember it instead of acting on it."""
        kind = event[1]
        if kind == "health":
            self.local_health = (event[2], event[3])
            return
        op = event[2]
        s = self._seen(op)
        if kind == "query_start":
            s.started = True
        elif kind == "query_done":
            s.hits = len(event[3])
        elif kind == "query_failed":
            s.query_error = event[3] or "query failed"
        elif kind == "batch":
            tokens, short, error = event[3:]
            s.landed += tokens
            if short:
                s.short = error or "short batch"

    def transfer_ended(self, op: PrefetchOp) -> None:
        self._seen(op).io_done = True

    # ------------------------------------------------------------------ the section

    def collect(self) -> tuple[list[Sequence[int]], int]:
        healthy = self.local_health[0]
        items: list[Sequence[int]] = [(int(healthy), int((time.monotonic() - self._start) * 1e6), 0, 0, 0)]
        ops = self.tier.runtime.ops()
        self._window = ops
        for op in ops:
            s = self.seen.get(id(op)) or Seen()
            query = 0 if s.hits is None and not s.query_error else 1 if s.query_error else 2 + s.hits
            items.append((int(s.started), query, s.landed, 0 if s.short else 1, int(s.io_done)))
        return items, digest([(op.state, op.num_tokens) for op in ops])

    def apply(self, items: list[list[int]]) -> None:
        if not items:
            return
        tier = self.tier
        healthy, clock_us = items[0][0], items[0][1]
        self._now = clock_us / 1e6
        if bool(healthy) != tier.healthy:
            tier.set_health(bool(healthy), self.local_health[1] or f"storage failed {ELSEWHERE}")
        for op, item in zip(self._window, items[1:]):
            self._advance(op, *item)
        self._window = []
        live = {id(op) for op in tier.runtime.ops()}
        for key in [k for k in self.seen if k not in live]:
            del self.seen[key]

    def _advance(self, op: PrefetchOp, started: int, query: int, landed: int, not_short: int, io_done: int) -> None:
        tier, rt = self.tier, self.tier.runtime
        s = self.seen.get(id(op)) or Seen()
        if rt.active.get(op.request_id) is op:
            if op.state == "admitted" and started:
                tier.query_started(op)
            if op.state == "querying" and query == 1:
                tier.query_failed(op, s.query_error or f"hit query failed {ELSEWHERE}")
            elif op.state == "querying" and query >= 2:
                tier.query_answered(op, op.keys[: query - 2])
            if op.state == "transferring":
                gained = landed - op.completed_tokens
                ended_short = not not_short and io_done and landed < op.hit_tokens
                if gained > 0 or ended_short:
                    tier.batch_landed(op, max(0, gained), bool(ended_short), s.short or f"short batch {ELSEWHERE}")
        if io_done and op.io_active:
            rt.transfer_finished(op)

    def reset(self) -> None:
        self.seen.clear()
        self._window = []


__all__ = ["Seen", "TierAgreement"]
