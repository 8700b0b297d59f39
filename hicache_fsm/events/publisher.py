"""Publish KV event batches on a ZMQ PUB socket, sequence-numbered, with a replay socket.

The wire format is vLLM's and SGLang's ``ZmqEventPublisher``: each batch goes
out as three frames ``(topic, seq as 8 bytes big-endian, msgpack payload)``;
a ROUTER socket answers a replay request (the start sequence number as 8
bytes, after an empty delimiter frame) with every buffered batch from that
number on, as ``(seq, payload)`` frames, then ``(-1, b"")``.

``publish`` never blocks the cache: it numbers the batch, keeps it in the
replay buffer and offers it to a bounded queue; when the queue is full the
batch is not sent live (``dropped`` counts it) and a subscriber sees the gap in
the sequence numbers and fetches it by replay. ``publish`` also takes the
hook's ``PendingBatch`` (it is marked ``accepts_pending``): the batch is
numbered at once and written as msgpack bytes on the sender thread (pages
hashed, hash and token lists written from bytes: ``PendingBatch.payload``), so
the serving thread never hashes; a replay sends the same bytes. That work
still holds the GIL, so while the cache is stepping the sender gives way
(:class:`Pacing`: one short burst per ``busy_pause_s``) and catches up when the
serving thread waits, up to ``max_lag`` queued batches. One thread owns both sockets
(ZMQ sockets are not thread-safe); ``close`` sends what is queued, joins the
thread and closes the sockets and the context.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections import deque

import attrs

try:
    import zmq
except ModuleNotFoundError as exc:  # an optional dependency: say which extra brings it
    from hicache_fsm.errors import MissingExtra

    raise MissingExtra("KV events", "pyzmq", "events") from exc

from hicache_fsm.config import check_positive_int, check_seconds
from hicache_fsm.errors import ConfigError, HiCacheError
from hicache_fsm.events.pending import PendingBatch, accepts_pending
from hicache_fsm.events.schema import UNREADABLE, KVEventBatch, decode, encode
from hicache_fsm.events.settings import check_rank, check_text, topic_bytes

Batch = KVEventBatch | PendingBatch
Queued = PendingBatch | bytes  # a pending batch, rendered on the sender thread, or a batch's bytes
MAX_HWM = (1 << 31) - 1  # a ZMQ high-water mark is a C int

END_SEQ = (-1).to_bytes(8, "big", signed=True)
IDLE_WAIT_S = 0.01  # how long the sender thread sleeps between draining the queue and serving replays


BUSY_PAUSE_S = 0.005  # while the cache steps, the sender sends one burst per pause at most
BUSY_WINDOW_S = 0.002  # a publish this recent means the cache is stepping now
MAX_LAG = 1000  # batches queued beyond which the sender stops giving way (staleness bound)
BURST_S = 0.001  # how long a paced sender works before handing the GIL back
YIELD_S = 0.0002  # the sender's sleep after each burst (paced): the serving thread takes the GIL


@attrs.frozen
class Pacing:
    """When the sender thread gives way to the serving thread, so their work does not share the GIL at once.

    Rendering a batch (hashing its pages, writing its bytes) holds the GIL; while
    the cache is stepping (a batch was published within ``window_s``) the
    sender works at most one burst (batches for up to ``burst_s``) per
    ``pause_s`` and catches up when the serving thread waits (an engine's
    forward pass on the accelerator, an idle scheduler), unless ``max_lag``
    batches are queued: then it sends at once, competing for the GIL, so
    events are never more than that far behind. After each burst a paced
    sender sleeps ``yield_s``: a thread that lets go of the GIL and takes it
    straight back keeps a thread waiting for it from running, and a serving
    thread starved so would look idle. Bursts, not single batches, because
    every hand-over of the GIL between the threads costs CPU (measured: one
    batch per pause cost more CPU than the batches themselves). A ``pause_s``
    of 0 never gives way (and never sleeps).
    """

    pause_s: float
    window_s: float
    max_lag: int
    burst_s: float = BURST_S
    yield_s: float = YIELD_S

    def give_way(self, since_publish_s: float, queued: int) -> bool:
        return self.pause_s > 0 and since_publish_s < self.window_s and queued < self.max_lag


class PublisherClosed(HiCacheError):
    """``publish`` after ``close``."""


class ZmqEventPublisher:
    """PUB socket + replay ROUTER socket, fed from a bounded queue by ``publish`` (see module docstring).

    Endpoints ending in ``:*`` bind a free port; ``endpoint`` and
    ``replay_endpoint`` then hold the address actually bound. A publisher
    dropped without ``close`` is closed when collected (its sender thread
    holds the sockets and queues, not the publisher).
    """

    def __init__(self, endpoint: str = "tcp://127.0.0.1:*", replay_endpoint: str | None = "tcp://127.0.0.1:*", *,
                 buffer_steps: int = 10_000, hwm: int = 100_000, max_queue_size: int = 100_000, topic: str = "",
                 data_parallel_rank: int | None = None, busy_pause_s: float = BUSY_PAUSE_S,
                 busy_window_s: float = BUSY_WINDOW_S, max_lag: int = MAX_LAG) -> None:
        for name, value in (("buffer_steps", buffer_steps), ("hwm", hwm), ("max_queue_size", max_queue_size),
                            ("max_lag", max_lag)):
            check_positive_int(name, value)
        for name, value in (("busy_pause_s", busy_pause_s), ("busy_window_s", busy_window_s)):
            check_seconds(name, value, zero_ok=True)
        for name, value in (("hwm", hwm), ("buffer_steps", buffer_steps)):  # a zmq C int, and the replay socket's
            if value > MAX_HWM:  # high-water mark follows the buffer: larger raised OverflowError with a context open
                raise ConfigError(f"{name} must be an int from 1 to {MAX_HWM}, got {value!r}")
        check_text("endpoint", endpoint)
        check_text("replay_endpoint", replay_endpoint, optional=True)
        self.topic = topic_bytes(topic)
        check_rank(data_parallel_rank)
        self.pacing = Pacing(float(busy_pause_s), float(busy_window_s), max_lag)
        self.data_parallel_rank = data_parallel_rank
        ctx = zmq.Context()
        pub = replay = None
        try:
            pub = ctx.socket(zmq.PUB)
            pub.set_hwm(hwm)
            pub.bind(endpoint)
            self.endpoint = pub.getsockopt(zmq.LAST_ENDPOINT).decode()
            self.replay_endpoint = None
            if replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                # A ROUTER drops what passes its high-water mark without a word (the end marker too):
                # a whole answer (the buffer and its end) must fit, or a late subscriber never catches up.
                # The reader reports what it read only every half mark, so earlier answers it has read may
                # still count: twice the answer always leaves room for one.
                replay.setsockopt(zmq.SNDHWM, min(2 * (buffer_steps + 1), MAX_HWM))
                replay.bind(replay_endpoint)
                self.replay_endpoint = replay.getsockopt(zmq.LAST_ENDPOINT).decode()
        except zmq.ZMQError as exc:
            _close_sockets(ctx, pub, replay)
            raise ConfigError(f"cannot bind KV event sockets ({endpoint}, {replay_endpoint}): {exc}") from None
        self.max_queue_size = max_queue_size
        self._next_seq = 0
        self._closed = False
        self.dropped = 0  # batches not sent live (queue full); still in the replay buffer
        self._sender = sender = _Sender(ctx, pub, replay, self.topic, self.pacing, buffer_steps)
        self._shutdown = weakref.finalize(self, sender.shutdown)  # close(), collection, or interpreter exit
        sender.thread.start()

    # ------------------------------------------------------------ caller side

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will get (= batches published so far)."""
        return self._next_seq

    @property
    def sent(self) -> int:
        return self._sender.sent

    @property
    def replays(self) -> int:
        return self._sender.replays

    @property
    def paused(self) -> int:
        """Pauses the sender took to give way to a stepping cache."""
        return self._sender.paused

    @property
    def unrenderable(self) -> int:
        """Pending batches the sender could not render (skipped: subscribers count them lost)."""
        return self._sender.unrenderable

    @accepts_pending
    def publish(self, batch: Batch) -> int:
        """Number ``batch``, buffer it for replay and queue it for sending; returns its sequence number."""
        if self._closed:
            raise PublisherClosed("this KV event publisher is closed")
        if not isinstance(batch, (KVEventBatch, PendingBatch)):
            raise ConfigError(f"publish takes a KVEventBatch (or a hook's pending batch), got {type(batch).__name__}")
        stamp = batch.data_parallel_rank is None and self.data_parallel_rank is not None
        if stamp:
            batch.data_parallel_rank = self.data_parallel_rank
        queued: Queued = batch  # type: ignore[assignment]
        if isinstance(batch, KVEventBatch):
            try:
                queued = checked_payload(batch)
            except ConfigError:
                if stamp:
                    batch.data_parallel_rank = None  # refused: the caller's batch is left as it came
                raise
        sender = self._sender
        sender.last_publish = time.monotonic()  # the cache is stepping: the sender gives way (see Pacing)
        with sender.buffer_lock:  # numbered and queued in one step: publishers on two threads keep the order
            seq = self._next_seq
            self._next_seq = seq + 1
            sender.buffer.append((seq, queued))
            if len(sender.queue) < self.max_queue_size:
                sender.queue.append((seq, queued))
            else:
                self.dropped += 1
        return seq

    def wait_sent(self, timeout: float) -> bool:
        """Wait (sleeping, off the GIL) until every batch published so far was sent, dropped or skipped as
        unrenderable; False on timeout."""
        deadline = time.monotonic() + check_seconds("timeout", timeout, zero_ok=True)
        drained = self._sender.drained
        while True:
            drained.clear()  # before looking: a drain after the look sets it again
            if self.sent + self.dropped + self.unrenderable >= self._next_seq:
                return True
            left = deadline - time.monotonic()
            if self._closed or left <= 0:
                return False
            drained.wait(min(left, IDLE_WAIT_S))  # no polling: each wake-up would take the GIL

    def close(self) -> None:
        """Send what is queued, stop the thread, close the sockets (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._shutdown()

    def __enter__(self) -> "ZmqEventPublisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict:
        return {"published": self._next_seq, "sent": self.sent, "dropped": self.dropped, "replays": self.replays,
                "queued": len(self._sender.queue), "paused": self.paused,
                "unrenderable": self.unrenderable}


class _Sender:
    """The sender thread's side of a publisher: both sockets, the queue, the replay buffer and its counters.

    The thread holds this, not the publisher, so a publisher nobody holds is
    collected and its finalizer ends the thread.
    """

    def __init__(self, ctx: zmq.Context, pub: zmq.Socket, replay: zmq.Socket | None, topic: bytes, pacing: Pacing,
                 buffer_steps: int) -> None:
        self.ctx, self.pub, self.replay, self.topic, self.pacing = ctx, pub, replay, topic, pacing
        # A plain deque, not queue.Queue: appending wakes no thread (the sender drains it every
        # IDLE_WAIT_S), so a publish costs the serving thread no GIL hand-off.
        self.queue: deque[tuple[int, Queued]] = deque()
        self.buffer: deque[tuple[int, Queued]] = deque(maxlen=buffer_steps)
        self.buffer_lock = threading.Lock()
        self.last_publish = -math.inf
        self.stop = threading.Event()
        self.drained = threading.Event()  # set whenever the sender finds its queue empty
        self.sent = 0
        self.replays = 0
        self.paused = 0
        self.unrenderable = 0  # pending batches that could not be rendered (skipped, the thread going on)
        self.thread = threading.Thread(target=self.run, name="kv-event-publisher", daemon=True)

    def shutdown(self) -> None:
        """Refuse nothing more, let the thread send what is queued and close the sockets, and wait for it."""
        self.stop.set()
        if self.thread.ident is None:  # never started (the start failed): no thread closes the sockets
            _close_sockets(self.ctx, self.pub, self.replay)
        elif self.thread is not threading.current_thread():  # collected on the thread itself: it ends on its own
            self.thread.join()

    def run(self) -> None:
        try:
            self._loop()
        finally:
            _close_sockets(self.ctx, self.pub, self.replay)  # the thread that used them closes them

    def _loop(self) -> None:
        pub, replay, q, pacing, stop = self.pub, self.replay, self.queue, self.pacing, self.stop
        paused = False
        while True:
            if replay is not None:
                while replay.poll(0):
                    self._serve_replay(replay)
            if q:
                if (not paused and not stop.is_set()
                        and pacing.give_way(time.monotonic() - self.last_publish, len(q))):
                    self.paused += 1
                    stop.wait(pacing.pause_s)
                    paused = True  # one burst goes out after each pause, however busy the cache is
                    continue
                paused = False
                self._burst(pub, q)
                if pacing.pause_s > 0:
                    # Hand the GIL over: a serving thread waiting for it runs (and publishes) before the
                    # next look, so a cache starved by this loop is not taken for a waiting one.
                    time.sleep(pacing.yield_s)
                continue
            self.drained.set()
            if stop.is_set():  # close() refuses new batches first: the queue is drained for good
                return
            stop.wait(IDLE_WAIT_S)

    def _burst(self, pub: zmq.Socket, q: deque) -> None:
        """Send queued batches for up to ``burst_s`` (all of them when not paced)."""
        topic, paced, send = self.topic, self.pacing.pause_s > 0, pub.send_multipart
        end = time.monotonic() + self.pacing.burst_s
        while q:
            seq, batch = q.popleft()
            payload = self._rendered(batch)
            if payload is None:
                continue  # subscribers see the gap: their replay of it finds none, and counts it lost
            send((topic, seq.to_bytes(8, "big"), payload))
            self.sent += 1
            if paced and time.monotonic() >= end:
                return

    def _serve_replay(self, replay: zmq.Socket) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return  # not a replay request: ignored, as vLLM does
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        self.replays += 1
        with self.buffer_lock:
            wanted = [(seq, batch) for seq, batch in self.buffer if seq >= start_seq]
        for seq, batch in wanted:
            payload = self._rendered(batch, live=False)
            if payload is not None:
                replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", END_SEQ, b""))

    def _rendered(self, batch: Queued, live: bool = True) -> bytes | None:
        """The bytes of ``batch``, or None for a pending batch that cannot be rendered (counted in ``unrenderable``
        when it was to go out ``live``, once: a replay asks again): this thread sends every batch after it all the
        same (an exception here ended it, and nothing more went out)."""
        try:
            return _payload(batch)
        except Exception:  # noqa: BLE001 - whatever a hand-made pending batch raises: skip it, keep sending
            if live:
                self.unrenderable += 1
            return None


def _close_sockets(ctx: zmq.Context, *sockets: zmq.Socket | None) -> None:
    for sock in sockets:
        if sock is not None:
            sock.close(linger=0)
    ctx.term()


def checked_payload(batch: KVEventBatch) -> bytes:
    """``batch``'s msgpack bytes, if they decode as a batch; else ``ConfigError`` (nothing numbered).

    Encoded at once: a batch that cannot be encoded used to kill the sender
    thread (nothing sent after it), one that decodes as no batch would be
    dropped by every subscriber, and a caller changing the struct afterwards
    would make the replay differ from what went out live.
    """
    check_rank(batch.data_parallel_rank)  # -5 went out to every router
    try:
        payload = encode(batch)
        decode(payload)
    except (*UNREADABLE, OverflowError) as exc:  # OverflowError: an int msgpack cannot hold
        raise ConfigError(f"publish: not a valid KVEventBatch: {exc}") from None
    return payload


def _payload(batch: Queued) -> bytes:
    """The msgpack bytes of ``batch``, a pending one rendered straight to bytes (on the sender thread)."""
    return batch.payload() if isinstance(batch, PendingBatch) else batch
