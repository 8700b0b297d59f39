"""KV events, router and cluster replay under bad input: typed errors, nothing changed, nothing lost, no hang."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_helpers import drain, make_cache, pages, put
from hicache_fsm.cluster_replay import ClusterOptions, run_cluster
from hicache_fsm.config import CacheConfig
from hicache_fsm.errors import ConfigError
from hicache_fsm.events.contents import MEMORY_TIERS, cache_contents
from hicache_fsm.events.hook import disable_kv_events, enable_kv_events
from hicache_fsm.router import PrefixIndex, Router
from hicache_fsm.trace import Trace

zmq = pytest.importorskip("zmq")

from hicache_fsm.events.publisher import PublisherClosed, ZmqEventPublisher  # noqa: E402
from hicache_fsm.events.schema import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, encode  # noqa: E402
from hicache_fsm.events.subscriber import ReplayUnanswered, SubscriberClosed, ZmqEventSubscriber  # noqa: E402

GUARD_S = 60.0  # a bound for a hung test only, never a measured wait
GUARD_MS = int(GUARD_S * 1000)


def _seq(n: int) -> bytes:
    return n.to_bytes(8, "big")


def _batch(*hashes: int) -> KVEventBatch:
    return KVEventBatch(0.0, [BlockRemoved(list(hashes), "GPU")])


class _RawPeer:
    """A PUB socket and a ROUTER socket on 127.0.0.1 random ports, playing a publisher that misbehaves."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.endpoint = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.router = self.ctx.socket(zmq.ROUTER)
        self.replay_endpoint = f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}"

    def connect(self, sub: ZmqEventSubscriber) -> list:
        """Send batch 0 until the subscription reaches the PUB socket; what ``receive`` returned."""
        for _ in range(400):
            self.pub.send_multipart([b"", _seq(0), encode(_batch(0))])
            got = sub.receive(timeout_ms=50)
            if got:
                while sub.receive(timeout_ms=50):  # a repeat of the probe (a slow machine) ...
                    pass
                sub.restarts = 0  # ... reads as a publisher started again: it is not one
                return got[:1]
        pytest.fail("the subscription never reached the PUB socket")

    def close(self) -> None:
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.ctx.term()


@pytest.fixture
def peer():
    p = _RawPeer()
    yield p
    p.close()


def _receive_until(sub: ZmqEventSubscriber, last_seq: int) -> list:
    out: list = []
    for _ in range(400):
        out += sub.receive(timeout_ms=50)
        if out and out[-1][0] >= last_seq:
            return out
    pytest.fail(f"batch {last_seq} never arrived")


# ------------------------------------------------------------------ subscriber


def test_a_sequence_number_beyond_int64_is_malformed_not_an_overflow_later(peer):
    """2**64 - 1 was taken as a batch: next_seq became 2**64 and catch_up raised OverflowError."""
    with ZmqEventSubscriber(peer.endpoint, peer.replay_endpoint, replay_timeout_ms=GUARD_MS) as sub:
        peer.connect(sub)
        peer.pub.send_multipart([b"", _seq((1 << 64) - 1), encode(_batch(9))])
        peer.pub.send_multipart([b"", _seq(1), encode(_batch(1))])
        got = _receive_until(sub, 1)
        assert [s for s, _ in got] == [1]
        assert (sub.malformed, sub.next_seq, sub.lost) == (1, 2, 0)


def _hashes(got: list) -> list[tuple[int, list[int]]]:
    return [(seq, list(batch.events[0].block_hashes)) for seq, batch in got]


def test_a_publisher_that_started_again_is_followed_not_ignored(peer):
    """A restarted engine numbers its batches from 0 again: every one of them was skipped as already had."""
    with ZmqEventSubscriber(peer.endpoint) as sub:
        peer.connect(sub)
        for n in (1, 2):
            peer.pub.send_multipart([b"", _seq(n), encode(_batch(n))])
        assert _receive_until(sub, 2)[-1][0] == 2 and sub.restarts == 0
        for n in (0, 1):  # the new publisher's first batches
            peer.pub.send_multipart([b"", _seq(n), encode(_batch(100 + n))])
        got = _receive_until(sub, 1)
        assert _hashes(got) == [(0, [100]), (1, [101])]
        assert (sub.restarts, sub.next_seq, sub.lost) == (1, 2, 0)


