"""Receive KV event batches from a publisher, in sequence order, filling gaps by replay.

``ZmqEventSubscriber.receive`` returns the batches that arrived, numbered and
in order. A sequence number beyond the next expected one means batches were
dropped (the publisher's queue was full, or the PUB socket's high-water mark
was hit): the subscriber asks the replay socket for them first. Batches gone
from the publisher's replay buffer too are counted in ``lost`` (a consumer
then rebuilds from a fresh snapshot). No thread: the caller polls.
"""

from __future__ import annotations

from typing import Callable

try:
    import msgspec
    import zmq
except ModuleNotFoundError as exc:  # an optional dependency: say which extra brings it
    from hicache_fsm.errors import MissingExtra

    raise MissingExtra("KV events", "pyzmq", "events") from exc

from hicache_fsm.errors import ConfigError, HiCacheError
from hicache_fsm.events.schema import KVEventBatch, decode
from hicache_fsm.events.settings import check_text, check_wait_ms

Batch = tuple[int, KVEventBatch]
SEQ_BYTES = 8  # a sequence number frame: 8 bytes, big-endian
UNREADABLE = (msgspec.MsgspecError, ValueError, TypeError)  # what a decoder raises on bytes that are not a batch


class ReplayUnanswered(HiCacheError):
    """The replay socket did not answer within the subscriber's ``replay_timeout_ms``."""


class ZmqEventSubscriber:
    """SUB socket on ``endpoint`` (and a DEALER on ``replay_endpoint``); see module docstring."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *, topic: str = "",
                 decoder: Callable[[bytes], KVEventBatch] = decode, replay_timeout_ms: int = 10_000) -> None:
        check_text("endpoint", endpoint)
        check_text("replay_endpoint", replay_endpoint, optional=True)
        check_text("topic", topic)
        if not callable(decoder):
            raise ConfigError(f"decoder must be callable, got {decoder!r}")
        self._decode = decoder
        self.replay_timeout_ms = check_wait_ms("replay_timeout_ms", replay_timeout_ms)
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._replay = None
        try:
            self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
            self._sub.connect(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.DEALER)
                self._replay.connect(replay_endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise ConfigError(f"KV event subscriber: cannot connect to {endpoint!r} / {replay_endpoint!r}: "
                              f"{exc}") from None
        self.next_seq = 0  # the first batch expected: from the start of the publisher's history
        self.gaps = 0  # times a jump in sequence numbers was seen
        self.replayed = 0  # batches fetched by replay
        self.lost = 0  # batches neither received nor replayable
        self.malformed = 0  # messages dropped as not a batch (frames or payload): their batches count as gaps

    def receive(self, timeout_ms: int = 0) -> list[Batch]:
        """Every batch that arrived (waiting up to ``timeout_ms`` for the first), in order, gaps filled."""
        out: list[Batch] = []
        wait = check_wait_ms("timeout_ms", timeout_ms)
        while self._sub.poll(wait):
            wait = 0
            frames = self._sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != SEQ_BYTES:
                self.malformed += 1
                continue
            seq = int.from_bytes(frames[1], "big")
            if seq < self.next_seq:
                continue  # already had it by replay
            batch = self._decoded(frames[2])
            if batch is None:
                continue  # the next batch shows the gap; replay fills it if it can
            if seq > self.next_seq:
                self.gaps += 1
                out += self.catch_up(seq)
            if seq > self.next_seq:  # the replay buffer no longer covers next_seq .. seq - 1
                self.lost += seq - self.next_seq
            out.append((seq, batch))
            self.next_seq = seq + 1
        return out

    def catch_up(self, until: int | None = None) -> list[Batch]:
        """Replay every buffered batch from ``next_seq`` (before ``until`` if given); nothing without a replay socket."""
        if self._replay is None:
            return []
        self._replay.send_multipart((b"", self.next_seq.to_bytes(8, "big")))
        out: list[Batch] = []
        while True:
            if not self._replay.poll(self.replay_timeout_ms):
                raise ReplayUnanswered(f"no replay answer within {self.replay_timeout_ms} ms")
            frames = self._replay.recv_multipart()
            if len(frames) < 2 or len(frames[-2]) != SEQ_BYTES:
                self.malformed += 1
                continue
            seq = int.from_bytes(frames[-2], "big", signed=True)
            if seq == -1:
                return out
            if seq == self.next_seq and (until is None or seq < until):
                batch = self._decoded(frames[-1])
                if batch is None:
                    continue  # later ones no longer follow on: left to receive, which counts them
                out.append((seq, batch))
                self.next_seq = seq + 1
                self.replayed += 1

    def _decoded(self, payload: bytes) -> KVEventBatch | None:
        """The batch in ``payload``, or None (counted in ``malformed``) when it is not one."""
        try:
            return self._decode(payload)
        except UNREADABLE:
            self.malformed += 1
            return None

    def close(self) -> None:
        for sock in (self._sub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> "ZmqEventSubscriber":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
