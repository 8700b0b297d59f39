"""KV events: the spec's ``events:`` entries, the wire schema, and an index rebuilt from events alone."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_helpers import drain, in_thread, make_cache, pages, put
from hicache_fsm.config import CacheConfig
from hicache_fsm.diagrams import edge_label
from hicache_fsm.errors import ConfigError, HiCacheError, SpecError, StorageKeyError, WrongThread
from hicache_fsm.events.contents import MEMORY_TIERS, cache_contents
from hicache_fsm.events.hashes import PageChain, chained_digests, int64_hash, request_hashes
from hicache_fsm.events.hook import TIER_TAGS, disable_kv_events, enable_kv_events, reset_with_events
from hicache_fsm.events.names import parse_event
from hicache_fsm.events.pending import PendingBatch, accepts_pending
from hicache_fsm.events.schema import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode, encode
from hicache_fsm.events.wire import int64_array, int64_list, token_array, uint32_list
from hicache_fsm.router import PrefixIndex, Router
from hicache_fsm.spec import load_builtin, parse_spec

RESIDENCY = load_builtin("residency")


# ------------------------------------------------------------------ spec


def _spec_with_events(entry: str) -> str:
    return f"""name: tiny
initial: a
states:
  a: {{}}
  b: {{tags: [terminal]}}
transitions:
  - trigger: go
    source: a
    dest: b
    events: [{entry}]
"""


@pytest.mark.parametrize("entry, message", [
    ("stored:gpu", "event medium 'gpu' is unknown"),
    ("kept:device", "event kind 'kept' is unknown"),
    ("stored", "must be KIND:TIER"),
    ("stored:device, stored:device", "lists an event twice"),
])
def test_bad_events_entry_is_a_load_error_with_its_line(entry, message):
    with pytest.raises(SpecError) as err:
        parse_spec(_spec_with_events(entry), "tiny.yaml", require_bindings=False)
    assert message in str(err.value)
    assert err.value.line == 7


def test_events_entry_loads_and_shows_on_the_edge():
    spec = parse_spec(_spec_with_events("removed:host"), "tiny.yaml", require_bindings=False)
    assert spec.transitions[0].events == ("removed:host",)
    assert edge_label(spec.transitions[0]) == "go (-host)"


def test_residency_events_are_the_tier_readability_changes_of_each_transition():
    """Declared events = tiers readable after minus before (by state tags); L3 copies outlive a removed node."""
    tags = {s.name: s.tags for s in RESIDENCY.states}

    def readable(state):
        return {tier for tier, tag in TIER_TAGS.items() if tag in tags[state]}

    for t in RESIDENCY.transitions:
        for source in t.sources:
            before, after = readable(source), readable(t.dest)
            expected = {f"stored:{x}" for x in after - before} | {f"removed:{x}" for x in before - after}
            if RESIDENCY.state(t.dest).terminal:
                expected.discard("removed:storage")
            assert set(t.events) == expected, (t.trigger, source)
            assert all(parse_event(e) for e in t.events)


# ------------------------------------------------------------------ schema


def test_schema_has_vllms_field_names_in_order():
    assert BlockStored.__struct_fields__[:6] == (
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")
    assert BlockRemoved.__struct_fields__ == ("block_hashes", "medium")
    assert KVEventBatch.__struct_fields__ == ("ts", "events", "data_parallel_rank")
    batch = KVEventBatch(1.5, [BlockStored([1, -2], None, [7] * 8, 4, None, "GPU"), BlockRemoved([3], "CPU_TIER1"),
                               AllBlocksCleared()], 0)
    assert decode(encode(batch)) == batch
    # vLLM's structs are array_like: a batch is [ts, events, dp_rank], an event [tag, *fields] (lora_name last).
    raw = msgspec.msgpack.decode(encode(batch))
    assert raw == [1.5, [["BlockStored", [1, -2], None, [7] * 8, 4, None, "GPU", None], ["BlockRemoved", [3], "CPU_TIER1"],
                         ["AllBlocksCleared"]], 0]


def test_block_hash_is_sglangs_int64_of_the_page_key():
    assert int64_hash("ffffffffffffffff" + "0" * 48) == -1
    assert int64_hash("7fffffffffffffff" + "0" * 48) == (1 << 63) - 1
    assert int64_hash("0000000000000001" + "f" * 48) == 1


# ------------------------------------------------------------------ the hook on a real cache


def test_insert_backup_and_eviction_publish_per_tier():
    cache, ex = make_cache(device_pages=4, host_pages=16, config=CacheConfig(write_policy="write_through"))
    batches: list[KVEventBatch] = []
    hook = enable_kv_events(cache, batches.append)
    put(cache, pages(3))
    hook.flush()
    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    assert [e.medium for e in stored] == ["GPU"]
    assert stored[0].block_hashes == request_hashes(pages(3), 4)
    assert list(stored[0].token_ids) == list(pages(3)) and stored[0].block_size == 4
    drain(cache, ex)
    put(cache, pages(3, start=1000))  # needs the device room: the first prefix is evicted to the host
    drain(cache, ex)
    hook.flush()
    kinds = [(type(e).__name__, e.medium) for b in batches for e in b.events if not isinstance(e, AllBlocksCleared)]
    assert ("BlockStored", "CPU_TIER1") in kinds and ("BlockRemoved", "GPU") in kinds
    disable_kv_events(cache, hook)
    cache.close()


# ------------------------------------------------------------------ index from events == caches


class LossyChannel:
    """One instance's batches: numbered, kept for replay, delivered live unless dropped (as the ZMQ publisher)."""

    def __init__(self, drops) -> None:
        self.buffer: list[KVEventBatch] = []
        self.live: list[tuple[int, KVEventBatch]] = []
        self.drops = drops  # an iterator of booleans: drop this batch on the live path?

    def publish(self, batch: KVEventBatch) -> None:
        seq = len(self.buffer)
        self.buffer.append(batch)
        if not next(self.drops, False):
            self.live.append((seq, decode(encode(batch))))  # over the wire format


