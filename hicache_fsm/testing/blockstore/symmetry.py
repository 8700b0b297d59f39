"""Symmetry reduction for the block-store explorer: block keys are names, so renaming page ids changes nothing.

The explorer's prompts are every chain of 1..``max_len`` page ids over the
alphabet, a trie of keys. Renaming the children of any trie node (page 0 and
page 1 after the prefix ``(1,)``, say) maps the prompts onto themselves, so it
maps every run onto a run with the same findings, renamed. The explorer keys a
new state by a renamed copy of it: names are handed out in the order keys first
appear (in the reference policy's order, then in the state key), so states that
differ only by names share one key.

The renaming is faithful, not a rewrite of the key: the adapter and the model
are copied with every ``BlockKey`` and every value a store wrote
(``value_of(key)``) renamed, and the copy is asked for its state key. An adapter
that keeps keys in another form (strings, hashes, plain tuples) would make that
copy wrong, so ``verify`` compares renamed copies with a replay of the renamed
steps from the factory; the explorer checks the first states and then one in
``VERIFY_EVERY``, and turns symmetry off (and starts again) on a difference. An
adapter that cannot be copied is explored by replay anyway: its renamed states
are replays of the renamed steps.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence

from hicache_fsm.testing.blockstore.adapter import BlockStoreAdapter, Key, value_of
from hicache_fsm.testing.blockstore.state import BlockKey
from hicache_fsm.testing.blockstore.world import StoreWorld, format_step

VERIFY_FIRST = 32  # renamed states checked against a replay, then one in VERIFY_EVERY
VERIFY_EVERY = 64
MIN_VALUE = 1 << 10  # values a store writes must not look like small counters (slots, counts, job ids)


class Asymmetric(Exception):
    """A renamed copy of a state differs from the renamed run replayed (the adapter is not symmetric in names)."""


class Symmetry:
    """Renamings of the keys of ``prompts`` that map the prompt set onto itself (per trie node, a permutation
    of its children). ``why_not`` says why none can be used (None: usable)."""

    def __init__(self, prompts: Sequence[tuple[Key, ...]]) -> None:
        self.keys: dict[tuple, BlockKey] = {tuple(k): k for p in prompts for k in p if type(k) is BlockKey}
        self.children: dict[tuple, list] = {}
        for k in self.keys:
            self.children.setdefault(k[:-1], [])
            if k[-1] not in self.children[k[:-1]]:
                self.children[k[:-1]].append(k[-1])
        for kids in self.children.values():
            kids.sort()
        values = {value_of(k): k for k in self.keys}
        self.why_not: str | None = None
        if any(type(k) is not BlockKey for p in prompts for k in p):
            self.why_not = "the prompts are not the explorer's block keys"
        elif len(values) != len(self.keys) or min(values, default=MIN_VALUE) < MIN_VALUE:
            self.why_not = "two block keys' values collide, or one looks like a small counter"
        elif all(len(kids) < 2 for kids in self.children.values()):
            self.why_not = "one page id per position: nothing to rename"

    def relabel(self, sequence: Iterable[tuple]) -> dict | None:
        """The renaming naming keys in order of first appearance in ``sequence`` (None: names stay)."""
        labels: dict[tuple, dict] = {}
        for k in sequence:
            for i in range(len(k)):
                kids = labels.setdefault(k[:i], {})
                if k[i] not in kids:
                    kids[k[i]] = self.children[k[:i]][len(kids)]
        rename: dict = {}
        for old, key in self.keys.items():
            new = self._complete(labels, old)
            if new != old:
                rename[key] = self.keys[new]
                rename[value_of(key)] = value_of(self.keys[new])
        return rename or None

    def _complete(self, labels: dict[tuple, dict], old: tuple) -> tuple:
        """``old`` renamed: each page by its node's labels; children not seen take the labels left, in order."""
        out = []
        for i, page in enumerate(old):
            kids = labels.get(old[:i])
            if kids is None:
                out.append(page)
                continue
            if page not in kids:
                free = [c for c in self.children[old[:i]] if c not in kids.values()]
                for c in self.children[old[:i]]:
                    if c not in kids:
                        kids[c] = free.pop(0)
            out.append(kids[page])
        return tuple(out)

    def sequence(self, *parts: Hashable) -> list[tuple]:
        """The keys in ``parts`` (nested tuples and sets), in order of appearance."""
        out: list[tuple] = []
        stack = list(reversed(parts))
        while stack:
            x = stack.pop()
            if isinstance(x, tuple):
                if x in self.keys:
                    out.append(x)
                else:
                    stack.extend(reversed(x))
            elif isinstance(x, frozenset):
                stack.extend(x)
        return out

    def rename_step(self, step: tuple, rename: dict) -> tuple:
        op, *args = step
        return (op, *(tuple(rename.get(k, k) for k in a) if isinstance(a, tuple) else a for a in args))


class ReducedKeys:
    """State keys under the symmetry: a world's key is its renamed copy's, names handed out by first appearance
    (in the reference policy's order, then the state key's). Memoised by the plain key: equal plain keys share
    one reduced key (both are sound: equal plain keys behave alike, renamed twins alike up to the names)."""

    def __init__(self, symmetry: Symmetry, factory: Callable[[], BlockStoreAdapter]) -> None:
        self.symmetry, self.factory = symmetry, factory
        self.seen: dict[Hashable, tuple[Hashable, dict | None]] = {}  # plain key -> (reduced key, its renaming)
        self.renamed = 0

    def __call__(self, world: StoreWorld) -> Hashable:
        return self.reduce(world)[0]

    def reduce(self, world: StoreWorld) -> tuple[Hashable, dict | None]:
        """(the reduced key, the renaming of the state it is the key of: ``world`` or a twin with its plain key)."""
        plain = world.key()
        found = self.seen.get(plain)
        if found is not None:
            return found
        policy = world.model.policy
        rename = self.symmetry.relabel(self.symmetry.sequence(None if policy is None else policy.key(), plain))
        key = plain
        if rename is not None and world.replay_only:  # no copies: the renamed steps, replayed, are exact
            key = replay_renamed(self.factory, world, rename, self.symmetry).key()
        elif rename is not None:
            key = world.renamed(rename).key()
            self.renamed += 1
            if self.renamed <= VERIFY_FIRST or self.renamed % VERIFY_EVERY == 0:
                verify(self.factory, world, rename, key, self.symmetry)
        self.seen[plain] = key, rename
        return key, rename


def replay_renamed(factory: Callable[[], BlockStoreAdapter], world: StoreWorld, rename: dict,
                   symmetry: Symmetry) -> StoreWorld:
    """The world ``world``'s steps reach from ``factory()`` with every key renamed."""
    twin = StoreWorld(factory(), factory)
    twin.replay_only = world.replay_only
    for step in world.trace:
        twin.do(*symmetry.rename_step(step, rename))
    return twin


def verify(factory: Callable[[], BlockStoreAdapter], world: StoreWorld, rename: dict, key: Hashable,
           symmetry: Symmetry) -> None:
    """Raise ``Asymmetric`` unless replaying ``world``'s steps renamed gives the state key ``key``."""
    if replay_renamed(factory, world, rename, symmetry).key() != key:
        steps = ", ".join(format_step(s) for s in world.trace)
        raise Asymmetric(f"after {steps or 'no steps'}, the state with page ids renamed is not the state the "
                         f"renamed steps reach (the adapter keeps block keys in a form the toolkit cannot rename)")
