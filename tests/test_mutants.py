"""Every planted controller bug (hicache_fsm.testing.mutants) is caught, and by which tool.

Per mutant, three tools run at their defaults and the session ends with a
table of who caught what, how fast and with how many steps:

- ``check``: the default families of ``hicache-fsm check`` the bug's cache
  configuration lives in (``testing.protocol.families_for``), stopping at the
  first violation, each family to its depth bound (the family known to catch
  a bug, ``TRY_FIRST``, explored first: the verdict is the same, the run shorter);
- ``fuzz``: the default ``hicache-fsm fuzz`` machine (every variant; seed 0, no
  shrinking, at most ``FUZZ_EXAMPLES`` runs), ``fuzz --cp`` for the CP bugs;
- ``suite``: the protocol machine as the test suite runs it
  (``tests/test_testing_toolkit.py``: 10 runs of 20 steps).

A mutant passes when some tool catches it; at least all but one must be caught
by ``check`` or ``fuzz`` at their defaults. The tools run in that order and stop
at the first that catches the bug (the table says "not run" for the others);
``HICACHE_MUTANT_TABLE=full`` runs all three for every bug, for a table of what
each tool catches on its own (the suite's time: about 3 s more a bug). Every tool
is bounded by the model (states, depth, runs), never by the clock: the seconds in
the table are for reading only. The sweep is marked ``slow`` (it still runs in the suite).
"""

from __future__ import annotations

import os
import time

import attrs
import pytest

from hicache_fsm.testing import explore, hicache_machine, run_fuzz
from hicache_fsm.testing.explorer import quiet_cache_logs
from hicache_fsm.testing.mutants import MUTANTS, mutant
from hicache_fsm.testing.protocol import families_for
from hicache_fsm.testing.stateful import cp_machine

FUZZ_EXAMPLES = 100
FULL_TABLE = os.environ.get("HICACHE_MUTANT_TABLE") == "full"  # every tool for every bug, not only up to the first
NOT_RUN = "not run (caught before)"

# The default family that catches each bug whose check spent seconds exploring the families before it
# (read off the report table): tried first, the others after it only when it misses. Whether check
# catches a bug does not depend on the order (it explores every default family); only the seconds do.
TRY_FIRST = {
    "failed_load_reported_done": "memory/load_back_pressure",
    "load_back_waits_for_adjacent_loads_only": "memory/chain_loads",
    "evict_host_newest_first": "memory/eviction_order",
    "cp_shortfall_own_rank_only": "cp/2_ranks_host_full",
    "backup_host_start_in_pages": "memory/pages_and_layers",
    "refused_backup_drops_parent": "memory/write_through_host_full",
    "split_upper_loses_recency": "storage/prefetch_split",
    "prefetch_inserted_under_root": "storage/prefetch_anchor",
    "anchor_lock_leak_on_host_full": "storage/host_full",
    "hit_count_lost_on_split": "memory/write_back",
    "lock_leak_on_refused_load_back": "memory/write_back",
    "prefetch_short_counted_complete": "storage/wait_complete",
    "prefetch_release_inserts": "storage/wait_complete",
    "wait_complete_stops_early": "storage/wait_complete",
    "match_ignores_namespace": "memory/namespaces",
    "insert_ignores_namespace": "memory/namespaces",
    "split_forgets_namespace": "memory/namespaces",
    "storage_keys_ignore_namespace": "storage/namespaces",
    "prefetch_lands_in_default_namespace": "storage/namespaces",
    "page_first_storage_page_at_slot": "storage/page_first",
}


@attrs.define
class Row:
    name: str
    bug: str
    check: str = "-"
    fuzz: str = "-"
    suite: str = "-"
    caught: bool = False
    fast: bool = False


@pytest.fixture(scope="module")
def table():
    return {}


def test_there_are_mutants_of_every_class():
    assert len(MUTANTS) >= 25
    assert len({m.bug for m in MUTANTS.values()}) == len(MUTANTS)
    assert sum(1 for m in MUTANTS.values() if m.variant.get("storage")) >= 3  # L3 / prefetch bugs
    assert sum(1 for m in MUTANTS.values() if m.variant.get("cp")) >= 2  # CP layer writes