class Follower:
    """A subscriber: applies live batches in order, replays the gap when a sequence number jumps or at a check."""

    def __init__(self, index: PrefixIndex, instance: int, channel: LossyChannel) -> None:
        self.index, self.instance, self.channel = index, instance, channel
        self.next_seq = 0
        self.replayed = 0

    def catch_up(self, until: int) -> None:
        for seq in range(self.next_seq, until):
            self.index.apply(self.instance, decode(encode(self.channel.buffer[seq])))
            self.replayed += 1
        self.next_seq = max(self.next_seq, until)

    def receive(self) -> None:
        for seq, batch in self.channel.live:
            if seq > self.next_seq:
                self.catch_up(seq)
            if seq == self.next_seq:
                self.index.apply(self.instance, batch)
                self.next_seq += 1
        self.channel.live.clear()


PREFIXES = [pages(2, start=0), pages(1, start=100), pages(3, start=200)]
OPS = st.one_of(
    st.tuples(st.just("put"), st.integers(0, 1), st.integers(0, 2), st.integers(0, 3), st.integers(0, 5)),
    st.tuples(st.just("load"), st.integers(0, 1), st.integers(0, 2)),
    st.tuples(st.just("drain"), st.integers(0, 1)),
    st.tuples(st.just("reset"), st.integers(0, 1)),
)


