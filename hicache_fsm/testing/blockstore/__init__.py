"""The outsider profile for *asynchronous block stores* (offload managers keyed by block hash).

Prefix caches (``CacheAdapter``) insert a prompt and can read it now. Many
offload managers do not work like that: a store is *prepared* (slots handed
out, maybe others evicted as a side effect), the copy runs elsewhere, and the
data is readable only once the store is *acknowledged*; loads likewise. This
profile drives such a store through a few calls and keeps, in the toolkit,
everything an adapter should not have to write:

- a **reference model** (``model``): a key is readable after its store's
  successful ack, until the store reports it evicted, never after; ``lookup``
  must say exactly that, as a count of leading readable keys or one ``Answer``
  per key (``HIT`` / ``MISS`` / ``HIT_PENDING`` / ``RETRY``); an eviction never
  hits a key being stored or read;
- **admission**: a store takes, already holds or *declines* (``StoreJob.declined``)
  every key asked for, unless the adapter sets ``keeps_keys = False``; a store
  with nothing to copy (``StoreJob.nothing()``) takes no job slot;
- **policy conformance** (``policies``): an adapter naming ``eviction_policy``
  (``lru``, ``lfu``, ``arc``, ``fifo`` or its own) has every victim checked;
- **KV read-back**, **slot accounting**, the **ack-redelivery contract**;
- **request scopes**: ``begin_request`` / ``end_request`` around the calls of
  one request (lookup, load the hits, store the rest);
- **postconditions** that receive the reference model;
- a bounded **explorer** (``explore_store``: to ``max_depth`` steps, states that differ only by the names of
  block keys merged, see ``symmetry``) and a hypothesis **machine**
  (``store_machine``, ``run_store_fuzz``), both behind ``hicache-fsm check / fuzz
  --adapter``; adapters that cannot be deep-copied are explored by replay.

See ``examples/block_offload_manager.py``, ``examples/keyed_offload_manager.py``
and docs/fuzzing.md.
"""

from hicache_fsm.testing.adapter import NotSupported, Rejected
from hicache_fsm.testing.blockstore.adapter import (
    REDELIVERY_CONTRACTS,
    Answer,
    BlockStoreAdapter,
    Key,
    StoreJob,
    chain,
    value_of,
)
from hicache_fsm.testing.blockstore.explorer import StoreBounds, StoreExploreResult, explore_store, prompts_for
from hicache_fsm.testing.blockstore.machine import BlockStoreMachine, run_store_fuzz, store_machine
from hicache_fsm.testing.blockstore.model import StoreModel
from hicache_fsm.testing.blockstore.policies import ARC, FIFO, LFU, LRU, POLICIES, ReferencePolicy, reference_policy
from hicache_fsm.testing.blockstore.state import BlockKey, canonical
from hicache_fsm.testing.blockstore.world import StoreWorld, fmt, format_step

__all__ = [
    "ARC", "FIFO", "LFU", "LRU", "POLICIES", "REDELIVERY_CONTRACTS", "Answer", "BlockKey", "BlockStoreAdapter",
    "BlockStoreMachine", "Key", "NotSupported", "ReferencePolicy", "Rejected", "StoreBounds", "StoreExploreResult",
    "StoreJob", "StoreModel", "StoreWorld", "canonical", "chain", "explore_store", "fmt", "format_step", "prompts_for",
    "reference_policy", "run_store_fuzz", "store_machine", "value_of",
]
