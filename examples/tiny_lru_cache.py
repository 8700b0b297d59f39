"""A tiny two-tier LRU prefix cache, written only to show how to fuzz a cache of your own.

It has nothing to do with ``HiCache``: a flat table of *pages* keyed by the
whole token prefix up to and including the page (as block-hash prefix caches
do), in two LRU tiers: ``fast`` (think GPU) and ``slow`` (think host). New
pages go to ``fast``; when ``fast`` overflows its least recently used page is
demoted to ``slow``; when ``slow`` overflows its LRU page is dropped. A match
walks the prompt page by page while pages are cached and promotes the ones it
finds in ``slow``. Everything is synchronous: no jobs, no locks.

Each page is an entry with a life cycle, declared as a spec (``TINY_SPEC``)
so that recorded traces can be checked with ``hicache-fsm replay --spec``.

``bug=`` plants one of two bugs, to watch the tools find them:
``"capacity"`` (the fast tier holds one page too many) and
``"demote_stale"`` (demotion copies the page that was *previously* demoted).

The adapter (``TinyLRUAdapter``) and the factories the CLI takes
(``make_adapter`` for ``fuzz``, ``explorer_factory`` for ``check``) are at the
end. See docs/fuzzing.md.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

from hicache_fsm.testing import (
    CacheAdapter,
    MatchInfo,
    Occupancy,
    kv_fingerprint,
)

TINY_SPEC = """\
name: tiny_page
doc: One page of the tiny two-tier LRU cache.
initial: absent
states:
  absent: {doc: Not stored yet.}
  fast: {doc: In the fast tier.}
  slow: {doc: Demoted to the slow tier.}
  gone: {doc: Dropped., tags: [terminal]}
transitions:
  - {trigger: store, source: absent, dest: fast, doc: A new page is written to the fast tier.}
  - {trigger: demote, source: fast, dest: slow, doc: The fast tier overflowed; its LRU page moves down.}
  - {trigger: promote, source: slow, dest: fast, doc: A match found the page in the slow tier.}
  - {trigger: drop, source: [fast, slow], dest: gone, doc: Evicted for good.}