def test_a_publisher_that_started_again_under_the_last_number_is_followed(peer):
    """A new publisher whose first batch took the last number heard was read as an old one: its blocks were
    applied on top of the dead engine's, and nothing counted the restart."""
    with ZmqEventSubscriber(peer.endpoint) as sub:
        peer.connect(sub)  # the old publisher's batch 0
        peer.pub.send_multipart([b"", _seq(0), encode(_batch(100))])  # the new one's batch 0
        assert _hashes(_receive_until(sub, 0)) == [(0, [100])]
        assert (sub.restarts, sub.next_seq) == (1, 1)


def test_a_restart_first_seen_past_a_gap_is_told_by_the_replay_and_replayed_from_zero():
    """A new publisher whose first batches were missed live showed as a mere gap: the replay filled it from
    the old numbering, so the new publisher's first batches (its snapshot) were skipped and nothing was lost."""
    old = ZmqEventPublisher(busy_pause_s=0)
    endpoints = (old.endpoint, old.replay_endpoint)
    with ZmqEventSubscriber(*endpoints, replay_timeout_ms=GUARD_MS) as sub:
        for n in (0, 1):
            old.publish(_batch(n))
        assert old.wait_sent(GUARD_S)
        assert _hashes(sub.catch_up()) == [(0, [0]), (1, [1])]
        old.close()
        with ZmqEventPublisher(*endpoints, busy_pause_s=0) as new:  # the engine again, on the same ports
            for n in range(4):
                new.publish(_batch(100 + n))
            assert new.wait_sent(GUARD_S)
            got = sub.catch_up()  # what a gap in the live numbers asks for
            assert _hashes(got) == [(n, [100 + n]) for n in range(4)]
            assert (sub.restarts, sub.lost, sub.next_seq) == (1, 0, 4)
            assert sub.catch_up() == [] and sub.restarts == 1  # the same publisher: its batch 3 again


def test_a_restart_with_fewer_batches_than_the_last_number_taken_is_replayed_from_zero():
    """The new publisher holds nothing at or after the last number taken (its answer is only the end marker),
    which the publisher heard before could not give: it always holds its newest batch."""
    old = ZmqEventPublisher(busy_pause_s=0)
    endpoints = (old.endpoint, old.replay_endpoint)
    with ZmqEventSubscriber(*endpoints, replay_timeout_ms=GUARD_MS) as sub:
        for n in range(5):
            old.publish(_batch(n))
        assert old.wait_sent(GUARD_S)
        assert [s for s, _ in sub.catch_up()] == list(range(5))
        old.close()
        with ZmqEventPublisher(*endpoints, busy_pause_s=0) as new:
            for n in range(2):
                new.publish(_batch(100 + n))
            assert new.wait_sent(GUARD_S)
            assert _hashes(sub.catch_up()) == [(0, [100]), (1, [101])]
            assert (sub.restarts, sub.next_seq) == (1, 2)


def test_a_replay_from_a_buffer_that_wrapped_takes_what_it_holds_and_counts_the_rest_lost():
    """The first replayed number was above next_seq: every batch was skipped and next_seq never moved."""
    with ZmqEventPublisher(buffer_steps=4, busy_pause_s=0) as pub:
        for n in range(6):
            pub.publish(_batch(n))
        assert pub.wait_sent(GUARD_S)
        with ZmqEventSubscriber(pub.endpoint, pub.replay_endpoint, replay_timeout_ms=GUARD_MS) as sub:
            assert [s for s, _ in sub.catch_up()] == [2, 3, 4, 5]
            assert (sub.lost, sub.replayed, sub.next_seq) == (2, 4, 6)


