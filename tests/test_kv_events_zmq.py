"""KV events over real ZMQ sockets on 127.0.0.1: another process decodes them; drops are recovered by replay."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading

import pytest

from cache_helpers import drain, make_cache, pages, put
from hicache_fsm.config import CacheConfig
from hicache_fsm.events.contents import MEMORY_TIERS, cache_contents
from hicache_fsm.events.hook import enable_kv_events
from hicache_fsm.errors import ConfigError
from hicache_fsm.events.publisher import Pacing, PublisherClosed, ZmqEventPublisher
from hicache_fsm.events.schema import BlockRemoved, BlockStored, KVEventBatch
from hicache_fsm.events.subscriber import ZmqEventSubscriber
from hicache_fsm.router import PrefixIndex

pytest.importorskip("zmq")

# A subscriber written against the vLLM/SGLang schema alone: it declares its own structs, as vLLM
# declares them (array_like: each struct is a msgpack array in field order, an event's tag first).
SUBSCRIBER = textwrap.dedent("""
    import json, sys
    from typing import Optional, Union
    import msgspec, zmq

    class Ev(msgspec.Struct, array_like=True, tag=True, omit_defaults=True):
        pass
    class BlockStored(Ev):
        block_hashes: list[int]
        parent_block_hash: Optional[int]
        token_ids: list[int]
        block_size: int
        lora_id: Optional[int]
        medium: Optional[str]
        lora_name: Optional[str] = None
    class BlockRemoved(Ev):
        block_hashes: list[int]
        medium: Optional[str]
    class AllBlocksCleared(Ev):
        pass
    class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
        ts: float
        events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
        data_parallel_rank: Optional[int] = None

    endpoint, replay_endpoint, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dec = msgspec.msgpack.Decoder(KVEventBatch)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB); sub.setsockopt(zmq.SUBSCRIBE, b""); sub.connect(endpoint)
    rep = ctx.socket(zmq.DEALER); rep.connect(replay_endpoint)
    got = {}
    def replay(start):
        rep.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            _, seq, payload = rep.recv_multipart()
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == -1:
                return
            got.setdefault(seq, dec.decode(payload))
    def next_missing():
        n = 0
        while n in got:
            n += 1
        return n
    replay(0)
    print("ready", flush=True)
    live = 0
    while next_missing() < total:
        if sub.poll(200):
            _, seq, payload = sub.recv_multipart()
            seq = int.from_bytes(seq, "big")
            live += 1
            if seq > next_missing():
                replay(next_missing())
            got.setdefault(seq, dec.decode(payload))
        else:
            replay(next_missing())
    out = [[[type(e).__name__, getattr(e, "medium", None), getattr(e, "block_hashes", [])] for e in got[s].events]
           for s in range(total)]
    print(json.dumps({"batches": out, "live": live}), flush=True)
    sub.close(0); rep.close(0); ctx.term()
