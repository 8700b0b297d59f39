"""Checks of the arguments the KV event parts are built with, made before any socket or thread exists.

A wrong one (an endpoint that is not a string, a rank of ``-1``, a negative
wait) is a ``ConfigError`` naming it, not an ``AttributeError`` from deep in
``zmq``, a value published to every router, or a ``poll`` that never returns.
"""

from __future__ import annotations

from hicache_fsm.config import MAX_SECONDS, check_positive_int
from hicache_fsm.errors import ConfigError


def check_text(name: str, value: object, *, optional: bool = False) -> None:
    """``value`` is a str with a UTF-8 form (or None when ``optional``): an endpoint or a topic, handed to zmq."""
    if not isinstance(value, str) and not (optional and value is None):
        raise ConfigError(f"{name} must be a str{' or None' if optional else ''}, got {value!r}")
    if value is not None:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError(f"{name} has no UTF-8 form (a lone surrogate?): {value!r:.80}") from None


MAX_RANK = (1 << 63) - 1  # a rank goes out as a msgpack int: one that no int64 holds could not be sent


def check_rank(value: object) -> None:
    """A data-parallel rank is None or an int from 0 to ``MAX_RANK``: batches carry it to every router."""
    if value is not None:
        check_positive_int("data_parallel_rank", value, minimum=0)
        if value > MAX_RANK:
            raise ConfigError(f"data_parallel_rank must be at most {MAX_RANK}, got {value}")


MAX_WAIT_MS = int(MAX_SECONDS * 1000)  # the longest wait a thread takes (zmq overflowed on 2**63 ms)


def check_wait_ms(name: str, value: object) -> int:
    """A wait in milliseconds is an int >= 0 (``zmq`` reads a negative one as forever) and at most ``MAX_WAIT_MS``."""
    check_positive_int(name, value, minimum=0)
    if value > MAX_WAIT_MS:  # type: ignore[operator]
        raise ConfigError(f"{name} must be at most {MAX_WAIT_MS} ms, got {value!r}")
    return value  # type: ignore[return-value]


def topic_bytes(topic: object) -> bytes:
    """A topic as the UTF-8 bytes ZMQ matches on; a str that has no UTF-8 form (a lone surrogate) is refused too."""
    check_text("topic", topic)
    try:
        return topic.encode("utf-8")  # type: ignore[union-attr]
    except UnicodeEncodeError:
        raise ConfigError(f"topic must be encodable as UTF-8, got {topic!r}") from None
