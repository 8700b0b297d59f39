"""Queued KV events as cheap records, rendered into a batch later, on any thread.

The hook on the serving thread records each event as a tuple of facts that
do not change afterwards (the node's :class:`~hicache_fsm.events.hashes.PageChain`,
its parent's, the packed bytes that are its key, the medium). Hashing the
pages and building the batch is the costly part, done once per batch:
:meth:`PendingBatch.payload` writes the msgpack bytes a publisher sends
(hash and token lists straight from bytes, :mod:`hicache_fsm.events.wire`),
:meth:`PendingBatch.render` the ``KVEventBatch`` of structs an in-process
sink reads. A sink marked with :func:`accepts_pending` (``ZmqEventPublisher.publish``)
receives the ``PendingBatch`` itself and renders it on its own thread, so the
serving thread pays only for the records; any other sink receives the
rendered ``KVEventBatch``.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from hicache_fsm.errors import StorageKeyError
from hicache_fsm.events.hashes import RecentSlices, span_tokens, span_wire_tokens
from hicache_fsm.events.schema import (
    AllBlocksCleared, BlockRemoved, BlockRemovedWire, BlockStored, BlockStoredWire, EventBatch, KVEventBatch, Raw,
    decode, encode)

F = TypeVar("F", bound=Callable)

# Records: (STORED, medium, chain, parent chain or None, key span, page size, lora_id, lora_name),
# (REMOVED, medium, chain), (CLEARED,).
STORED, REMOVED, CLEARED = 0, 1, 2
CLEARED_RECORD = (CLEARED,)


def accepts_pending(sink: F) -> F:
    """Mark ``sink`` as taking a :class:`PendingBatch` (it renders the batch off the serving thread)."""
    sink.accepts_pending = True  # type: ignore[attr-defined]
    return sink


def takes_pending(sink: Callable) -> bool:
    """Was ``sink`` (a function or bound method) marked by :func:`accepts_pending`?"""
    return getattr(sink, "accepts_pending", False) is True


class PendingBatch:
    """A batch of event records with its timestamp and rank, rendered once (as bytes or as structs)."""

    __slots__ = ("ts", "data_parallel_rank", "_records", "_rendered", "_payload", "_on_unhashable", "_recent")

    def __init__(self, ts: float, records: list[tuple], data_parallel_rank: int | None,
                 on_unhashable: Callable[[int], None], recent: RecentSlices | None = None) -> None:
        self.ts = ts
        self.data_parallel_rank = data_parallel_rank
        self._records: list[tuple] | None = records
        self._rendered: KVEventBatch | None = None
        self._payload: bytes | None = None
        self._on_unhashable = on_unhashable
        self._recent = recent  # shared by a hook's batches, which one thread renders in order

    def render(self) -> KVEventBatch:
        """The batch as subscribers see it; events whose tokens have no page key are left out (and counted)."""
        rendered = self._rendered
        if rendered is None:
            if self._records is None:  # already sent as bytes: read them back
                rendered = decode(self._payload)  # type: ignore[arg-type]
            else:
                rendered = KVEventBatch(self.ts, self._events(_event), self.data_parallel_rank)
                self._records = self._recent = None  # the chains and token bytes are no longer held
            self._rendered = rendered
        return rendered

    def payload(self) -> bytes:
        """The msgpack bytes of :meth:`render`'s batch, built without making its lists as Python ints."""
        payload = self._payload
        if payload is None:
            if self._rendered is not None:
                payload = encode(self._rendered)
            else:
                payload = encode(EventBatch(self.ts, self._events(_wire_event), self.data_parallel_rank))
                self._records = self._recent = None  # the chains and token bytes are no longer held
            self._payload = payload
        return payload

    def _events(self, make: Callable[[tuple, RecentSlices | None], object]) -> list:
        events, skipped = [], 0
        for record in self._records or ():
            try:
                events.append(make(record, self._recent))
            except StorageKeyError:  # token ids beyond 32 bits have no page key: no event
                skipped += 1
        if skipped:
            self._on_unhashable(skipped)
        return events


def _event(record: tuple, recent: RecentSlices | None):
    kind = record[0]
    if kind == STORED:
        _, medium, chain, parent, span, page_size, lora_id, lora_name = record
        return BlockStored(chain.int_keys(recent), None if parent is None else parent.last_int_key(recent),
                           span_tokens(span, recent), page_size, lora_id, medium, lora_name)
    if kind == REMOVED:
        return BlockRemoved(record[2].int_keys(recent), record[1])
    return AllBlocksCleared()


def _wire_event(record: tuple, recent: RecentSlices | None):
    kind = record[0]
    if kind == STORED:
        _, medium, chain, parent, span, page_size, lora_id, lora_name = record
        keys = chain.wire_keys(recent)  # first: a token id beyond 32 bits fails here
        tokens = recent.wire_tokens(span) if recent is not None else span_wire_tokens(span)
        return BlockStoredWire(Raw(keys), None if parent is None else parent.last_int_key(recent), Raw(tokens),
                               page_size, lora_id, medium, lora_name)
    if kind == REMOVED:
        return BlockRemovedWire(Raw(record[2].wire_keys(recent)), record[1])
    return AllBlocksCleared()
