"""Turn a cache's residency transitions into KV event batches (the spec's ``events:`` entries).

:func:`enable_kv_events` registers a :class:`KVEventHook` as a listener of the
cache's residency driver. Each state change looks up the transition it came
from by (old state, new state) and queues that transition's declared events,
with the node's page hashes, tokens and the tier's medium. Batches go to a
sink (``ZmqEventPublisher.publish``, any callable taking a ``KVEventBatch``)
when ``flush`` is called (an engine calls it once per step) or when
``max_batch_events`` are queued. Nothing here blocks: the sink decides what to
do when its consumer is slow.

The serving thread only records each event (see
:mod:`hicache_fsm.events.pending`): hashing the pages and building the batch
happen when it is rendered, on the publisher's thread for a sink marked
``accepts_pending`` (as msgpack bytes), in ``flush`` for any other sink (as
structs).

``HiCache.reset`` clears the tree and the driver reports it: the hook
queues ``AllBlocksCleared`` and forgets every node's chain (ids start again
from 1 after a clear, so a new node never inherits an old one's hashes).
"""

from __future__ import annotations

import time
from typing import Callable, Hashable

from hicache_fsm.cache import HiCache
from hicache_fsm.config import check_positive_int
from hicache_fsm.confinement import THIS_THREAD, ThreadOwner
from hicache_fsm.errors import ConfigError
from hicache_fsm.events.hashes import NodeChains, RecentTokens
from hicache_fsm.events.names import MEDIUMS, parse_event
from hicache_fsm.events.pending import CLEARED_RECORD, REMOVED, STORED, PendingBatch, takes_pending
from hicache_fsm.events.schema import KVEventBatch
from hicache_fsm.events.settings import check_rank
from hicache_fsm.radix import TreeNode
from hicache_fsm.spec import Spec

Sink = Callable[[KVEventBatch], None]  # or, marked ``accepts_pending``, taking a ``PendingBatch``
# The state tag that makes a node's pages readable in each tier (a snapshot of a running cache).
TIER_TAGS = {"device": "on_device", "host": "on_host", "storage": "stored"}


def events_by_move(spec: Spec) -> dict[tuple[str, str], tuple[tuple[str, str], ...]]:
    """(source, dest) -> the (kind, tier) events declared on that transition.

    ``ConfigError`` when two transitions between the same states declare
    different events: a listener sees only the states, so it could not tell
    which to publish.
    """
    out: dict[tuple[str, str], tuple[tuple[str, str], ...]] = {}
    for t in spec.transitions:
        events = tuple(parse_event(e) for e in t.events)
        for source in t.sources:
            key = (source, t.dest)
            if out.setdefault(key, events) != events:
                raise ConfigError(f"{spec.name}: transitions {source} -> {t.dest} declare different events")
    return out


def readable_tiers(spec: Spec) -> dict[str, tuple[str, ...]]:
    """State -> the tiers its pages are readable in, from the state tags."""
    return {s.name: tuple(tier for tier, tag in TIER_TAGS.items() if tag in s.tags) for s in spec.states}


INT64 = range(-(1 << 63), 1 << 63)  # what an event's lora_id holds (msgpack and the router's schema)


def _lora(namespace: Hashable) -> tuple[int | None, str | None]:
    """An event's (lora_id, lora_name) for a tree namespace: an int64 as the id, text as the name; an int past int64
    as its decimal text, and text no UTF-8 holds (a lone surrogate) escaped, so that every namespace has a wire form
    (one that had none stopped the publisher's thread for good)."""
    if isinstance(namespace, int) and not isinstance(namespace, bool):
        return (namespace, None) if namespace in INT64 else (None, str(namespace))
    if isinstance(namespace, str):
        return None, namespace.encode("utf-8", "backslashreplace").decode("utf-8")
    return None, None


