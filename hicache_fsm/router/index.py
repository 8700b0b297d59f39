"""The router's view of every instance: block hashes per instance and tier, from events only.

Applying an instance's batches in sequence order keeps, for each tier
(``device``, ``host``, ``storage``), the set of block hashes readable there:
``BlockStored`` adds, ``BlockRemoved`` takes away, ``AllBlocksCleared``
empties the instance. Block hashes chain (a hash names its whole prefix), so
"how long a prefix does instance *i* hold" is how many of a request's hashes,
from the first, are in its sets. Storage (L3) shared by the cluster is
answered from the union of every instance's storage announcements.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence, Set as AbstractSet

from hicache_fsm.errors import ConfigError
from hicache_fsm.events.names import TIER_OF_MEDIUM, TIERS
from hicache_fsm.events.schema import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

_NOTHING: dict[str, frozenset[int]] = {tier: frozenset() for tier in TIERS}  # an instance that announced nothing


class PrefixIndex:
    """Block hashes per (instance, tier), kept from KV event batches."""

    def __init__(self) -> None:
        self._blocks: dict[Hashable, dict[str, set[int]]] = {}
        self._shared_storage: dict[int, int] = {}  # hash -> how many instances announced it in storage
        self.unknown_media = 0  # events whose medium is not one of ours (ignored)

    def _tiers(self, instance: Hashable) -> dict[str, set[int]]:
        check_instance(instance)
        tiers = self._blocks.get(instance)
        if tiers is None:
            tiers = self._blocks[instance] = {tier: set() for tier in TIERS}
        return tiers

    def _sets(self, instance: Hashable, tiers: Iterable[str]) -> list:
        """``instance``'s sets of ``tiers``, read only: a query about an unknown instance adds none."""
        check_instance(instance)
        held = self._blocks.get(instance, _NOTHING)
        try:
            return [held[t] for t in tier_names(tiers)]
        except KeyError as exc:
            raise ConfigError(f"unknown tier {exc.args[0]!r}; tiers are {', '.join(TIERS)}") from None

    @property
    def instances(self) -> list[Hashable]:
        return list(self._blocks)

    def apply(self, instance: Hashable, batch: KVEventBatch) -> None:
        """Fold one batch from ``instance`` into the view (batches must come in sequence order).

        The whole batch is checked first: a struct built in Python is not
        validated as a decoded one is, and one bad event must not leave the
        events before it applied (``ConfigError``, nothing changed).
        """
        if not isinstance(batch, KVEventBatch):
            raise ConfigError(f"apply takes a KVEventBatch (a subscriber's or a hook's), got {type(batch).__name__}")
        check_events(batch.events)
        tiers = self._tiers(instance)
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                for h in tiers["storage"]:
                    self._forget_storage(h)
                for blocks in tiers.values():
                    blocks.clear()
                continue
            tier = TIER_OF_MEDIUM.get(event.medium)
            if tier is None:
                self.unknown_media += 1
                continue
            blocks = tiers[tier]
            stored = isinstance(event, BlockStored)  # else BlockRemoved
            if tier == "storage":  # shared L3: count the instances that announced each hash
                self._apply_storage(blocks, event.block_hashes, stored)
            elif stored:
                blocks.update(event.block_hashes)
            else:
                blocks.difference_update(event.block_hashes)

    def _apply_storage(self, blocks: set[int], hashes: list[int], stored: bool) -> None:
        shared = self._shared_storage
        for h in hashes:
            if stored and h not in blocks:
                shared[h] = shared.get(h, 0) + 1
                blocks.add(h)
            elif not stored and h in blocks:
                self._forget_storage(h)
                blocks.discard(h)

    def _forget_storage(self, h: int) -> None:
        left = self._shared_storage.get(h, 0) - 1
        if left > 0:
            self._shared_storage[h] = left
        else:
            self._shared_storage.pop(h, None)

    def blocks(self, instance: Hashable, tier: str) -> frozenset[int]:
        """The hashes ``instance`` announced as readable in ``tier``."""
        return frozenset(self._sets(instance, (tier,))[0])

    def prefix_pages(self, instance: Hashable, hashes: Sequence[int], tiers: Iterable[str] = ("device", "host"),
                     shared_storage: bool = False) -> int:
        """How many of ``hashes``, from the first, ``instance`` holds in any of ``tiers`` (or in shared L3)."""
        hashes = check_hashes(hashes)
        sets = self._sets(instance, tiers)
        if shared_storage:
            sets.append(self._shared_storage)  # type: ignore[arg-type]  (membership only)
        n = 0
        for h in hashes:
            if not any(h in s for s in sets):
                break
            n += 1
        return n

    def longest_prefixes(self, hashes: Sequence[int], instances: Iterable[Hashable],
                         tiers: Iterable[str] = ("device", "host")) -> dict[Hashable, int]:
        """Instance -> the pages of ``hashes`` it holds from the start (the router's question)."""
        tiers, hashes = tier_names(tiers), check_hashes(hashes)
        if isinstance(instances, (str, bytes)) or not isinstance(instances, Iterable):
            raise ConfigError(f"instances must be the instances to weigh (an iterable), got {type(instances).__name__}")
        return {i: self.prefix_pages(i, hashes, tiers) for i in instances}