def test_a_late_subscriber_catches_up_on_more_batches_than_zmqs_default_high_water_marks():
    """Past about 2,000 batches the ROUTER dropped the answer's tail (and its end) without a word."""
    n = 3000
    with ZmqEventPublisher(busy_pause_s=0) as pub:
        for i in range(n):
            pub.publish(KVEventBatch(0.0, [BlockStored([i], None, list(range(256)), 16, None, "GPU")]))
        assert pub.wait_sent(GUARD_S)
        with ZmqEventSubscriber(pub.endpoint, pub.replay_endpoint, replay_timeout_ms=GUARD_MS) as sub:
            got = sub.catch_up()
            assert [s for s, _ in got] == list(range(n)) and sub.lost == 0


def test_a_forged_large_sequence_number_does_not_silence_the_subscriber(peer):
    """After a valid but forged 2**62 every genuine batch was below next_seq and skipped for good."""
    with ZmqEventSubscriber(peer.endpoint) as sub:
        peer.connect(sub)
        peer.pub.send_multipart([b"", _seq(1 << 62), encode(_batch(7))])
        assert _receive_until(sub, 1 << 62)[-1][0] == 1 << 62
        for n in (1, 2):
            peer.pub.send_multipart([b"", _seq(n), encode(_batch(n))])
        assert _hashes(_receive_until(sub, 2)) == [(1, [1]), (2, [2])]
        assert sub.restarts == 1 and sub.next_seq == 3


def test_a_replay_that_never_ends_its_answer_is_unanswered_within_the_timeout(peer):
    """A replay peer streaming frames that are not the one asked for held catch_up forever."""
    stop = threading.Event()

    def stream_junk() -> None:
        client = peer.router.recv_multipart()[0]
        while not stop.is_set():
            peer.router.send_multipart([client, b"", _seq(999), encode(_batch(9))])

    junk = threading.Thread(target=stream_junk, daemon=True)
    junk.start()
    outcome: dict = {}

    def ask() -> None:
        try:
            outcome["got"] = sub.catch_up()
        except ReplayUnanswered as exc:
            outcome["error"] = exc

    with ZmqEventSubscriber(peer.endpoint, peer.replay_endpoint, replay_timeout_ms=300) as sub:
        asker = threading.Thread(target=ask, daemon=True)
        asker.start()
        asker.join(GUARD_S)
        answered_while_streaming = not asker.is_alive()
        stop.set()
        junk.join(GUARD_S)
        asker.join(GUARD_S)
        assert answered_while_streaming
        assert isinstance(outcome.get("error"), ReplayUnanswered)
        assert sub.next_seq == 0 and sub.replayed == 0


def _in_thread(call) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["got"] = call()
        except Exception as exc:  # handed to the test to look at
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def _request(peer: _RawPeer) -> bytes:
    """The identity of the next replay request to reach the ROUTER."""
    assert peer.router.poll(GUARD_MS), "no replay request came"
    return peer.router.recv_multipart()[0]


def test_a_late_replay_answer_is_not_read_as_the_next_ones(peer):
    """After a timeout the next catch_up read the stale answer's end and missed what the publisher held."""
    end = (-1).to_bytes(8, "big", signed=True)
    with ZmqEventSubscriber(peer.endpoint, peer.replay_endpoint, replay_timeout_ms=2000) as sub:
        asker, outcome = _in_thread(sub.catch_up)  # a first round trip: the connection is up
        peer.router.send_multipart([_request(peer), b"", end, b""])
        asker.join(GUARD_S)
        assert outcome == {"got": []}
        asker, outcome = _in_thread(sub.catch_up)
        late = _request(peer)  # not answered in time
        asker.join(GUARD_S)
        assert isinstance(outcome.get("error"), ReplayUnanswered)
        peer.router.send_multipart([late, b"", end, b""])  # the late answer: nothing buffered then
        sub.replay_timeout_ms = GUARD_MS
        asker, outcome = _in_thread(sub.catch_up)
        now = _request(peer)  # the buffer now holds batch 0: the answer says so
        peer.router.send_multipart([now, b"", _seq(0), encode(_batch(5))])
        peer.router.send_multipart([now, b"", end, b""])
        asker.join(GUARD_S)
        assert outcome == {"got": [(0, _batch(5))]}