class KVEventHook:
    """A residency listener that queues KV events and hands them to ``sink`` in batches."""

    def __init__(self, spec: Spec, page_size: int, sink: Sink, *, data_parallel_rank: int | None = None,
                 max_batch_events: int = 256, owner: ThreadOwner | None = None) -> None:
        check_positive_int("max_batch_events", max_batch_events)
        if owner is not None and not isinstance(owner, ThreadOwner):
            raise ConfigError(f"owner must be the cache's ThreadOwner, got {type(owner).__name__}")
        # the thread that drives the cache queues the events: a flush from another would drop what it queues meanwhile
        self._owner = owner
        check_positive_int("page_size", page_size)  # 0 divided by zero in the first insert's event, after it landed
        check_rank(data_parallel_rank)
        if not isinstance(spec, Spec):
            raise ConfigError(f"spec must be the residency Spec the cache runs, got {type(spec).__name__}")
        if not callable(sink):
            raise ConfigError(f"sink must be callable (a publisher's publish, a list's append), got {sink!r}")
        self.sink = sink
        self._sink_renders = takes_pending(sink)
        self.page_size = page_size
        self.data_parallel_rank = data_parallel_rank
        self.max_batch_events = max_batch_events
        # (source, dest) -> ((stored?, medium), ...): what the serving thread looks up per state change
        self._moves = {move: tuple((kind == "stored", MEDIUMS[tier]) for kind, tier in events)
                       for move, events in events_by_move(spec).items() if events}
        self._readable = readable_tiers(spec)
        self._chains = NodeChains(page_size)
        self._loras: dict[Hashable, tuple[int | None, str | None]] = {}
        self._recent = RecentTokens()
        self._pending: list = []
        self.batches = 0
        self.events = 0
        # What the sink raised when a batch filled up inside a state change: kept (the events stay queued)
        # so the cache's transition goes on; the next ``flush`` tries the sink again and raises to its caller.
        self.sink_error: Exception | None = None

    # ------------------------------------------------------------ ResidencyListener

    def state_changed(self, node: TreeNode, old: str) -> None:
        events = self._moves.get((old, node.state))
        if events is not None:
            for stored, medium in events:
                self._queue(stored, medium, node)

    def split(self, node: TreeNode, upper: TreeNode) -> None:
        self._chains.split(node, upper)

    def removed(self, node: TreeNode, parent: TreeNode) -> None:
        self._chains.forget(node)

    def cleared(self) -> None:
        """Everything is gone (the cache was reset): queue ``AllBlocksCleared`` and forget every chain."""
        self._chains.clear()
        self._pending.append(CLEARED_RECORD)

    # ------------------------------------------------------------ batches

    def _queue(self, stored: bool, medium: str, node: TreeNode) -> None:
        """Record one event: references to facts that do not change (see ``pending``), nothing hashed."""
        by_id = self._chains.by_id
        chain = by_id.get(node.id) or self._chains.chain(node)
        if stored:
            lora = self._loras.get(node.namespace) or self._lora(node.namespace)
            # every ancestor of a chained node is chained (NodeChains.chain); the root is not: None
            self._pending.append((STORED, medium, chain, by_id.get(node.parent.id), node.raw) + lora)
        else:
            self._pending.append((REMOVED, medium, chain))
        if len(self._pending) >= self.max_batch_events and self.sink_error is None:
            try:
                self.flush()
            except Exception as exc:  # never out of a listener: the driver's transition is half done here
                self.sink_error = exc

    def _lora(self, namespace: Hashable) -> tuple[int | None, str | None]:
        lora = self._loras[namespace] = _lora(namespace)
        return lora

    def flush(self) -> None:
        """Hand the queued events to the sink as one batch (nothing if none are queued).

        If the sink raises, the events stay queued (nothing is lost, the counts
        do not move) and the error goes to the caller; the next flush retries.
        Only the thread driving the cache flushes (``WrongThread`` otherwise).
        """
        owner = self._owner
        if owner is not None and THIS_THREAD.token != owner.token:
            owner.adopt()  # WrongThread from a thread other than the one driving the cache
        self.sink_error = None
        if self._pending:
            records = self._pending
            batch = PendingBatch(time.time(), records, self.data_parallel_rank, self.page_size, self._recent)
            self.sink(batch if self._sink_renders else batch.render())
            self._pending = []
            self.batches += 1
            self.events += len(records)

    def snapshot(self, nodes: list[TreeNode]) -> None:
        """``AllBlocksCleared``, then what ``nodes`` (top-down) hold now in each tier, then flush."""
        self.cleared()
        for node in nodes:
            if not node.is_root:
                for tier in self._readable.get(node.state, ()):
                    self._queue(True, MEDIUMS[tier], node)
        self.flush()


def _top_down(cache: HiCache) -> list[TreeNode]:
    out, stack = [], [cache.tree.root]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def enable_kv_events(cache: HiCache, sink: Sink, *, data_parallel_rank: int | None = None,
                     max_batch_events: int = 256) -> KVEventHook:
    """Publish ``cache``'s KV events to ``sink``; starts with a snapshot of what it holds.

    Returns the hook: call ``flush()`` once per engine step, and
    :func:`disable_kv_events` to stop. Refused (nothing changes) on a closed
    cache or from a thread other than the one driving it.
    """
    _check_cache(cache)
    cache.check_open()
    hook = KVEventHook(cache.driver.machine.spec, cache.page_size, sink, data_parallel_rank=data_parallel_rank,
                       max_batch_events=max_batch_events, owner=cache.thread_owner)
    hook.snapshot(_top_down(cache))
    cache.driver.add_listener(hook)
    return hook


def disable_kv_events(cache: HiCache, hook: KVEventHook) -> None:
    """Stop listening and flush what ``hook`` queued; a hook that stopped already is only flushed.

    The hook stops first, so a sink that fails in the flush (a closed
    publisher) does not leave it listening; the events it could not take stay queued.
    """
    _check_cache(cache)
    _check_hook(hook)
    if cache.driver.listening(hook):
        cache.driver.remove_listener(hook)
    hook.flush()


def reset_with_events(cache: HiCache, hook: KVEventHook) -> None:
    """``cache.reset()``, and publish its ``AllBlocksCleared`` now rather than at the next ``flush``."""
    _check_cache(cache)
    _check_hook(hook)  # before the reset: a refused call wipes nothing
    cache.reset()
    hook.flush()


def _check_cache(cache: object) -> None:
    if not isinstance(cache, HiCache):
        raise ConfigError(f"expected a HiCache, got {type(cache).__name__}")


def _check_hook(hook: object) -> None:
    if not isinstance(hook, KVEventHook):
        raise ConfigError(f"expected the KVEventHook enable_kv_events returned, got {type(hook).__name__}")
