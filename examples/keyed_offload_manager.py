"""A CPU offload manager shaped like vLLM's ``CPUOffloadingManager`` (``vllm/v1/kv_offload``), written only to
show the block-store profile on a second real contract.

What differs from ``block_offload_manager.py``, and why it needs the profile's newer parts:

- ``lookup(key, req)`` answers **per key**: ``MISS``, ``HIT``, ``HIT_PENDING`` (its store is in
  flight) or ``RETRY``;
- an **admission filter**: with ``store_threshold >= 2`` a key is stored only once lookups have
  seen it that many times; ``prepare_store`` silently skips the others (the adapter says they were
  *declined*);
- **request scopes**: ``on_new_request`` / ``on_request_finished`` around a request's calls; the
  policy learns what a request used when it finishes (keys it hit, first block most recent);
- a **pluggable policy**: ``"lru"`` or ``"arc"`` (T1/T2 with ghost lists B1/B2);
- a store of keys all held returns an empty output (nothing to copy).

Block states follow vLLM: ``ref_cnt`` -1 while the store is in flight, 0 when ready and idle, > 0
while loads read it; only ready, idle blocks not named by the storing call are evicted.

``bug=`` plants one of three bugs:

- ``"inverted_lru"``: LRU evicts the most recently used block instead of the least;
- ``"pending_hit"``: ``lookup`` answers ``HIT`` for a block whose store is still in flight;
- ``"unpin_on_finish"``: ``on_request_finished`` drops the request's load pins, though the loads
  may still be running (their ``complete_load`` comes later).

The adapter (``KeyedOffloadAdapter``) and the factory the CLI takes (``make_adapter``) are at the end.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

import attrs

from hicache_fsm.testing.blockstore import BlockStoreAdapter, StoreJob, canonical, value_of

BUGS = ("inverted_lru", "pending_hit", "unpin_on_finish")
Key = Hashable


class LookupResult(enum.Enum):
    MISS = enum.auto()
    HIT = enum.auto()
    HIT_PENDING = enum.auto()
    RETRY = enum.auto()


@attrs.define
class ReqContext:
    req_id: int
    hits: list = attrs.Factory(list)  # keys this request found ready (touched when it finishes)
    pins: list = attrs.Factory(list)  # keys this request's loads pinned


@attrs.define
class BlockStatus:
    block_id: int
    ref_cnt: int = -1  # -1: being stored, 0: ready and idle, > 0: loads reading it

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0


@attrs.frozen
class PrepareStoreOutput:
    keys_to_store: tuple
    block_ids: tuple[int, ...]
    evicted_keys: tuple


class LRUPolicy:
    """Least recently used first (a touch moves keys to the end, the first key last: it is the most precious)."""

    def __init__(self, capacity: int, inverted: bool = False) -> None:
        self.blocks: OrderedDict[Key, BlockStatus] = OrderedDict()
        self.inverted = inverted

    def get(self, key: Key) -> BlockStatus | None:
        return self.blocks.get(key)

    def insert(self, key: Key, block: BlockStatus) -> None:
        self.blocks[key] = block

    def remove(self, key: Key) -> None:
        del self.blocks[key]

    def touch(self, keys: Iterable[Key]) -> None:
        for key in reversed(list(keys)):
            if key in self.blocks:
                self.blocks.move_to_end(key)

    def evict(self, n: int, protected: set) -> list[tuple[Key, BlockStatus]] | None:
        order = reversed(self.blocks.items()) if self.inverted else iter(self.blocks.items())
        victims = [(k, b) for k, b in order if b.ref_cnt == 0 and k not in protected][:n]
        if len(victims) < n:
            return None
        for key, _ in victims:
            del self.blocks[key]
        return victims


class ARCPolicy:
    """Adaptive replacement: T1 holds blocks used once, T2 blocks used again; ghosts B1/B2 move the T1 target."""

    def __init__(self, capacity: int, inverted: bool = False) -> None:
        self.capacity = capacity
        self.target = 0.0
        self.t1: OrderedDict[Key, BlockStatus] = OrderedDict()
        self.t2: OrderedDict[Key, BlockStatus] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()

    def get(self, key: Key) -> BlockStatus | None:
        return self.t1.get(key) or self.t2.get(key)

    def insert(self, key: Key, block: BlockStatus) -> None:
        self.t1[key] = block
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def remove(self, key: Key) -> None:
        if self.t1.pop(key, None) is None:
            self.t2.pop(key, None)

    def touch(self, keys: Iterable[Key]) -> None:
        for key in reversed(list(keys)):
            if key in self.t1:
                block = self.t1.pop(key)
                (self.t2 if block.is_ready else self.t1)[key] = block
            elif key in self.t2:
                self.t2.move_to_end(key)
            elif key in self.b1:
                self.target = min(self.target + max(1, len(self.b2) / len(self.b1)), self.capacity)
                self.b1.move_to_end(key)
            elif key in self.b2:
                self.target = max(self.target - max(1, len(self.b1) / len(self.b2)), 0)
                self.b2.move_to_end(key)

    def evict(self, n: int, protected: set) -> list[tuple[Key, BlockStatus]] | None:
        t1 = ((k, b, True) for k, b in self.t1.items() if b.ref_cnt == 0 and k not in protected)
        t2 = ((k, b, False) for k, b in self.t2.items() if b.ref_cnt == 0 and k not in protected)
        picked, t1_size = [], len(self.t1)
        while len(picked) < n:
            pick = next(t1, None) if t1_size >= int(self.target) else None
            t1_size -= pick is not None
            pick = pick or next(t2, None)
            if pick is None:
                return None
            picked.append(pick)
        for key, _, from_t1 in picked:
            del (self.t1 if from_t1 else self.t2)[key]
            ghost = self.b1 if from_t1 else self.b2
            ghost[key] = None
            if len(ghost) > self.capacity:
                ghost.popitem(last=False)
        return [(k, b) for k, b, _ in picked]


POLICIES = {"lru": LRUPolicy, "arc": ARCPolicy}


class CPUOffloadingManager:
    """Blocks keyed by block hash in ``num_blocks`` CPU slots; ``cache_policy`` picks the victims."""

    def __init__(self, num_blocks: int, cache_policy: str = "lru", store_threshold: int = 1,
                 bug: str | None = None) -> None:
        if cache_policy not in POLICIES:
            raise ValueError(f"cache_policy must be one of {sorted(POLICIES)}, got {cache_policy!r}")
        if bug is not None and bug not in BUGS:
            raise ValueError(f"bug must be one of {BUGS}, got {bug!r}")
        if num_blocks < 1 or store_threshold < 1:
            raise ValueError("num_blocks and store_threshold must be positive")
        self.num_blocks = num_blocks
        self.free_list: list[int] = list(range(num_blocks))
        self.policy = POLICIES[cache_policy](num_blocks, inverted=bug == "inverted_lru")
        self.store_threshold = store_threshold
        self.counts: OrderedDict[Key, int] | None = OrderedDict() if store_threshold >= 2 else None
        self.bug = bug

    def on_new_request(self, req: ReqContext) -> None:
        req.hits.clear()
        req.pins.clear()

    def on_request_finished(self, req: ReqContext) -> None:
        self.policy.touch(req.hits)
        if self.bug == "unpin_on_finish":
            self.complete_load(req.pins, req)

    def lookup(self, key: Key, req: ReqContext) -> LookupResult:
        if self.counts is not None:
            self.counts[key] = self.counts.get(key, 0) + 1
            self.counts.move_to_end(key)
        block = self.policy.get(key)
        if block is None:
            return LookupResult.MISS
        if not block.is_ready and self.bug != "pending_hit":
            return LookupResult.HIT_PENDING
        req.hits.append(key)
        return LookupResult.HIT

    def prepare_load(self, keys: Sequence[Key], req: ReqContext) -> tuple[int, ...]:
        ids = []
        for key in keys:
            block = self.policy.get(key)
            assert block is not None and block.is_ready, f"block {key} is not ready"
            block.ref_cnt += 1
            req.pins.append(key)
            ids.append(block.block_id)
        return tuple(ids)

    def complete_load(self, keys: Sequence[Key], req: ReqContext | None = None) -> None:
        for key in keys:
            block = self.policy.get(key)
            if block is not None and block.ref_cnt > 0:
                block.ref_cnt -= 1

    def prepare_store(self, keys: Sequence[Key], req: ReqContext) -> PrepareStoreOutput | None:
        if self.counts is not None:
            keys = [k for k in keys if self.counts.get(k, 0) >= self.store_threshold]
        to_store = [k for k in keys if self.policy.get(k) is None]
        if not to_store:
            return PrepareStoreOutput((), (), ())
        need = len(to_store) - len(self.free_list)
        evicted = []
        if need > 0:
            victims = self.policy.evict(need, set(keys))
            if victims is None:
                return None
            for key, block in victims:
                self.free_list.append(block.block_id)
                evicted.append(key)
        ids = []
        for key in to_store:
            block = BlockStatus(self.free_list.pop(0))
            self.policy.insert(key, block)
            ids.append(block.block_id)
        return PrepareStoreOutput(tuple(to_store), tuple(ids), tuple(evicted))

    def complete_store(self, keys: Sequence[Key], req: ReqContext | None = None, success: bool = True) -> None:
        for key in keys:
            block = self.policy.get(key)
            if block is None or block.is_ready:
                continue
            if success:
                block.ref_cnt = 0
            else:
                self.policy.remove(key)
                self.free_list.append(block.block_id)


# =========================================================================== the adapter (the part a user writes)


class KeyedOffloadAdapter(BlockStoreAdapter):
    """Drive ``CPUOffloadingManager``; ``memory`` stands for the CPU blocks the copies write and read."""

    name = "keyed_offload"
    redelivery = "caller_guarantees_once"  # the engine acknowledges each job once

    def __init__(self, num_blocks: int = 2, policy: str = "lru", store_threshold: int = 1, bug: str | None = None):
        self.manager = CPUOffloadingManager(num_blocks, policy, store_threshold, bug)
        self.capacity, self.eviction_policy = num_blocks, policy  # every victim is checked against the policy
        self.memory, self.jobs = [None] * num_blocks, {}  # CPU blocks; job id -> (kind, block ids)

    def begin_request(self, request_id):
        self.req = ReqContext(request_id)
        self.manager.on_new_request(self.req)

    def end_request(self, request_id):
        self.touched(reversed(self.req.hits))  # the policy learns the request's hits, its first block last
        self.manager.on_request_finished(self.req)

    def lookup(self, keys):  # one answer per key, up to the first that is not a hit (as the scheduler asks)
        answers = []
        for key in keys:
            answers.append(self.manager.lookup(key, self.req))
            if answers[-1] is not LookupResult.HIT:
                break
        return answers

    def store(self, keys):
        out = self.manager.prepare_store(keys, self.req)
        if out is None:
            return None
        self.evicted(out.evicted_keys)
        counts, threshold = self.manager.counts, self.manager.store_threshold
        declined = [k for k in keys if counts is not None and counts.get(k, 0) < threshold]  # the admission filter
        if not out.keys_to_store:  # all held or declined: nothing to copy
            return StoreJob.nothing(declined)
        return StoreJob(self._job("store", out.block_ids), out.keys_to_store, declined)

    def load(self, keys):
        return StoreJob(self._job("load", self.manager.prepare_load(keys, self.req)), tuple(keys))

    def _job(self, kind, block_ids):
        job_id = max(self.jobs, default=0) + 1
        self.jobs[job_id] = (kind, block_ids)
        return job_id

    def complete(self, job, ok):
        kind, block_ids = self.jobs.pop(job.id)
        if kind == "store":
            for key, b in zip(job.keys, block_ids):  # the copy wrote each block's KV into its CPU block
                self.memory[b] = value_of(key) if ok else self.memory[b]
            return self.manager.complete_store(job.keys, success=ok)
        self.manager.complete_load(job.keys)
        return [self.memory[b] for b in block_ids]  # the copy read the CPU blocks

    def slots(self):  # LRU keeps one table, ARC two
        return {k: b.block_id for t in ("blocks", "t1", "t2") for k, b in getattr(self.manager.policy, t, {}).items()}

    def free_slots(self):
        return len(self.manager.free_list)

    def state_key(self):  # the policy, free list, memory of ready blocks, jobs, lookup counts capped at the threshold
        m = self.manager
        counts = sorted((k, min(c, m.store_threshold)) for k, c in (m.counts or {}).items())
        memory = sorted((b, self.memory[b]) for k, b in self.slots().items() if m.policy.get(k).is_ready)
        return canonical(m.policy), tuple(m.free_list), tuple(memory), tuple(sorted(self.jobs.values())), tuple(counts)

    def describe(self):
        m = self.manager
        return f"keyed_offload({m.num_blocks} blocks, {self.eviction_policy}, threshold {m.store_threshold}, {m.bug})"


make_adapter = KeyedOffloadAdapter  # the factory ``hicache-fsm fuzz / check --adapter`` takes (``--variant``: its arguments)
