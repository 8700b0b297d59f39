"""The KV event wire schema: msgspec structs with vLLM's field names and order.

A router written for vLLM or SGLang (NVIDIA Dynamo's KV router, vLLM's
production stack) decodes these batches unchanged: tagged unions of
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` in a
``KVEventBatch`` with a timestamp and a data-parallel rank, encoded as
msgpack arrays in field order (the layout of vLLM's structs declared
``array_like``, what routers read; the tag, the class name, comes first in
each event's array). ``decode`` also reads the map form newer vLLM and
SGLang publish (each event a map keyed by field name, its tag under
``"type"``), so a subscriber follows either engine. Block hashes are page keys in SGLang's int64 form
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


# what a decoder raises on bytes that are not a batch (RecursionError: a payload nested past the interpreter's stack)
UNREADABLE = (msgspec.MsgspecError, ValueError, TypeError, RecursionError)

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode(batch: EventBatch) -> bytes:
    """The msgpack bytes of ``batch``."""
    return _ENCODER.encode(batch)


def decode(payload: bytes) -> KVEventBatch:
    """One batch from its msgpack bytes, its events as arrays or as maps; ``msgspec.DecodeError`` /
    ``ValidationError`` (of the array form) if it is neither."""
    try:
        return _DECODER.decode(payload)
    except msgspec.ValidationError as array_error:
        raw = msgspec.msgpack.decode(payload)
        if not (isinstance(raw, list) and len(raw) >= 2 and isinstance(raw[1], list)):
            raise array_error from None
        raw[1] = [_as_array(e) for e in raw[1]]
        try:
            return msgspec.convert(raw, KVEventBatch)
        except msgspec.ValidationError:
            raise array_error from None


# The map form newer engines publish (vLLM since its structs dropped ``array_like``, SGLang likewise): each event a
# map keyed by field name, its class name under "type", with fields this schema lacks (``extra_keys``,
# ``group_idx``, the cache spec's kind), which are dropped.
_EVENT_TYPES = {cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}


def _as_array(event: object) -> object:
    """A map-form event in the array form the schema decodes: its tag, then its fields in the schema's order."""
    cls = _EVENT_TYPES.get(event.get("type")) if isinstance(event, dict) else None
    if cls is None:
        return event  # an array already, or no event of the schema: converting it says what is wrong
    fields = cls.__struct_fields__
    defaults = dict(zip(fields[len(fields) - len(cls.__struct_defaults__):], cls.__struct_defaults__))
    return [cls.__name__] + [event.get(name, defaults.get(name)) for name in fields]
