"""Receive KV event batches from a publisher, in sequence order, filling gaps by replay.

``ZmqEventSubscriber.receive`` returns the batches that arrived, numbered and
in order. A sequence number beyond the next expected one means batches were
dropped (the publisher's queue was full, or the PUB socket's high-water mark
was hit): the subscriber asks the replay socket for them first. Batches gone
from the publisher's replay buffer too, or not replayed in time, are counted
in ``lost`` (a consumer then rebuilds from a fresh snapshot); ``receive``
never raises for it, so the batches it already took are never dropped with an
exception. A live number not above the last one means the publisher started
again (an engine restarted, numbering from 0): ``restarts`` counts it, the
subscriber follows the new numbers (a consumer drops what the old one told
it), and a forged large number cannot make it ignore every later batch. A
restart whose first batches were missed live shows as a gap instead: the
replay that fills it starts at the last batch taken, and other bytes under
that number tell the new publisher (see ``catch_up``). No
thread: the caller polls.
"""

from __future__ import annotations

import time
from typing import Callable

try:
    import zmq
except ModuleNotFoundError as exc:  # an optional dependency: say which extra brings it
    from hicache_fsm.errors import MissingExtra

    raise MissingExtra("KV events", "pyzmq", "events") from exc

from hicache_fsm.errors import ConfigError, HiCacheError
from hicache_fsm.events.schema import KVEventBatch, decode
from hicache_fsm.events.settings import check_text, check_wait_ms, topic_bytes

Batch = tuple[int, KVEventBatch]
SEQ_BYTES = 8  # a sequence number frame: 8 bytes, big-endian
MAX_SEQ = (1 << 63) - 1  # sequence numbers are int64 (a replay ends with -1): a larger one is not a batch's


class ReplayUnanswered(HiCacheError):
    """The replay socket did not give its whole answer within the subscriber's ``replay_timeout_ms``."""


class SubscriberClosed(HiCacheError):
    """``receive`` or ``catch_up`` after ``close``."""


