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

from hicache_fsm.events.hashes import RecentTokens
from hicache_fsm.events.schema import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode, encode
from hicache_fsm.events.wire import CLEARED_EVENT, NIL, REMOVED_HEAD, STORED_HEAD, batch_bytes, int64_item, plain

F = TypeVar("F", bound=Callable)

# Records: (STORED, medium, chain, parent chain or None, packed key, lora_id, lora_name),
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

    __slots__ = ("ts", "data_parallel_rank", "page_size", "_records", "_rendered", "_payload", "_recent")

    def __init__(self, ts: float, records: list[tuple], data_parallel_rank: int | None, page_size: int,
                 recent: RecentTokens | None = None) -> None:
        self.ts = ts
        self.data_parallel_rank = data_parallel_rank
        self.page_size = page_size
        self._records: list[tuple] | None = records
        self._rendered: KVEventBatch | None = None
        self._payload: bytes | None = None
        self._recent = recent  # shared by a hook's batches, which one thread renders in order

    def render(self) -> KVEventBatch:
        """The batch as subscribers see it."""
        rendered = self._rendered
        if rendered is None:
            if self._records is None:  # already sent as bytes: read them back
                rendered = decode(self._payload)  # type: ignore[arg-type]
            else:
                ps, recent = self.page_size, self._recent or RecentTokens(1)
                events = [_event(r, ps, recent) for r in self._records]
                rendered = KVEventBatch(self.ts, events, self.data_parallel_rank)
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
                records = self._records or []
                pieces = _wire_pieces(records, self.page_size, self._recent or RecentTokens(1))
                payload = batch_bytes(self.ts, len(records), pieces, self.data_parallel_rank)
                self._records = self._recent = None  # the chains and token bytes are no longer held
            self._payload = payload
        return payload


def _event(record: tuple, page_size: int, recent: RecentTokens):
    kind = record[0]
    if kind == STORED:
        _, medium, chain, parent, raw, lora_id, lora_name = record
        return BlockStored(chain.int_keys(), None if parent is None else parent.last_int_key(), recent.ids(raw),
                           page_size, lora_id, medium, lora_name)
    if kind == REMOVED:
        return BlockRemoved(record[2].int_keys(), record[1])
    return AllBlocksCleared()


def _wire_pieces(records: list[tuple], page_size: int, recent: RecentTokens) -> list[bytes]:
    """The events of ``records`` as msgpack pieces (heads, hash and token lists, fields), in order."""
    pieces: list[bytes] = []
    add = pieces.extend
    for record in records:
        kind = record[0]
        if kind == STORED:
            _, medium, chain, parent, raw, lora_id, lora_name = record
            parent_hash = NIL if parent is None else int64_item(parent.last_digest())
            add((STORED_HEAD, chain.wire_keys(), parent_hash, recent.wire(raw), plain(page_size, lora_id, medium,
                                                                                       lora_name)))
        elif kind == REMOVED:
            add((REMOVED_HEAD, record[2].wire_keys(), plain(record[1])))
        else:
            pieces.append(CLEARED_EVENT)
    return pieces