def test_a_gap_whose_replay_does_not_answer_loses_only_the_gap(peer):
    """receive raised ReplayUnanswered and dropped every batch it had already taken, and the one after the gap."""
    with ZmqEventSubscriber(peer.endpoint, peer.replay_endpoint, replay_timeout_ms=0) as sub:
        got = peer.connect(sub)  # the ROUTER never answers
        peer.pub.send_multipart([b"", _seq(1), encode(_batch(1))])
        peer.pub.send_multipart([b"", _seq(3), encode(_batch(3))])
        got += _receive_until(sub, 3)
        assert [s for s, _ in got] == [0, 1, 3]
        assert (sub.lost, sub.unanswered, sub.next_seq) == (1, 1, 4)


def test_a_closed_subscriber_refuses_to_receive_and_closes_twice():
    sub = ZmqEventSubscriber("tcp://127.0.0.1:1", "tcp://127.0.0.1:1")
    sub.close()
    sub.close()
    for call in (sub.receive, sub.catch_up):
        with pytest.raises(SubscriberClosed):  # was zmq's "Operation not supported"
            call()


@pytest.mark.parametrize("make", [
    lambda: ZmqEventSubscriber("tcp://127.0.0.1:1", topic="\udc80"),
    lambda: ZmqEventPublisher(topic="\udc80"),
    lambda: ZmqEventPublisher(hwm=1 << 40),  # OverflowError, with a ZMQ context left open to hang the exit
])
def test_arguments_zmq_cannot_take_are_config_errors_and_leave_nothing_open(make):
    threads = threading.active_count()
    with pytest.raises(ConfigError):
        make()
    assert threading.active_count() == threads


# ------------------------------------------------------------------ publisher


def _sender_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "kv-event-publisher" and t.is_alive()}


def test_a_publisher_dropped_without_close_stops_its_thread_and_frees_its_port():
    """Its sender thread held the publisher: a thread, two sockets, a context and 9 fds stayed, each time."""
    import gc

    before = _sender_threads()
    endpoints = []
    for i in range(3):
        pub = ZmqEventPublisher()
        pub.publish(_batch(i))
        endpoints.append((pub.endpoint, pub.replay_endpoint))
        del pub
    gc.collect()
    assert _sender_threads() == before
    for endpoint, replay_endpoint in endpoints:  # the sockets were closed: their ports bind again
        ZmqEventPublisher(endpoint, replay_endpoint).close()


def test_a_batch_that_cannot_be_sent_is_refused_and_the_sender_lives_on():
    """A batch msgspec could not encode killed the sender thread: nothing published after it went out."""
    with ZmqEventPublisher() as pub, ZmqEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:
        for bad in (None, KVEventBatch(0.0, [object()]), KVEventBatch(0.0, [BlockStored("abc", None, [], 4, None,
                                                                                          "GPU")])):
            with pytest.raises(ConfigError, match="publish"):
                pub.publish(bad)
        assert pub.next_seq == 0
        assert pub.publish(_batch(1)) == 0
        assert pub.wait_sent(GUARD_S) and pub.sent == 1
        assert sub.catch_up() == [(0, _batch(1))]


def test_a_refused_batch_is_left_as_it_came_and_a_published_one_is_sent_as_it_was():
    with ZmqEventPublisher(data_parallel_rank=2) as pub, ZmqEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:
        bad = KVEventBatch(0.0, [object()])
        with pytest.raises(ConfigError):
            pub.publish(bad)
        assert bad.data_parallel_rank is None
        good = _batch(1)
        pub.publish(good)
        good.events.append(AllBlocksCleared())  # the caller reuses its struct: the replay still sends the original
        assert sub.catch_up() == [(0, KVEventBatch(0.0, [BlockRemoved([1], "GPU")], 2))]


@pytest.mark.parametrize("timeout", [float("nan"), "1", None, -1.0])
def test_a_bad_wait_sent_timeout_is_a_config_error(timeout):
    with ZmqEventPublisher() as pub:
        with pytest.raises(ConfigError, match="timeout"):
            pub.wait_sent(timeout)