"""


class Page:
    def __init__(self, ident: int, values: list[int]) -> None:
        self.id = ident
        self.values = values  # one value per token: what the engine computed for it
        self.state = "absent"


class TinyLRUCache:
    """Two LRU tiers of whole pages; ``observer(event_dict)`` sees every page transition."""

    def __init__(self, fast_pages: int, slow_pages: int, page_size: int = 1, bug: str | None = None) -> None:
        self.fast: OrderedDict[tuple, Page] = OrderedDict()  # oldest first
        self.slow: OrderedDict[tuple, Page] = OrderedDict()
        self.fast_pages, self.slow_pages, self.page_size = fast_pages, slow_pages, page_size
        self.bug = bug
        self._ids = 0
        self._last_demoted: list[int] | None = None
        self.observer: Callable[[dict], None] | None = None

    def _move(self, page: Page, trigger: str, dest: str) -> None:
        if self.observer is not None:
            self.observer({"event": "transition", "machine": "tiny_page", "object": page.id,
                           "trigger": trigger, "source": page.state, "dest": dest})
        page.state = dest

    def _keys(self, tokens: Sequence[int]) -> list[tuple]:
        ps = self.page_size
        return [tuple(tokens[: i + ps]) for i in range(0, len(tokens) - len(tokens) % ps, ps)]

    def put(self, tokens: Sequence[int], values: Sequence[int]) -> None:
        """Store the pages of ``tokens`` (``values`` has one entry per token)."""
        for n, key in enumerate(self._keys(tokens)):
            if key in self.fast:
                self.fast.move_to_end(key)
                continue
            if key in self.slow:
                self._promote(key)
                continue
            self._ids += 1
            page = Page(self._ids, list(values[n * self.page_size:(n + 1) * self.page_size]))
            self._move(page, "store", "fast")
            self.fast[key] = page
            self._make_room()

    def get(self, tokens: Sequence[int]) -> list[int]:
        """Values of the longest cached prefix of ``tokens`` (promoting slow pages)."""
        out: list[int] = []
        for key in self._keys(tokens):
            if key in self.fast:
                self.fast.move_to_end(key)
            elif key in self.slow:
                self._promote(key)
            else:
                break
            out += self.fast[key].values
        return out

    def _promote(self, key: tuple) -> None:
        page = self.slow.pop(key)
        self._move(page, "promote", "fast")
        self.fast[key] = page
        self._make_room(keep=key)

    def _make_room(self, keep: tuple | None = None) -> None:
        limit = self.fast_pages + (1 if self.bug == "capacity" else 0)
        while len(self.fast) > limit:
            key = next(k for k in self.fast if k != keep)
            self.demote(key)

    def demote(self, key: tuple) -> None:
        page = self.fast.pop(key)
        if self.slow_pages == 0:
            self._move(page, "drop", "gone")
            return
        if self.bug == "demote_stale" and self._last_demoted is not None:
            stale, self._last_demoted = self._last_demoted, list(page.values)
            page.values = stale
        else:
            self._last_demoted = list(page.values)
        self._move(page, "demote", "slow")
        self.slow[key] = page
        while len(self.slow) > self.slow_pages:
            _, old = self.slow.popitem(last=False)
            self._move(old, "drop", "gone")

    def drop_slow(self, key: tuple) -> None:
        page = self.slow.pop(key)
        self._move(page, "drop", "gone")


class TinyLRUAdapter(CacheAdapter):
    """Drives ``TinyLRUCache`` for the hicache_fsm fuzzers (no jobs, no locks: those rules are skipped)."""

    name = "tiny_lru"

    def __init__(self, fast_pages: int = 3, slow_pages: int = 3, page_size: int = 1, bug: str | None = None) -> None:
        self.cache = TinyLRUCache(fast_pages, slow_pages, page_size, bug)
        self.page_size = page_size

    def describe(self) -> str:
        c = self.cache
        return f"tiny_lru(fast={c.fast_pages}, slow={c.slow_pages}, page={c.page_size}, bug={c.bug})"

    # required
    def insert(self, tokens: Sequence[int]) -> bool:
        tokens = tuple(tokens)
        values = [kv_fingerprint(tokens[: i + 1]) for i in range(len(tokens))]
        self.cache.put(tokens, values)
        # True promises the whole prompt is cached now: only when it fits in both tiers together
        c = self.cache
        return len(c._keys(tokens)) <= c.fast_pages + c.slow_pages

    def match(self, tokens: Sequence[int]) -> MatchInfo:
        found = self.cache.get(tuple(tokens))
        return MatchInfo(len(found))

    def read_kv(self, tokens: Sequence[int]) -> list[tuple[int, ...]]:
        out: list[tuple[int, ...]] = []
        for key in self.cache._keys(tuple(tokens)):  # read without promoting (must not change the cache)
            page = self.cache.fast.get(key) or self.cache.slow.get(key)
            if page is None:
                break
            out += [(v,) for v in page.values]
        return out

    def invariant_violations(self) -> list[str]:
        c = self.cache
        problems = []
        if len(c.fast) > c.fast_pages:
            problems.append(f"capacity: fast tier holds {len(c.fast)} pages, capacity {c.fast_pages}")
        if len(c.slow) > c.slow_pages:
            problems.append(f"capacity: slow tier holds {len(c.slow)} pages, capacity {c.slow_pages}")
        both = set(c.fast) & set(c.slow)
        if both:
            problems.append(f"one_copy: pages in both tiers: {sorted(both)[:4]}")
        for tier, table in (("fast", c.fast), ("slow", c.slow)):
            for key, page in table.items():
                if page.state != tier:
                    problems.append(f"state: page {key} sits in {tier} but is in state {page.state}")
                if len(page.values) != c.page_size:
                    problems.append(f"page_size: page {key} holds {len(page.values)} values")
        return problems

    # optional operations this cache has
    def evict(self, num_tokens: int) -> int:
        freed = 0
        while freed < num_tokens and self.cache.fast:
            self.cache.demote(next(iter(self.cache.fast)))
            freed += self.page_size
        return freed

    def evict_host(self, num_tokens: int) -> int:
        freed = 0
        while freed < num_tokens and self.cache.slow:
            self.cache.drop_slow(next(iter(self.cache.slow)))
            freed += self.page_size
        return freed

    def occupancy(self) -> Occupancy:
        return Occupancy(len(self.cache.fast) * self.page_size, len(self.cache.slow) * self.page_size)

    def capacity(self) -> Occupancy:  # the toolkit checks occupancy against it after every step
        return Occupancy(self.cache.fast_pages * self.page_size, self.cache.slow_pages * self.page_size)

    def eviction_policy(self) -> str:  # a page leaves the slow tier only once every page still cached was used later
        return "lru"

    def snapshot(self):
        c = self.cache
        return ([(k, p.values) for k, p in c.fast.items()], [(k, p.values) for k, p in c.slow.items()])

    def state_key(self) -> Hashable:
        c = self.cache  # LRU order is behaviour, so the key keeps it
        return tuple(c.fast), tuple(c.slow), c.bug == "demote_stale" and tuple(c._last_demoted or ())

    def size(self) -> int:
        return len(self.cache.fast) + len(self.cache.slow)


def make_adapter(**variant) -> TinyLRUAdapter:
    """For ``hicache-fsm fuzz --adapter examples/tiny_lru_cache.py:make_adapter``."""
    return TinyLRUAdapter(**variant)


def buggy_adapter(**variant) -> TinyLRUAdapter:
    return TinyLRUAdapter(bug="demote_stale", **variant)


def explorer_factory(bounds) -> TinyLRUAdapter:
    """For ``hicache-fsm check --adapter examples/tiny_lru_cache.py:explorer_factory``."""
    return TinyLRUAdapter(bounds.device_pages, bounds.host_pages, bounds.page_size)


def buggy_explorer_factory(bounds) -> TinyLRUAdapter:
    return TinyLRUAdapter(bounds.device_pages, bounds.host_pages, bounds.page_size, bug="demote_stale")


def record_trace(cache: TinyLRUCache, path: str) -> Callable[[], None]:
    """Write every page transition of ``cache`` to ``path`` as JSONL (a header first); returns ``close``."""
    f = open(path, "w", encoding="utf-8")  # noqa: SIM115 - the caller closes it
    f.write(json.dumps({"event": "header", "version": 1, "machines": ["tiny_page"]}) + "\n")
    cache.observer = lambda ev: f.write(json.dumps(ev) + "\n")
    return f.close


if __name__ == "__main__":  # a quick demonstration: python examples/tiny_lru_cache.py
    from hicache_fsm.testing import Bounds, explore

    ok = explore(Bounds(nodes=3, device_pages=2, host_pages=1), explorer_factory)
    bad = explore(Bounds(nodes=3, device_pages=2, host_pages=1), buggy_explorer_factory, stop_on_first=True)
    print(f"correct cache: {ok.states} states, {len(ok.violations)} violations")
    print(bad.violations[0].format())