""")


def _summary(batches: list[KVEventBatch]) -> list:
    return [[[type(e).__name__, getattr(e, "medium", None), list(getattr(e, "block_hashes", []))] for e in b.events]
            for b in batches]


def test_a_subscriber_in_another_process_decodes_the_events():
    cache, ex = make_cache(device_pages=4, host_pages=16, config=CacheConfig(write_policy="write_through"))
    sent: list[KVEventBatch] = []
    with ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:
        def publish(batch):
            sent.append(batch)
            pub.publish(batch)
        hook = enable_kv_events(cache, publish)
        put(cache, pages(3))
        hook.flush()
        drain(cache, ex)
        put(cache, pages(3, start=500))  # evicts the first prefix from the device: removals
        drain(cache, ex)
        hook.flush()
        total = len(sent) + 1
        proc = subprocess.Popen([sys.executable, "-c", SUBSCRIBER, pub.endpoint, pub.replay_endpoint, str(total)],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "ready"
            put(cache, pages(2, start=900))  # published while the subscriber listens live
            hook.flush()
            assert len(sent) == total
            out, _ = proc.communicate(timeout=120)  # a bound for a hung child only
        finally:
            proc.kill()
        assert proc.returncode == 0
    result = json.loads(out)
    assert result["batches"] == _summary(sent)
    media = {m for b in result["batches"] for _, m, _ in b}
    assert {"GPU", "CPU_TIER1"} <= media
    cache.close()


def test_dropped_batches_are_seen_as_gaps_and_recovered_by_replay():
    cache, ex = make_cache(device_pages=6, host_pages=10, config=CacheConfig(write_policy="write_through"))
    index = PrefixIndex()
    with ZmqEventPublisher(max_queue_size=1) as pub, ZmqEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:
        hook = enable_kv_events(cache, pub.publish, max_batch_events=1)  # one event a batch: many batches
        for start in range(0, 2000, 100):
            put(cache, pages(2) + pages(1, start=1000 + start))
            drain(cache, ex)
        hook.flush()
        assert pub.dropped > 0  # the queue holds one batch: most are not sent live
        while sub.next_seq < pub.next_seq:
            batches = sub.receive(timeout_ms=50) or sub.catch_up()
            for _, batch in batches:
                index.apply(0, batch)
        assert sub.replayed > 0 and sub.lost == 0
        actual = cache_contents(cache)
        for tier in MEMORY_TIERS:
            assert index.blocks(0, tier) == actual[tier]
    cache.close()


def test_messages_that_are_not_batches_are_counted_and_skipped_and_their_batch_is_a_gap():
    """A router's receive loop survives a peer that sends garbage: nothing raises, the count says what happened."""
    import zmq

    from hicache_fsm.events.schema import encode

    def seq(n: int) -> bytes:
        return n.to_bytes(8, "big")

    batch = KVEventBatch(0.0, [BlockRemoved([7], "GPU")])
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    try:
        with ZmqEventSubscriber(f"tcp://127.0.0.1:{port}") as sub:
            got = []
            for _ in range(200):  # until the subscription has reached the PUB socket (no replay socket here)
                pub.send_multipart([b"", seq(0), encode(batch)])
                got = sub.receive(timeout_ms=50)
                if got:
                    break
            assert got and got[0][0] == 0 and sub.next_seq == 1
            sub.receive(timeout_ms=50)  # any repeats of the probe: already had
            pub.send_multipart([b"", seq(1), b"\x01not msgpack of a batch"])  # payload: the batch of seq 1 is lost
            pub.send_multipart([b"one frame"])
            pub.send_multipart([b"", b"\x00\x00\x00\x02", encode(batch)])  # a 4-byte sequence number
            pub.send_multipart([b"", seq(2), encode(batch)])
            later = []
            for _ in range(200):
                later += sub.receive(timeout_ms=50)
                if later:
                    break
            assert later == [(2, batch)]
            assert (sub.malformed, sub.gaps, sub.lost, sub.next_seq) == (3, 1, 1, 3)
    finally:
        pub.close(linger=0)
        ctx.term()


def test_events_a_newer_engine_encodes_as_maps_are_read_like_arrays():
    """vLLM's structs dropped ``array_like`` (each event a map, its tag under "type", with fields this schema
    lacks): every batch of such an engine was malformed to the subscriber, and its router saw nothing."""
    from typing import Optional, Union

    import msgspec
    import zmq

    from hicache_fsm.events.schema import AllBlocksCleared, decode

    class Ev(msgspec.Struct, tag=True, omit_defaults=True):  # as newer vLLM declares them: no array_like
        pass

    class BlockStored_(Ev, tag="BlockStored"):
        block_hashes: list[int]
        parent_block_hash: Optional[int]
        token_ids: list[int]
        block_size: int
        lora_id: Optional[int]
        medium: Optional[str]
        lora_name: Optional[str]
        extra_keys: Optional[list] = None
        group_idx: Optional[int] = None
        kv_cache_spec_kind: Optional[str] = None

    class BlockRemoved_(Ev, tag="BlockRemoved"):
        block_hashes: list[int]
        medium: Optional[str]
        group_idx: Optional[int] = None

    class AllBlocksCleared_(Ev, tag="AllBlocksCleared"):
        pass

    class Batch(msgspec.Struct, array_like=True, omit_defaults=True):
        ts: float
        events: list[Union[BlockStored_, BlockRemoved_, AllBlocksCleared_]]
        data_parallel_rank: Optional[int] = None

    sent = Batch(1.5, [AllBlocksCleared_(),
                       BlockStored_([1, 2 ** 63 + 5], None, list(range(32)), 16, None, "GPU", None, [None], 0,
                                    "full_attention"),
                       BlockRemoved_([1], "GPU", 0)], 3)
    payload = msgspec.msgpack.encode(sent)
    assert isinstance(msgspec.msgpack.decode(payload)[1][1], dict)  # the map form indeed
    want = KVEventBatch(1.5, [AllBlocksCleared(), BlockStored([1, 2 ** 63 + 5], None, list(range(32)), 16, None,
                                                              "GPU"), BlockRemoved([1], "GPU")], 3)
    assert decode(payload) == want
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    try:
        with ZmqEventSubscriber(f"tcp://127.0.0.1:{port}") as sub:
            got = []
            for _ in range(200):  # until the subscription has reached the PUB socket
                pub.send_multipart([b"", (0).to_bytes(8, "big"), payload])
                got = sub.receive(timeout_ms=50)
                if got:
                    break
            assert got[:1] == [(0, want)] and sub.malformed == 0
            index = PrefixIndex()
            index.apply(0, got[0][1])
            assert index.blocks(0, "device") == {2 ** 63 + 5}
    finally:
        pub.close(linger=0)
        ctx.term()