def _patchable():
    from hicache_fsm.cache import HiCache
    from hicache_fsm.eviction import Eviction
    from hicache_fsm.layer_write import LayerWriteRuntime
    from hicache_fsm.load_back import LoadBacks
    from hicache_fsm.outbox import Outbox
    from hicache_fsm.radix import RadixTree
    from hicache_fsm.registry import registry_for
    from hicache_fsm.storage.prefetch import PrefetchOp, PrefetchRuntime
    from hicache_fsm.storage.tier import StorageTier

    classes = (HiCache, RadixTree, StorageTier, PrefetchRuntime, PrefetchOp, LayerWriteRuntime, Eviction, LoadBacks,
               Outbox)
    return ([dict(vars(c)) for c in classes]
            + [dict(getattr(registry_for(m), kind)) for m in ("residency", "prefetch", "storage_link")
               for kind in ("effects", "guards")])


def test_mutants_are_undone():
    before = _patchable()
    for name in MUTANTS:
        with mutant(name):
            pass
    assert _patchable() == before


def test_each_family_tried_first_is_a_default_family_of_its_bug():
    for name, family in TRY_FIRST.items():
        assert family in [f[0] for f in families_for(MUTANTS[name].variant)], (name, family)


def _check(variant: dict, first: str | None = None) -> tuple[str, bool]:
    t = time.perf_counter()
    states = 0
    families = sorted(families_for(variant), key=lambda f: f[0] != first)  # stable: ``first``, then the usual order
    for family, bounds, factory in families:
        result = explore(bounds, factory, stop_on_first=True)
        states += result.states
        if result.violations:
            secs = time.perf_counter() - t
            return f"caught {secs:5.1f}s {family} {len(result.violations[0].trace)} steps", True
    return f"missed ({time.perf_counter() - t:.0f}s, {states} states)", False


def _fuzz(machine, examples: int, steps: int) -> tuple[str, bool]:
    t = time.perf_counter()
    fuzz = run_fuzz(machine(), examples=examples, steps=steps, seed=0, shrink=False)
    secs = time.perf_counter() - t
    if not fuzz.ok:
        return f"caught {secs:5.1f}s {fuzz.examples:3d} runs", True
    return f"missed ({secs:.0f}s)", False


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MUTANTS))
def test_mutant_is_caught(name, table):
    m = MUTANTS[name]
    row = table.setdefault(name, Row(name, m.bug))
    with quiet_cache_logs(), mutant(name):
        row.check, check_fast = _check(m.variant, TRY_FIRST.get(name))
        machine = cp_machine if m.variant.get("cp") else hicache_machine  # `fuzz --cp` for CP bugs
        row.fuzz, fuzz_fast = (NOT_RUN, False)
        if FULL_TABLE or not check_fast:
            row.fuzz, fuzz_fast = _fuzz(machine, FUZZ_EXAMPLES, 40)
        if FULL_TABLE or not (check_fast or fuzz_fast):
            row.suite, _ = _fuzz(machine, 10, 20)
        else:
            row.suite = NOT_RUN
    row.caught = row.check.startswith("caught") or row.fuzz.startswith("caught") or row.suite.startswith("caught")
    row.fast = check_fast or fuzz_fast
    assert row.caught, f"{name} ({m.bug}) escaped every tool"


@pytest.mark.slow
def test_report_table(table, capsys):
    """Runs last in this file: print who caught each planted bug, and how fast."""
    if not table:
        pytest.skip("no mutant ran (deselected)")
    lines = ["", f"{'planted bug':40s} {'check (defaults)':52s} {'fuzz (defaults)':23s} suite"]
    for r in table.values():
        lines.append(f"{r.name:40s} {r.check:52s} {r.fuzz:23s} {r.suite}")
    fast = sum(r.fast for r in table.values())
    lines.append(f"{fast}/{len(table)} caught by check or fuzz at defaults; "
                 f"{sum(r.caught for r in table.values())}/{len(table)} caught by some tool")
    with capsys.disabled():
        print("\n".join(lines))
    assert fast >= len(table) - 1