def test_a_split_node_publishes_only_its_own_pages_when_it_leaves_a_tier():
    """A split gives the lower half the hashes of its own pages: with the whole old chain, evicting it removed
    the upper half's blocks from the router's index while the cache still held them."""
    cache, ex = make_cache(device_pages=8, host_pages=16, config=CacheConfig(write_policy="write_through"))
    batches: list = []
    hook = enable_kv_events(cache, batches.append)
    index = PrefixIndex()
    try:
        lower = put(cache, PREFIXES[0] + pages(1, start=1000)).node
        drain(cache, ex)
        put(cache, PREFIXES[0] + pages(1, start=1100))  # splits the first node after the shared two pages
        drain(cache, ex)
        assert cache.evict_node(lower) == cache.page_size
        hook.flush()
        for batch in batches:
            index.apply(0, batch)
        actual = cache_contents(cache)
        for tier in MEMORY_TIERS:
            assert index.blocks(0, tier) == actual[tier], tier
        removed = [e for b in batches for e in b.events if isinstance(e, BlockRemoved)]
        assert [len(e.block_hashes) for e in removed] == [1]
    finally:
        cache.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(OPS, min_size=1, max_size=25), drops=st.lists(st.booleans(), max_size=60))
def test_index_from_events_equals_every_cache_at_every_quiescent_point(ops, drops):
    drop_iter = iter(drops)
    index = PrefixIndex()
    caches, hooks, followers = [], [], []
    for i in range(2):
        cache, ex = make_cache(device_pages=6, host_pages=10, config=CacheConfig(write_policy="write_through"))
        channel = LossyChannel(drop_iter)
        hooks.append(enable_kv_events(cache, channel.publish, max_batch_events=3))
        caches.append((cache, ex))
        followers.append(Follower(index, i, channel))
    try:
        for op in ops:
            kind, i = op[0], op[1]
            cache, ex = caches[i]
            if kind == "put":
                _, _, p, n, tag = op
                put(cache, PREFIXES[p] + pages(n, start=1000 + 100 * tag))
            elif kind == "load":
                m = cache.match_prefix(PREFIXES[op[2]])
                if m.host_hit_length:
                    cache.load_back(m.last_host_node)
            elif kind == "drain":
                drain(cache, ex)
            else:  # a plain reset: the hook hears it from the driver (node ids start again from 1)
                drain(cache, ex)
                cache.reset()
            for j, (hook, follower) in enumerate(zip(hooks, followers)):  # a quiescent point: flush, deliver
                hook.flush()
                follower.receive()
                follower.catch_up(len(follower.channel.buffer))  # the tail a drop hid: the check replays it
                actual = cache_contents(caches[j][0])
                for tier in MEMORY_TIERS:
                    assert index.blocks(j, tier) == actual[tier], (op, j, tier)
    finally:
        for cache, _ in caches:
            cache.close()


@given(ids=st.lists(st.integers(0, (1 << 32) - 1), max_size=40), cut=st.integers(0, 10),
       prior=st.binary(min_size=32, max_size=32))
def test_a_chain_hashed_from_packed_bytes_and_its_split_halves_give_the_tokens_page_digests(ids, cut, prior):
    """A node's chain (packed little-endian uint32 key) has the tokens' own page digests; the halves of
    a split slice them, and a child chains on from the last page."""
    tokens = tuple(ids)
    packed = b"".join(i.to_bytes(4, "little") for i in tokens)
    expected = chained_digests(tokens, 4, prior)
    parent = PageChain(4, 1, ("slice", _Fixed(prior), 0, 1))
    node = _Node(packed, None)
    chain = PageChain.of_node(4, node, parent)
    assert chain.digests() == b"".join(expected)
    assert chain.int_keys() == [int.from_bytes(d[:8], "big", signed=True) for d in expected]
    cut = min(cut, chain.pages)
    upper, lower = chain.sliced(0, cut), chain.sliced(cut, chain.pages)
    assert upper.digests() + lower.digests() == chain.digests()
    if expected:
        assert chain.last_digest() == expected[-1]
        assert chain.last_int_key() == chain.int_keys()[-1]