def tier_names(tiers: Iterable[str]) -> tuple[str, ...]:
    """``tiers`` as a tuple of names; one name alone (``"device"``) is that tier, not its letters; anything else
    (None, a number, a list inside) is a ``ConfigError``."""
    if isinstance(tiers, str):
        return (tiers,)
    if isinstance(tiers, (bytes, bytearray)) or not isinstance(tiers, Iterable):
        raise ConfigError(f"tiers must be tier names ({', '.join(TIERS)}), got {type(tiers).__name__}")
    names = tuple(tiers)
    for name in names:
        if not isinstance(name, str):
            raise ConfigError(f"a tier is named by a str ({', '.join(TIERS)}), got {name!r:.40}")
    return names


class CheckedHashes(tuple):
    """Hashes ``check_hashes`` already read and checked: a router weighing every instance checks them once."""


def check_hashes(hashes: object) -> CheckedHashes:
    """A request's block hashes (``events.hashes.request_hashes``) as a tuple of ints that can be read more than once.

    A str, bytes, None or an unordered collection (a set, a dict) is a
    ``ConfigError``, and so is an element that is not an int (a float or a
    list would miss, or fail in, every lookup without a word); an iterator is
    read once, since every instance a router weighs reads the hashes again.
    """
    if type(hashes) is CheckedHashes:
        return hashes
    if isinstance(hashes, (str, bytes, bytearray, AbstractSet, Mapping)) or not isinstance(hashes, Iterable):
        raise ConfigError(f"hashes must be a request's block hashes (ints in order, from request_hashes), "
                          f"got {type(hashes).__name__}")
    hashes = CheckedHashes(hashes)
    for h in hashes:
        if not isinstance(h, int) or isinstance(h, bool):
            raise ConfigError(f"hashes must be ints (from request_hashes), got {h!r:.40} ({type(h).__name__})")
    return hashes


def check_instance(instance: object) -> None:
    """An instance is named by a hashable value (a number, a string): a dict key of the index."""
    try:
        hash(instance)
    except TypeError:
        raise ConfigError(f"an instance is named by a hashable value (a number, a string), got {instance!r}") from None


def _int_list(values: object) -> bool:
    """A list of block hashes as a decoded batch holds them: ints (not bools) that fit in 64 bits."""
    return isinstance(values, list) and all(type(v) is int and -(1 << 63) <= v < (1 << 64) for v in values)


def check_events(events: object) -> None:
    """``events`` is a list of the schema's events with int hashes and a str (or None) medium; else ``ConfigError``."""
    if not isinstance(events, list):
        raise ConfigError(f"a batch's events must be a list, got {type(events).__name__}")
    for n, event in enumerate(events):
        if isinstance(event, AllBlocksCleared):
            continue
        if not isinstance(event, (BlockStored, BlockRemoved)):
            raise ConfigError(f"event {n} is not a BlockStored, BlockRemoved or AllBlocksCleared: {event!r:.80}")
        if not _int_list(event.block_hashes) or not isinstance(event.medium, (str, type(None))):
            raise ConfigError(f"event {n} ({type(event).__name__}): block_hashes must be a list of ints and medium "
                              f"a str or None, got {type(event.block_hashes).__name__} and {event.medium!r:.40}")