def test_a_full_queue_never_blocks_publish_and_the_drops_show_as_gaps_replay_fills():
    with ZmqEventPublisher(max_queue_size=1, busy_pause_s=0) as pub, \
            ZmqEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:
        for n in range(50):
            pub.publish(_batch(n))
        assert pub.wait_sent(GUARD_S) and pub.sent + pub.dropped == 50
        got = sub.catch_up()
        assert [s for s, _ in got] == list(range(50)) and sub.lost == 0
    with pytest.raises(PublisherClosed):
        pub.publish(_batch(1))


# ------------------------------------------------------------------ hook


def test_a_failing_sink_inside_a_transition_leaves_the_cache_going_and_loses_no_event():
    """The sink raised out of the residency listener: the insert's backup was never started, its events lost."""
    cache, ex = make_cache(device_pages=8, host_pages=16, config=CacheConfig(write_policy="write_through"))
    index = PrefixIndex()
    down = {"now": False}

    def sink(batch):
        if down["now"]:
            raise RuntimeError("sink down")
        index.apply(0, batch)

    hook = enable_kv_events(cache, sink, max_batch_events=1)
    down["now"] = True
    put(cache, pages(2))  # raised the sink's error out of the cache
    drain(cache, ex)
    assert isinstance(hook.sink_error, RuntimeError)
    with pytest.raises(RuntimeError, match="sink down"):
        hook.flush()  # the engine's own flush hears of it
    down["now"] = False
    hook.flush()
    actual = cache_contents(cache)
    assert actual["host"]  # the write-through backup went on
    for tier in MEMORY_TIERS:
        assert index.blocks(0, tier) == actual[tier]
    disable_kv_events(cache, hook)
    cache.close()


def test_disabling_with_a_closed_publisher_still_stops_listening():
    cache, _ = make_cache()
    pub = ZmqEventPublisher()
    hook = enable_kv_events(cache, pub.publish)
    pub.close()
    put(cache, pages(1))
    with pytest.raises(PublisherClosed):
        disable_kv_events(cache, hook)
    assert not cache.driver.listening(hook)  # was left listening, queueing for a sink that is gone
    cache.close()


# ------------------------------------------------------------------ index and router

_EVENT = st.one_of(
    st.builds(lambda h, m: BlockStored(h, None, [], 4, None, m), st.lists(st.integers(0, 9), max_size=4),
              st.sampled_from(["GPU", "CPU_TIER1", "CPU_TIER2", "NPU"])),
    st.builds(lambda h, m: BlockRemoved(h, m), st.lists(st.integers(0, 9), max_size=4),
              st.sampled_from(["GPU", "CPU_TIER1", "CPU_TIER2"])),
    st.just(AllBlocksCleared()))
_BAD = st.sampled_from([None, "BlockStored", BlockStored("12", None, [], 4, None, "GPU"),
                        BlockRemoved([1, "2"], "GPU"), BlockRemoved([1], ["GPU"]), BlockStored(None, None, [], 4,
                                                                                               None, "GPU")])


def _view(index: PrefixIndex) -> dict:
    return {(i, t): index.blocks(i, t) for i in index.instances for t in ("device", "host", "storage")}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.lists(_EVENT, max_size=4)), max_size=12),
       st.integers(0, 2), st.lists(_EVENT, max_size=3), _BAD, st.integers(0, 3))
def test_a_batch_with_one_bad_event_changes_nothing(history, instance, good, bad, at):
    """Events before the bad one were applied, then AttributeError / TypeError (or str letters taken as hashes)."""
    index = PrefixIndex()
    for i, events in history:
        index.apply(i, KVEventBatch(0.0, events))
    before = _view(index)
    shared = [index.prefix_pages(i, list(range(10)), (), shared_storage=True) for i in range(3)]
    events = list(good)
    events.insert(min(at, len(events)), bad)
    with pytest.raises(ConfigError):
        index.apply(instance, KVEventBatch(0.0, events))
    assert _view(index) == before
    assert [index.prefix_pages(i, list(range(10)), (), shared_storage=True) for i in range(3)] == shared


