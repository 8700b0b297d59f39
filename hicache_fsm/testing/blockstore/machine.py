"""The hypothesis machine: random store / load / lookup / request steps, open request scopes, acks, failures
and redeliveries; every check after each step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TextIO

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hicache_fsm.testing.adapter import check_variants
from hicache_fsm.testing.blockstore.adapter import BlockStoreAdapter, chain
from hicache_fsm.testing.blockstore.world import StoreWorld, format_step
from hicache_fsm.testing.stateful import Tally

ALPHABET = 3
MAX_BLOCKS = 4


class BlockStoreMachine(RuleBasedStateMachine):
    """Steps of one engine: a call outside a scope is a request of its own; ``open_request`` starts a scope
    the next calls share until ``close_request`` (acks arrive whenever, as in the engines)."""

    factory: Callable[..., BlockStoreAdapter] | None = None
    variants: tuple[dict, ...] = ({},)
    UNCHECKED = "the store took no key, so no step changed it"  # run_fuzz's floor (``Tally``)

    def __init__(self) -> None:
        super().__init__()
        self.world: StoreWorld | None = None
        self.tally = Tally()

    def _do(self, *step: Any) -> None:
        problems = self.world.do(*step)
        assert not problems, f"{format_step(step)}:\n  " + "\n  ".join(problems)
        if self.world.model.keys:  # the store holds (or is copying) a key: this run checks something
            self.tally.changes += 1

    @initialize(variant=st.integers(0, 63))
    def setup(self, variant: int) -> None:
        self.world = StoreWorld(type(self).factory(**self.variants[variant % len(self.variants)]))

    @invariant()
    def check(self) -> None:
        if self.world is not None:
            problems = self.world.violations()
            assert not problems, "\n".join(problems)

    @rule(pages=st.lists(st.integers(0, ALPHABET - 1), min_size=1, max_size=MAX_BLOCKS),
          op=st.sampled_from(["request", "request", "store", "lookup", "load"]))
    def on_prompt(self, pages: list[int], op: str) -> None:
        keys = chain(pages)
        if op == "load":
            keys = keys[: self.world.model.readable_prefix(keys)]
            if not keys:
                return
        self._do(op, keys)

    @precondition(lambda self: self.world is not None and self.world.open_request is None)
    @rule()
    def open_request(self) -> None:
        self._do("open")

    @precondition(lambda self: self.world is not None and self.world.open_request is not None)
    @rule()
    def close_request(self) -> None:
        self._do("close")

    @precondition(lambda self: self.world is not None and bool(self.world.model.jobs))
    @rule(pick=st.integers(0, 15), ok=st.sampled_from([True, True, True, False]))
    def complete(self, pick: int, ok: bool) -> None:
        jobs = list(self.world.model.jobs)
        self._do("complete", jobs[pick % len(jobs)], ok)

    @precondition(lambda self: self.world is not None and bool(self.world.model.finished)
                  and self.world.adapter.redelivery != "caller_guarantees_once")
    @rule()
    def redeliver(self) -> None:
        self._do("redeliver")


def store_machine(factory: Callable[..., BlockStoreAdapter], *, variants: Sequence[dict] = ({},),
                  name: str = "BlockStoreMachine") -> type[BlockStoreMachine]:
    """A machine class bound to ``factory(**variant)``; its ``TestCase`` runs under pytest."""
    sub = type(name, (BlockStoreMachine,), {"factory": staticmethod(factory), "variants": check_variants(variants)})
    sub.__module__ = BlockStoreMachine.__module__
    return sub


def run_store_fuzz(factory: Callable[..., BlockStoreAdapter], *, variants: Sequence[dict] = ({},), examples: int = 100,
                   steps: int = 40, seed: int = 0, progress: TextIO | None = None, shrink: bool = True,
                   machine_import: str | None = None):
    """``run_fuzz`` for a block store (the same ``FuzzResult``, regression test included)."""
    from hicache_fsm.testing.stateful import run_fuzz

    machine = store_machine(factory, variants=variants)
    machine.coverage = None
    return run_fuzz(machine, examples=examples, steps=steps, seed=seed, progress=progress, shrink=shrink,
                    machine_import=machine_import)
