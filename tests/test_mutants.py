"""Every planted controller bug (hicache_fsm.testing.mutants) is caught by the explorer or the fuzzer.

For each mutant the bounded explorer runs first (2 nodes, 2 device and 2 host
pages, in the configuration the bug lives in -- with a step-by-step storage
tier for the L3 / prefetch bugs -- stopping at the first violation), then the
fuzzer with its default variants (seed 0, no shrinking, at most
``FUZZ_EXAMPLES`` runs). The test passes when at least one catches the
bug; the session ends with a table of who caught what, how fast and with how
many steps.
"""

from __future__ import annotations

import time

import attrs
import pytest

from hicache_fsm.testing import Bounds, explore, hicache_machine, run_fuzz
from hicache_fsm.testing.explorer import quiet_cache_logs
from hicache_fsm.testing.mutants import MUTANTS, mutant

FUZZ_EXAMPLES = 150


@attrs.define
class Row:
    name: str
    bug: str
    explorer: str = "-"
    fuzzer: str = "-"


@pytest.fixture(scope="module")
def table():
    return {}


def test_there_are_at_least_ten_mutants():
    assert len(MUTANTS) >= 10
    assert len({m.bug for m in MUTANTS.values()}) == len(MUTANTS)
    assert sum(1 for m in MUTANTS.values() if m.variant.get("storage")) >= 3  # L3 / prefetch bugs


def _patchable():
    from hicache_fsm.cache import HiCache
    from hicache_fsm.radix import RadixTree
    from hicache_fsm.registry import registry_for
    from hicache_fsm.storage.prefetch import PrefetchOp, PrefetchRuntime
    from hicache_fsm.storage.tier import StorageTier

    return ([dict(vars(c)) for c in (HiCache, RadixTree, StorageTier, PrefetchRuntime, PrefetchOp)]
            + [dict(getattr(registry_for(m), kind)) for m in ("residency", "prefetch") for kind in ("effects", "guards")])


def test_mutants_are_undone():
    before = _patchable()
    for name in MUTANTS:
        with mutant(name):
            pass
    assert _patchable() == before


@pytest.mark.parametrize("name", list(MUTANTS))
def test_mutant_is_caught(name, table):
    m = MUTANTS[name]
    row = table.setdefault(name, Row(name, m.bug))
    with quiet_cache_logs(), mutant(name):
        t = time.perf_counter()
        result = explore(Bounds(nodes=2, device_pages=2, host_pages=2, **m.variant), stop_on_first=True,
                         )
        secs = time.perf_counter() - t
        if result.violations:
            v = result.violations[0]
            row.explorer = f"caught {secs:5.1f}s {result.states:5d} states, {len(v.trace)} steps"
        else:
            row.explorer = "missed"
        t = time.perf_counter()
        fuzz = run_fuzz(hicache_machine(), examples=FUZZ_EXAMPLES, steps=40, seed=0, shrink=False)
        secs = time.perf_counter() - t
        if not fuzz.ok:
            row.fuzzer = f"caught {secs:5.1f}s {fuzz.examples:4d} runs, {len(fuzz.steps)} steps"
        else:
            row.fuzzer = f"missed in {fuzz.examples} runs ({secs:.1f}s)"
    assert result.violations or not fuzz.ok, f"{name} ({m.bug}) escaped both the explorer and the fuzzer"


def test_report_table(table, capsys):
    """Runs last in this file: print who caught each planted bug, and how fast."""
    if not table:
        pytest.skip("no mutant ran (deselected)")
    lines = ["", f"{'planted bug':32s} {'explorer (time, states, trace)':42s} fuzzer (time, runs, steps)"]
    for r in table.values():
        lines.append(f"{r.name:32s} {r.explorer:42s} {r.fuzzer}")
    caught = sum(1 for r in table.values() if r.explorer.startswith("caught") or r.fuzzer.startswith("caught"))
    lines.append(f"{caught}/{len(table)} planted bugs caught")
    with capsys.disabled():
        print("\n".join(lines))
    assert caught == len(table)