def test_an_endpoint_zmq_cannot_connect_to_is_a_config_error():
    with pytest.raises(ConfigError, match="cannot connect to 'not an endpoint'"):
        ZmqEventSubscriber("not an endpoint")


@pytest.mark.parametrize("arguments, named", [
    ({"endpoint": 5}, "endpoint"),
    ({"replay_endpoint": b"tcp://127.0.0.1:*"}, "replay_endpoint"),
    ({"topic": None}, "topic"),
    ({"decoder": "msgpack"}, "decoder"),
    ({"replay_timeout_ms": -1}, "replay_timeout_ms"),
    ({"replay_timeout_ms": 1.5}, "replay_timeout_ms"),
])
def test_bad_subscriber_arguments_are_config_errors(arguments, named):
    with pytest.raises(ConfigError, match=named):
        ZmqEventSubscriber(**{"endpoint": "tcp://127.0.0.1:1", **arguments})


def test_a_negative_receive_wait_is_refused_not_a_wait_forever():
    with ZmqEventSubscriber("tcp://127.0.0.1:1") as sub:
        with pytest.raises(ConfigError, match="timeout_ms"):
            sub.receive(timeout_ms=-1)  # zmq's poll reads a negative wait as no limit
        assert sub.receive(timeout_ms=0) == []


@pytest.mark.parametrize("arguments, named", [
    ({"endpoint": 5}, "endpoint"),
    ({"replay_endpoint": 5}, "replay_endpoint"),
    ({"topic": b"kv"}, "topic"),
    ({"data_parallel_rank": -1}, "data_parallel_rank"),
    ({"data_parallel_rank": "0"}, "data_parallel_rank"),
])
def test_bad_publisher_arguments_are_config_errors_before_any_thread_starts(arguments, named):
    threads = threading.active_count()
    try:
        ZmqEventPublisher(**arguments).close()  # closed if taken: its sender thread would outlive the test
    except ConfigError as exc:
        assert named in str(exc)
    else:
        pytest.fail(f"{arguments} was taken")
    assert threading.active_count() == threads


def test_publish_after_close_is_refused_and_close_is_idempotent():
    pub = ZmqEventPublisher()
    pub.close()
    pub.close()
    with pytest.raises(PublisherClosed):
        pub.publish(KVEventBatch(0.0, [BlockRemoved([1], "GPU")]))


def test_publisher_stamps_its_rank_and_numbers_batches():
    with ZmqEventPublisher(data_parallel_rank=3) as pub:
        batch = KVEventBatch(0.0, [BlockStored([1], None, [1, 2], 2, None, "GPU")])
        assert pub.publish(batch) == 0 and pub.publish(batch) == 1
        assert batch.data_parallel_rank == 3


def test_the_sender_gives_way_only_while_the_cache_steps_and_never_beyond_its_lag_bound():
    pacing = Pacing(pause_s=0.005, window_s=0.002, max_lag=3)
    assert pacing.give_way(since_publish_s=0.001, queued=2)  # a batch was just published: the cache steps
    assert not pacing.give_way(since_publish_s=0.003, queued=2)  # the cache is waiting: catch up
    assert not pacing.give_way(since_publish_s=0.001, queued=3)  # too far behind: send at once
    assert not Pacing(pause_s=0.0, window_s=0.002, max_lag=3).give_way(0.0, 0)  # pacing off


@pytest.mark.parametrize("option, value", [("busy_pause_s", -1.0), ("busy_window_s", float("inf")),
                                           ("busy_pause_s", True), ("max_lag", 0), ("max_lag", 1.5)])
def test_bad_pacing_options_are_refused_before_anything_is_bound(option, value):
    with pytest.raises(ConfigError):
        ZmqEventPublisher(**{option: value})


def test_a_paced_publisher_sends_everything_once_the_cache_waits():
    with ZmqEventPublisher(busy_pause_s=0.001, busy_window_s=0.05, max_lag=5) as pub:
        batch = KVEventBatch(0.0, [BlockRemoved([1], "GPU")])
        for _ in range(12):  # a publish "now" keeps the sender giving way until 5 are queued
            pub.publish(batch)
        assert pub.wait_sent(60.0)
        assert pub.sent == 12 and pub.dropped == 0