def test_an_unhashable_instance_is_a_config_error():
    index = PrefixIndex()
    for ask in (lambda: index.apply(["a"], _batch(1)), lambda: index.prefix_pages({}, [1]),
                lambda: index.blocks(["a"], "device")):
        with pytest.raises(ConfigError, match="hashable"):
            ask()
    assert index.instances == []


@pytest.mark.parametrize("policy", ["prefix_aware", "prefix_aware_capped"])
def test_a_router_given_an_iterator_of_hashes_weighs_every_instance_on_all_of_them(policy):
    """The first instance weighed read the iterator; every other saw no hash, so the longest prefix lost."""
    index = PrefixIndex()
    index.apply(1, KVEventBatch(0.0, [BlockStored([1, 2], None, [], 4, None, "GPU")]))
    assert Router(2, policy, index).place(iter([1, 2])) == 1
    assert index.longest_prefixes(iter([1, 2]), [0, 1]) == {0: 0, 1: 2}
    with pytest.raises(ConfigError, match="in order"):
        Router(2, policy, index).place({1, 2})  # a set has no order: its "prefix" is arbitrary


@pytest.mark.parametrize("hashes", [[[1], [2]], [{"h": 1}], [1.0, 2.0], [float("nan")], [None], [True, 2]])
def test_hashes_that_are_not_ints_are_a_config_error_not_a_silent_miss(hashes):
    """A list of lists raised an untyped TypeError from the set lookup; floats and NaN silently matched nothing."""
    index = PrefixIndex()
    index.apply(0, KVEventBatch(0.0, [BlockStored([1, 2], None, [], 4, None, "GPU")]))
    for ask in (lambda: index.prefix_pages(0, hashes), lambda: index.longest_prefixes(hashes, [0]),
                lambda: Router(1, "prefix_aware", index).place(hashes)):
        with pytest.raises(ConfigError, match="must be ints"):
            ask()


# ------------------------------------------------------------------ cluster replay


@pytest.mark.parametrize("kw, named", [
    (dict(trace=None), "trace must be a Trace"), (dict(trace="trace.jsonl"), "trace must be a Trace"),
    (dict(instances=5000), "instances must be an int from 1 to 1024"),
])
def test_cluster_options_refuse_what_the_replay_could_not_run(kw, named):
    base = dict(trace=Trace("t", 64, ()), device_tokens=1024, host_tokens=2048, device="cpu")
    with pytest.raises(ConfigError, match=named):
        ClusterOptions(**{**base, **kw})
    with pytest.raises(ConfigError, match="ClusterOptions"):
        run_cluster(None)


def test_an_empty_trace_replays_to_an_empty_result():
    result = run_cluster(ClusterOptions(Trace("t", 64, ()), instances=2, device_tokens=1024, host_tokens=2048,
                                        device="cpu", storage=False))
    assert result.hit_rate == 0.0 and result.staleness.decisions == 0 and result.index_checks == 0


# ------------------------------------------------------------------ found by an outside probe


@pytest.mark.parametrize("namespace, lora", [(2**70, (None, str(2**70))), (-(2**70), (None, str(-(2**70)))),
                                             ("\ud800", (None, "\\ud800")), (7, (7, None)), ("t", (None, "t"))])
def test_every_namespace_has_a_wire_form_and_the_sender_lives_on(namespace, lora):
    """An int past int64 or text no UTF-8 holds killed the publisher's thread: nothing was sent after it."""
    cache, ex = make_cache(device_pages=6, host_pages=10, config=CacheConfig(write_policy="write_through"))
    with ZmqEventPublisher() as pub, ZmqEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:
        hook = enable_kv_events(cache, pub.publish)
        put(cache, pages(1), namespace=namespace)
        put(cache, pages(1, start=50))
        drain(cache, ex)
        hook.flush()
        assert pub.wait_sent(GUARD_S) and pub.unrenderable == 0
        events = [e for _, batch in sub.catch_up() for e in batch.events if isinstance(e, BlockStored)]
        assert (events[0].lora_id, events[0].lora_name) == lora and len(events) >= 2
    cache.close()