def test_a_chain_reads_the_storage_tiers_keys_when_they_cover_its_pages():
    """Pages the storage tier already keyed are not hashed again; keys of a split node are not taken."""
    tokens = tuple(range(100, 116))
    packed = b"".join(i.to_bytes(4, "little") for i in tokens)
    keys = tuple(d.hex() for d in chained_digests(tokens, 4, b""))
    fake = tuple("ab" * 32 for _ in keys)  # keys that are not these pages' hashes: shows which were read
    assert PageChain.of_node(4, _Node(packed, fake), None).digests() == bytes.fromhex("".join(fake))
    assert PageChain.of_node(4, _Node(packed, fake[:2]), None).digests() == bytes.fromhex("".join(keys))
    assert PageChain.of_node(4, _Node(packed, None), None).digests() == bytes.fromhex("".join(keys))
    short = tuple("ab" * 8 for _ in keys)  # hex, but not 32-byte digests
    assert PageChain.of_node(4, _Node(packed, short), None).digests() == bytes.fromhex("".join(keys))


class _Fixed:
    def __init__(self, digest: bytes) -> None:
        self.value = digest

    def digests(self) -> bytes:
        return self.value


class _Node:
    def __init__(self, raw: bytes, storage_keys) -> None:
        self.raw, self.storage_keys, self.namespace = raw, storage_keys, None


@given(ids=st.lists(st.integers(0, (1 << 32) - 1), max_size=70),
       digests=st.lists(st.binary(min_size=32, max_size=32), max_size=40))
def test_lists_written_from_bytes_decode_as_the_ints_they_stand_for(ids, digests):
    """The msgpack arrays built from packed ids and joined digests read back as the ids and the int64 block hashes."""
    packed = b"".join(i.to_bytes(4, "little") for i in ids)
    assert msgspec.msgpack.decode(token_array(packed), type=list[int]) == ids == uint32_list(packed)
    narrow = [i & 0xFFFF for i in ids]  # every id fits 16 bits: the shorter items
    packed = b"".join(i.to_bytes(4, "little") for i in narrow)
    assert msgspec.msgpack.decode(token_array(packed), type=list[int]) == narrow
    ints = [int.from_bytes(d[:8], "big", signed=True) for d in digests]
    joined = b"".join(digests)
    assert msgspec.msgpack.decode(int64_array(joined), type=list[int]) == ints == int64_list(joined)


class PendingSink:
    """Keeps the hook's pending batches unrendered, as the ZMQ publisher's queue does until its thread runs."""

    def __init__(self) -> None:
        self.pending: list[PendingBatch] = []

    @accepts_pending
    def publish(self, batch: PendingBatch) -> None:
        assert isinstance(batch, PendingBatch)
        self.pending.append(batch)


def _wire(batch: KVEventBatch) -> list:
    return msgspec.to_builtins(batch.events)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(OPS, min_size=1, max_size=25))
def test_batches_rendered_after_the_tree_moved_on_equal_those_rendered_at_flush(ops):
    """Splits, evictions and resets after an event is recorded do not change what it renders to,
    as structs or as the bytes a publisher sends (hash and token lists written from bytes)."""
    made = [make_cache(device_pages=6, host_pages=10, config=CacheConfig(write_policy="write_through"))
            for _ in range(3)]
    now: list[KVEventBatch] = []
    later, sent = PendingSink(), PendingSink()
    hooks = [enable_kv_events(made[0][0], now.append, max_batch_events=3),
             enable_kv_events(made[1][0], later.publish, max_batch_events=3),
             enable_kv_events(made[2][0], sent.publish, max_batch_events=3)]
    try:
        for op in ops:
            for (cache, ex), hook in zip(made, hooks):
                if op[0] == "put":
                    put(cache, PREFIXES[op[2]] + pages(op[3], start=1000 + 100 * op[4]))
                elif op[0] == "load":
                    m = cache.match_prefix(PREFIXES[op[2]])
                    if m.host_hit_length:
                        cache.load_back(m.last_host_node)
                elif op[0] == "drain":
                    drain(cache, ex)
                else:
                    drain(cache, ex)
                    reset_with_events(cache, hook)
                hook.flush()
        assert [_wire(b) for b in now] == [_wire(p.render()) for p in later.pending]
        assert [_wire(b) for b in now] == [_wire(decode(p.payload())) for p in sent.pending]
        assert [_wire(b) for b in now] == [_wire(p.render()) for p in sent.pending]  # read back from the bytes
        # the bytes written piece by piece have the schema's array layout, field for field
        assert [msgspec.msgpack.decode(encode(b))[1:] for b in now] == [msgspec.msgpack.decode(p.payload())[1:]
                                                                        for p in sent.pending]
    finally:
        for cache, _ in made:
            cache.close()


