"""An asynchronous block-store offload manager, written only to show the block-store profile at work.

It is shaped like the CPU KV-offload managers of serving engines: blocks are
named by their (chained) hashes; ``prepare_store`` hands out CPU block ids
for the blocks not stored yet, evicting least recently used *ready* blocks to
make room and reporting them; the copy runs elsewhere, then ``complete_store``
makes the blocks ready (or frees them on failure). ``prepare_load`` pins ready
blocks (a reference count) until ``complete_load``. ``lookup`` counts the
leading ready blocks. Exactly-once delivery of completions is the caller's
job, as in those engines.

``bug=`` plants one of three bugs:

- ``"evict_loading"``: eviction ignores the reference count, so a block a load
  is still reading can be evicted and its slot handed to another store;
- ``"failed_store_leak"``: a failed store forgets its blocks but never frees
  their slots;
- ``"ready_before_ack"``: ``lookup`` counts blocks whose store is still in flight.

The adapter (``OffloadAdapter``) and the factory the CLI takes (``make_adapter``)
are at the end. See docs/fuzzing.md.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

import attrs

from hicache_fsm.testing.blockstore import BlockStoreAdapter, StoreJob, value_of


@attrs.define
class Block:
    block_id: int
    ready: bool = False
    ref_cnt: int = 0


@attrs.frozen
class PrepareStoreOutput:
    to_store: tuple[Hashable, ...]
    block_ids: tuple[int, ...]
    evicted: tuple[Hashable, ...]


class OffloadManager:
    """CPU blocks keyed by block hash, LRU among ready, unreferenced blocks."""

    def __init__(self, num_blocks: int, bug: str | None = None) -> None:
        self.num_blocks = num_blocks
        self.free: list[int] = list(range(num_blocks))
        self.blocks: OrderedDict[Hashable, Block] = OrderedDict()  # least recently used first
        self.bug = bug

    def lookup(self, hashes: Sequence[Hashable]) -> int:
        n = 0
        for h in hashes:
            b = self.blocks.get(h)
            if b is None or not (b.ready or self.bug == "ready_before_ack"):
                break
            n += 1
        return n

    def touch(self, hashes: Sequence[Hashable]) -> None:
        for h in hashes:
            if h in self.blocks:
                self.blocks.move_to_end(h)

    def prepare_load(self, hashes: Sequence[Hashable]) -> tuple[int, ...]:
        out = []
        for h in hashes:
            b = self.blocks[h]
            assert b.ready, f"block {h} is not ready"
            b.ref_cnt += 1
            out.append(b.block_id)
        return tuple(out)

    def complete_load(self, hashes: Sequence[Hashable]) -> None:
        for h in hashes:
            self.blocks[h].ref_cnt -= 1

    def prepare_store(self, hashes: Sequence[Hashable]) -> PrepareStoreOutput | None:
        new = [h for h in dict.fromkeys(hashes) if h not in self.blocks]
        need = len(new) - len(self.free)
        victims = []
        if need > 0:
            for h, b in self.blocks.items():
                if len(victims) == need:
                    break
                if b.ready and h not in hashes and (b.ref_cnt == 0 or self.bug == "evict_loading"):
                    victims.append(h)
            if len(victims) < need:
                return None
        for h in victims:
            self.free.append(self.blocks.pop(h).block_id)
        ids = []
        for h in new:
            b = self.blocks[h] = Block(self.free.pop(0))
            ids.append(b.block_id)
        return PrepareStoreOutput(tuple(new), tuple(ids), tuple(victims))

    def complete_store(self, hashes: Sequence[Hashable], success: bool = True) -> None:
        for h in hashes:
            b = self.blocks.get(h)
            if b is None or b.ready:
                continue
            if success:
                b.ready = True
            else:
                del self.blocks[h]
                if self.bug != "failed_store_leak":
                    self.free.append(b.block_id)


# =========================================================================== the adapter (the part a user writes)


class OffloadAdapter(BlockStoreAdapter):
    """Drive ``OffloadManager``; ``memory`` stands for the CPU blocks the copies write and read."""

    name = "offload_manager"
    redelivery = "caller_guarantees_once"  # as in the engines: the caller acknowledges each job once
    eviction_policy = "lru"  # every victim is checked against the toolkit's LRU

    def __init__(self, num_blocks: int = 2, bug: str | None = None) -> None:
        self.manager = OffloadManager(num_blocks, bug)
        self.capacity = num_blocks
        self.memory: list[int | None] = [None] * num_blocks
        self.jobs: dict[int, tuple[str, tuple[int, ...]]] = {}
        self.next_job = 0

    def _job(self, kind: str, keys: tuple, block_ids: tuple[int, ...]) -> StoreJob:
        self.next_job += 1
        self.jobs[self.next_job] = (kind, block_ids)
        return StoreJob(self.next_job, keys)

    def lookup(self, keys):
        return self.manager.lookup(keys)

    def store(self, keys):
        out = self.manager.prepare_store(keys)
        if out is None:
            return None
        self.evicted(out.evicted)
        if not out.to_store:  # all held: nothing to copy, no job
            return StoreJob.nothing()
        return self._job("store", out.to_store, out.block_ids)

    def load(self, keys):
        self.manager.touch(keys)
        self.touched(keys)
        return self._job("load", tuple(keys), self.manager.prepare_load(keys))

    def complete(self, job, ok):
        kind, block_ids = self.jobs.pop(job.id)
        if kind == "store":
            if ok:  # the copy wrote each block's KV into its CPU block
                for key, b in zip(job.keys, block_ids):
                    self.memory[b] = value_of(key)
            self.manager.complete_store(job.keys, success=ok)
            return None
        values = [self.memory[b] for b in block_ids]  # the copy read the CPU blocks
        self.manager.complete_load(job.keys)
        return values

    def slots(self):
        return {h: b.block_id for h, b in self.manager.blocks.items()}

    def free_slots(self):
        return len(self.manager.free)

    def state_key(self):  # blocks in LRU order, free list, CPU memory, jobs by block ids (not job ids)
        blocks = tuple((h, b.block_id, b.ready, b.ref_cnt) for h, b in self.manager.blocks.items())
        return blocks, tuple(self.manager.free), tuple(self.memory), tuple(sorted(self.jobs.values()))

    def describe(self):
        return f"offload_manager(blocks={self.capacity}, bug={self.manager.bug})"


def make_adapter(**variant) -> OffloadAdapter:
    """The factory ``hicache-fsm fuzz / check --adapter`` takes (``--variant`` passes keyword arguments)."""
    return OffloadAdapter(**variant)