def test_a_pending_batch_that_cannot_be_rendered_is_skipped_and_the_sender_lives_on():
    from hicache_fsm.events.pending import PendingBatch

    with ZmqEventPublisher() as pub, ZmqEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:
        pub.publish(PendingBatch("x", [], None, 4))  # hand-made: its timestamp cannot be packed
        pub.publish(_batch(1))
        assert pub.wait_sent(GUARD_S) and (pub.sent, pub.unrenderable) == (1, 1)
        assert sub.catch_up() == [(1, _batch(1))] and sub.lost == 1


def test_a_payload_nested_past_the_stack_is_malformed_and_loses_nothing_else(peer):
    import struct

    bomb = b"\x93\xcb" + struct.pack(">d", 1.0) + b"\x91" * 100_000 + b"\xc0\xc0"
    # the raw peer answers no replay: the gap the bomb leaves is asked for, unanswered, and counted lost
    with ZmqEventSubscriber(peer.endpoint, peer.replay_endpoint, replay_timeout_ms=200) as sub:
        peer.connect(sub)
        peer.pub.send_multipart([b"", _seq(1), encode(_batch(1))])
        peer.pub.send_multipart([b"", _seq(2), bomb])
        peer.pub.send_multipart([b"", _seq(3), encode(_batch(3))])
        got = _receive_until(sub, 3)
        assert [s for s, _ in got] == [1, 3] and (sub.malformed, sub.lost, sub.unanswered) == (1, 1, 1)


@pytest.mark.parametrize("batch", [KVEventBatch(1.0, [BlockRemoved([2**70], "GPU")]),
                                   KVEventBatch(1.0, [BlockRemoved([[[]]] * 1 + [1], "GPU")])])
def test_a_batch_msgpack_cannot_hold_is_refused_and_left_as_it_came(batch):
    with ZmqEventPublisher(data_parallel_rank=3) as pub:
        with pytest.raises(ConfigError, match="publish"):
            pub.publish(batch)
        assert batch.data_parallel_rank is None and pub.next_seq == 0


@pytest.mark.parametrize("call", ["receive", "replay"])
def test_a_wait_beyond_any_thread_wait_is_a_config_error(call):
    with ZmqEventPublisher() as pub:
        if call == "receive":
            with ZmqEventSubscriber(pub.endpoint) as sub, pytest.raises(ConfigError, match="at most"):
                sub.receive(timeout_ms=2**63)
        else:
            with pytest.raises(ConfigError, match="at most"):
                ZmqEventSubscriber(pub.endpoint, pub.replay_endpoint, replay_timeout_ms=2**62)


def test_refused_hook_calls_change_nothing():
    from hicache_fsm.events.hook import KVEventHook, reset_with_events

    cache, ex = make_cache(device_pages=6, host_pages=10)
    put(cache, pages(1))
    drain(cache, ex)
    before = cache_contents(cache)
    with pytest.raises(ConfigError, match="KVEventHook"):
        reset_with_events(cache, "not a hook")
    assert cache_contents(cache) == before  # the reset did not run
    with pytest.raises(ConfigError, match="HiCache"):
        enable_kv_events(None, print)
    with pytest.raises(ConfigError, match="KVEventHook"):
        disable_kv_events(cache, object())
    with pytest.raises(ConfigError, match="page_size"):
        KVEventHook(cache.driver.machine.spec, 0, print)
    cache.close()


# ------------------------------------------------------------------ found by a second outside probe


@pytest.mark.parametrize("buffer_steps", [2, 10, 64])
def test_a_replay_is_answered_whole_after_earlier_replays_of_the_same_subscriber(buffer_steps):
    """The reader reports its reads to the ROUTER every half high-water mark: earlier answers still counted, and a
    full buffer's answer passed the mark (dropped without a word, ReplayUnanswered after the timeout)."""
    with ZmqEventPublisher(buffer_steps=buffer_steps) as pub, \
            ZmqEventSubscriber("tcp://127.0.0.1:1", pub.replay_endpoint, replay_timeout_ms=GUARD_MS) as sub:
        for earlier in range(4):
            for _ in range(buffer_steps):
                pub.publish(KVEventBatch(0.0, [AllBlocksCleared()]))
            assert pub.wait_sent(GUARD_S)
            assert len(sub.catch_up()) == buffer_steps, earlier
            for _ in range(earlier):
                assert sub.catch_up() == []  # nothing new: answers of one end marker