class ZmqEventSubscriber:
    """SUB socket on ``endpoint`` (and a DEALER on ``replay_endpoint``); see module docstring."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *, topic: str = "",
                 decoder: Callable[[bytes], KVEventBatch] = decode, replay_timeout_ms: int = 10_000) -> None:
        check_text("endpoint", endpoint)
        check_text("replay_endpoint", replay_endpoint, optional=True)
        subscription = topic_bytes(topic)
        if not callable(decoder):
            raise ConfigError(f"decoder must be callable, got {decoder!r}")
        self._decode = decoder
        self.replay_timeout_ms = check_wait_ms("replay_timeout_ms", replay_timeout_ms)
        self.replay_endpoint = replay_endpoint
        self._closed = False
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._replay = None
        try:
            self._sub.setsockopt(zmq.SUBSCRIBE, subscription)
            self._sub.connect(endpoint)
            self._replay = self._replay_socket()
        except zmq.ZMQError as exc:
            self.close()
            raise ConfigError(f"KV event subscriber: cannot connect to {endpoint!r} / {replay_endpoint!r}: "
                              f"{exc}") from None
        self.next_seq = 0  # the first batch expected: from the start of the publisher's history
        self.gaps = 0  # times a jump in sequence numbers was seen
        self.replayed = 0  # batches fetched by replay
        self.lost = 0  # batches neither received nor replayable
        self.malformed = 0  # messages dropped as not a batch (frames or payload): their batches count as gaps
        self.unanswered = 0  # replays ``receive`` asked for that did not answer in time (their gaps are lost)
        self.restarts = 0  # times the live numbers fell back: a publisher started again (its old blocks are gone)
        self.last_live = -1  # the last sequence number the live socket gave
        self._last: tuple[int, bytes] | None = None  # the last batch taken (number, bytes): who published it

    def receive(self, timeout_ms: int = 0) -> list[Batch]:
        """Every batch that arrived (waiting up to ``timeout_ms`` for the first), in order, gaps filled."""
        out: list[Batch] = []
        wait = check_wait_ms("timeout_ms", timeout_ms)
        self._check_open()
        while self._sub.poll(wait):
            wait = 0
            frames = self._sub.recv_multipart()
            seq = int.from_bytes(frames[1], "big") if len(frames) == 3 and len(frames[1]) == SEQ_BYTES else -1
            if seq < 0 or seq > MAX_SEQ:  # not three frames, or no int64 sequence number: not a batch
                self.malformed += 1
                continue
            if seq <= self.last_live:  # one publisher's live numbers only climb: it started again, from 0
                self.restarts += 1
                self.next_seq = 0
                self._last = None
            self.last_live = seq
            if seq < self.next_seq:
                continue  # already had it by replay
            batch = self._decoded(frames[2])
            if batch is None:
                continue  # the next batch shows the gap; replay fills it if it can
            if seq > self.next_seq:
                self.gaps += 1
                try:
                    out += self.catch_up(seq)
                except ReplayUnanswered:  # raised, the batches received before it and this one were lost
                    self.unanswered += 1
            if seq > self.next_seq:  # the replay buffer no longer covers next_seq .. seq - 1 (or did not answer)
                self.lost += seq - self.next_seq
            out.append((seq, batch))
            self.next_seq = seq + 1
            self._last = (seq, frames[2])
        return out

    def catch_up(self, until: int | None = None) -> list[Batch]:
        """Replay every buffered batch from ``next_seq`` (before ``until`` if given); nothing without a replay socket.

        The answer starts at the last batch taken, when there is one: the
        same bytes under that number show the same publisher, other bytes (or
        none) one that started again since (an engine restarted, and its first
        batches were missed live): ``restarts`` counts it and the replay starts
        over from 0, the new publisher's first batch. Batches the publisher's
        buffer no longer holds are counted in ``lost``, and the replay goes on
        from the first it holds. The whole answer must come within
        ``replay_timeout_ms`` (a peer that never ends it cannot hold the
        caller); else ``ReplayUnanswered``, nothing taken, and the replay
        socket is made afresh, so a late answer is never read as the next one's.
        """
        self._check_open()
        if self._replay is None:
            return []
        saved = (self.next_seq, self.replayed, self.lost, self.restarts, self._last)
        try:
            return self._replay_from(self._last if self._last and self._last[0] == self.next_seq - 1 else None,
                                     until)
        except ReplayUnanswered:
            self.next_seq, self.replayed, self.lost, self.restarts, self._last = saved  # nothing handed out
            raise

    def _replay_from(self, last: tuple[int, bytes] | None, until: int | None) -> list[Batch]:
        """One replay request, from ``last`` (the last batch taken, to compare) or from ``next_seq``."""
        self._replay.send_multipart((b"", (self.next_seq if last is None else last[0]).to_bytes(8, "big")))
        out: list[Batch] = []
        deadline = time.monotonic() + self.replay_timeout_ms / 1000
        while True:
            left_ms = max(0, round((deadline - time.monotonic()) * 1000))
            if not self._replay.poll(left_ms):
                self._fresh_replay_socket()
                raise ReplayUnanswered(f"no whole replay answer within {self.replay_timeout_ms} ms")
            frames = self._replay.recv_multipart()
            if len(frames) < 2 or len(frames[-2]) != SEQ_BYTES:
                self.malformed += 1
                continue
            seq = int.from_bytes(frames[-2], "big", signed=True)
            if last is not None and seq <= last[0]:  # -1 too: a publisher holds its newest batch, so none at all
                if seq == last[0] and frames[-1] == last[1]:  # under the last number taken means another one
                    last = None
                    continue  # the batch already taken: the publisher is the one heard before
                self.restarts += 1  # another batch under a number taken: a publisher that started again
                self.next_seq, self._last = 0, None
                self._fresh_replay_socket()  # the rest of this answer is not wanted
                return self._replay_from(None, until)
            last = None  # the last batch taken is gone from the buffer: the publisher cannot be told
            if seq == -1:
                return out
            if until is not None and seq >= until:
                continue
            if seq > self.next_seq:  # gone from the publisher's buffer: lost, and the replay goes on from here
                self.lost += seq - self.next_seq
                self.next_seq = seq
            if seq == self.next_seq:
                batch = self._decoded(frames[-1])
                if batch is None:
                    continue  # counted in malformed; the next one counts it lost
                out.append((seq, batch))
                self.next_seq = seq + 1
                self.replayed += 1
                self._last = (seq, frames[-1])

    def _fresh_replay_socket(self) -> None:
        """Close the replay socket with whatever is left of an answer in it, and connect a new one."""
        self._replay.close(linger=0)
        self._replay = self._replay_socket()

    def _decoded(self, payload: bytes) -> KVEventBatch | None:
        """The batch in ``payload``, or None (counted in ``malformed``) when it is not one.

        The decoder may be the caller's: whatever it raises, or a None it returns, is a batch it could not
        read, never an exception that would drop the batches ``receive`` already took.
        """
        try:
            batch = self._decode(payload)
        except Exception:  # noqa: BLE001 - UNREADABLE from ours, anything from a caller's decoder
            batch = None
        if batch is None:
            self.malformed += 1
        return batch

    def _replay_socket(self) -> "zmq.Socket | None":
        """A DEALER connected to the replay endpoint (None without one)."""
        if self.replay_endpoint is None:
            return None
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.connect(self.replay_endpoint)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        return sock

    def _check_open(self) -> None:
        if self._closed:
            raise SubscriberClosed("this KV event subscriber is closed")

    def close(self) -> None:
        """Close both sockets and the context (idempotent)."""
        self._closed = True
        for sock in (self._sub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> "ZmqEventSubscriber":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