# ------------------------------------------------------------------ router


def _index_with(instance_blocks: dict[int, list[int]]) -> PrefixIndex:
    index = PrefixIndex()
    for i, hashes in instance_blocks.items():
        index.apply(i, KVEventBatch(0.0, [BlockStored(hashes, None, [], 4, None, "GPU")]))
    return index


def test_prefix_aware_picks_the_longest_prefix_round_robin_cycles():
    index = _index_with({0: [1], 1: [1, 2, 3], 2: []})
    assert index.longest_prefixes([1, 2, 3, 4], range(3)) == {0: 1, 1: 3, 2: 0}
    assert Router(3, "prefix_aware", index).place([1, 2, 3, 4]) == 1
    rr = Router(3, "round_robin", index)
    assert [rr.place([1]) for _ in range(4)] == [0, 1, 2, 0]


def test_load_cap_spreads_requests_that_all_share_one_prefix():
    index = _index_with({0: [1, 2], 1: [], 2: []})
    capped = Router(3, "prefix_aware_capped", index, load_cap=1.5)
    choices = [capped.place([1, 2]) for _ in range(30)]
    assert max(choices.count(i) for i in range(3)) <= 1.5 * 30 / 3 + 2
    uncapped = Router(3, "prefix_aware", index)
    assert {uncapped.place([1, 2]) for _ in range(30)} == {0}


def test_router_rejects_bad_settings():
    with pytest.raises(ConfigError):
        Router(0, "prefix_aware", PrefixIndex())
    with pytest.raises(ConfigError):
        Router(2, "random", PrefixIndex())
    with pytest.raises(ConfigError):
        Router(2, "prefix_aware_capped", PrefixIndex(), load_cap=0.5)
    with pytest.raises(ConfigError, match="index must be a PrefixIndex"):  # failed at the first placement
        Router(2, "prefix_aware", "index")
    for policy in ("round_robin", "prefix_aware"):
        with pytest.raises(ConfigError, match="block hashes"):
            Router(2, policy, PrefixIndex()).place("1,2")  # prefix_aware read the letters as hashes: no match


def test_index_questions_with_the_wrong_shapes_are_refused_or_read_as_meant():
    index = _index_with({0: [1, 2, 3]})
    assert index.prefix_pages(0, [1, 2], "device") == index.prefix_pages(0, [1, 2], ("device",)) == 2  # one tier
    assert index.longest_prefixes([1, 2], [0], "device") == {0: 2}  # was "unknown tier 'd'"
    for hashes in ("12", None, b"\x01"):
        with pytest.raises(ConfigError, match="block hashes"):
            index.prefix_pages(0, hashes)
    for batch in (None, "BlockStored", [BlockRemoved([3], "GPU")]):  # an AttributeError before
        with pytest.raises(ConfigError, match="apply takes a KVEventBatch"):
            index.apply(0, batch)
    assert index.prefix_pages(0, [1, 2, 3]) == 3  # nothing applied


def test_removed_and_cleared_take_blocks_out_of_the_index():
    index = _index_with({0: [1, 2, 3]})
    index.apply(0, KVEventBatch(0.0, [BlockRemoved([3], "GPU")]))
    assert index.prefix_pages(0, [1, 2, 3]) == 2
    index.apply(0, KVEventBatch(0.0, [AllBlocksCleared()]))
    assert index.blocks(0, "device") == frozenset()