def test_publishers_on_several_threads_number_and_send_in_one_order():
    with ZmqEventPublisher(busy_pause_s=0) as pub, ZmqEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:
        def work(t: int) -> None:
            for i in range(200):
                pub.publish(KVEventBatch(0.0, [BlockStored([t * 10_000 + i], None, [], 4, None, "GPU")], t))

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert pub.wait_sent(GUARD_S)
        got = sub.catch_up()
        assert [seq for seq, _ in got] == list(range(800)) and sub.restarts == 0 and sub.lost == 0


@pytest.mark.parametrize("rank", [-5, 2**63, 2**64])
def test_a_rank_no_batch_can_carry_is_refused_where_it_is_given(rank):
    cache, _ = make_cache()
    try:
        with pytest.raises(ConfigError, match="data_parallel_rank"):
            ZmqEventPublisher(data_parallel_rank=rank)
        with pytest.raises(ConfigError, match="data_parallel_rank"):
            enable_kv_events(cache, [].append, data_parallel_rank=rank)
        with ZmqEventPublisher() as pub:
            with pytest.raises(ConfigError, match="data_parallel_rank"):
                pub.publish(KVEventBatch(0.0, [], rank))
            assert pub.next_seq == 0
    finally:
        cache.close()


def test_a_flush_from_another_thread_is_refused_and_loses_nothing():
    from hicache_fsm.errors import WrongThread

    cache, _ = make_cache()
    got: list = []
    hook = enable_kv_events(cache, got.append)
    put(cache, pages(2))
    raised = []
    other = threading.Thread(target=lambda: raised.append(pytest.raises(WrongThread, hook.flush)))
    other.start()
    other.join(GUARD_S)
    assert raised and len(got) == 1  # the snapshot only: the insert's events still queued here
    hook.flush()
    assert len(got) == 2
    cache.close()


def test_a_decoder_that_raises_counts_the_batch_malformed_and_keeps_the_others():
    calls = [0]

    def flaky(payload: bytes) -> KVEventBatch:
        from hicache_fsm.events.schema import decode

        calls[0] += 1
        if calls[0] == 3:
            raise KeyError("decoder bug")
        return decode(payload)

    with ZmqEventPublisher() as pub, \
            ZmqEventSubscriber("tcp://127.0.0.1:1", pub.replay_endpoint, decoder=flaky) as sub:
        for _ in range(5):
            pub.publish(KVEventBatch(0.0, [AllBlocksCleared()]))
        assert pub.wait_sent(GUARD_S)
        got = sub.catch_up()  # raised KeyError, after taking 0 and 1: they were never handed out
        assert [seq for seq, _ in got] == [0, 1, 3, 4] and sub.malformed == 1 and sub.next_seq == 5


@pytest.mark.parametrize("call", [
    lambda ix: ix.prefix_pages(0, [1], None), lambda ix: ix.prefix_pages(0, [1], 5),
    lambda ix: ix.prefix_pages(0, [1], [["device"]]), lambda ix: ix.blocks(0, ["device"]),
    lambda ix: ix.longest_prefixes([1], None),
    lambda ix: ix.apply(0, KVEventBatch(0.0, [BlockStored([True], None, [], 4, None, "GPU")])),
    lambda ix: ix.apply(0, KVEventBatch(0.0, [BlockStored([2**100], None, [], 4, None, "GPU")])),
    lambda ix: ZmqEventPublisher("tcp://127.0.0.1:*", "inproc://r\udcff"),
    lambda ix: ZmqEventSubscriber("inproc://x\udcff"),
], ids=["tiers None", "tiers 5", "tiers nested", "blocks list", "instances None", "hash True", "hash 2**100",
        "surrogate replay endpoint", "surrogate endpoint"])
def test_router_and_socket_arguments_of_the_wrong_kind_are_config_errors(call):
    index = PrefixIndex()
    with pytest.raises(ConfigError):
        call(index)
    assert index.instances == []
