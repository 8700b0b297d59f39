"""The KV event wire schema: msgspec structs with vLLM's field names and order.

A router written for vLLM or SGLang (NVIDIA Dynamo's KV router, vLLM's
production stack) decodes these batches unchanged: tagged unions of
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` in a
``KVEventBatch`` with a timestamp and a data-parallel rank, encoded as
msgpack arrays in field order (vLLM declares its structs ``array_like``; the
tag, the class name, comes first in each event's array). Block hashes are page keys in SGLang's int64 form
(:func:`hicache_fsm.events.hashes.int64_hash`); ``medium`` names the tier
(see :data:`hicache_fsm.events.names.MEDIUMS`).
"""

from __future__ import annotations

from typing import Any, Union

try:
    import msgspec
except ModuleNotFoundError as exc:  # an optional dependency: say which extra brings it
    from hicache_fsm.errors import MissingExtra

    raise MissingExtra("KV events", "msgspec", "events") from exc


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    """Events published together, with when and by which data-parallel rank (vLLM's base class)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base of every KV cache event (the tag is the class name)."""


class BlockStored(KVCacheEvent):
    """Pages became readable in ``medium``: their hashes, the hash before the first, their tokens."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent):
    """Pages stopped being readable in ``medium``."""

    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """Everything the publisher held is gone (a cache reset), in every medium."""


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


UNREADABLE = (msgspec.MsgspecError, ValueError, TypeError)  # what a decoder raises on bytes that are not a batch

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode(batch: EventBatch) -> bytes:
    """The msgpack bytes of ``batch``."""
    return _ENCODER.encode(batch)


def decode(payload: bytes) -> KVEventBatch:
    """One batch from its msgpack bytes; ``msgspec.DecodeError`` / ``ValidationError`` if malformed."""
    return _DECODER.decode(payload)