def test_questions_about_an_instance_change_nothing_and_an_unknown_tier_is_refused():
    index = _index_with({0: [1, 2, 3]})
    assert index.prefix_pages(9, [1, 2]) == 0 and index.blocks(9, "host") == frozenset()
    assert index.longest_prefixes([1, 2], [0, 9]) == {0: 2, 9: 0}
    assert index.instances == [0]  # a router asking about instance 9 does not make it one
    for ask in (lambda: index.prefix_pages(0, [1], ("gpu",)), lambda: index.blocks(0, "L2")):
        with pytest.raises(ConfigError, match="unknown tier .*; tiers are device, host, storage"):
            ask()


def test_block_hashes_are_the_storage_tiers_page_keys():
    from hicache_fsm.storage.keys import page_keys
    from hicache_fsm.storage.tier import namespace_seed

    tokens = tuple(range(40_000, 40_064))
    for namespace in (None, "tenant-a", 7):
        keys = page_keys(tokens, 16, namespace_seed(namespace))
        assert request_hashes(tokens, 16, namespace) == [int64_hash(k) for k in keys]
    with pytest.raises(StorageKeyError):  # page keys encode 4-byte ids, here as in storage
        request_hashes((1 << 40,) * 16, 16)
    for page_size in (0, -16, 16.0, True):  # 0 was a ZeroDivisionError
        with pytest.raises(StorageKeyError, match="page_size must be a positive int"):
            request_hashes(tokens, page_size)


def test_enabling_on_a_running_cache_starts_with_a_snapshot_of_it():
    cache, ex = make_cache(device_pages=4, host_pages=16, config=CacheConfig(write_policy="write_through"))
    put(cache, pages(2))
    drain(cache, ex)
    put(cache, pages(3, start=500))  # the first prefix goes to the host only
    drain(cache, ex)
    index = PrefixIndex()
    hook = enable_kv_events(cache, lambda batch: index.apply("a", batch))
    actual = cache_contents(cache)
    assert actual["host"] and actual["device"] != actual["host"]
    for tier in MEMORY_TIERS:
        assert index.blocks("a", tier) == actual[tier]
    disable_kv_events(cache, hook)
    cache.close()


@pytest.mark.parametrize("arguments, named", [
    ({"sink": None}, "sink"),
    ({"sink": "publish"}, "sink"),
    ({"data_parallel_rank": -1}, "data_parallel_rank"),
    ({"data_parallel_rank": "0"}, "data_parallel_rank"),
    ({"max_batch_events": "256"}, "max_batch_events"),
    ({"max_batch_events": 0}, "max_batch_events"),
])
def test_bad_event_arguments_are_refused_and_nothing_listens(arguments, named):
    cache, _ = make_cache()
    with pytest.raises(ConfigError, match=named):
        enable_kv_events(cache, **{"sink": [].append, **arguments})
    put(cache, pages(1))  # a listener left behind would hear this and fail
    cache.close()


def test_events_are_enabled_only_on_an_open_cache_from_its_thread_and_disabling_twice_is_harmless():
    cache, ex = make_cache()
    put(cache, pages(1))
    batches: list = []
    refused = in_thread(lambda: enable_kv_events(cache, batches.append))
    assert isinstance(refused["error"], WrongThread)
    hook = enable_kv_events(cache, batches.append)
    disable_kv_events(cache, hook)
    sent = len(batches)
    disable_kv_events(cache, hook)  # shutdown paths may stop twice: nothing more is sent, nothing raised
    put(cache, pages(1, start=100))
    assert len(batches) == sent == 1  # the snapshot only
    cache.close()
    with pytest.raises(HiCacheError, match="closed"):
        enable_kv_events(cache, batches.append)
