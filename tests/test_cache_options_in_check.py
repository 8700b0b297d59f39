"""Config thresholds and budgets in the verification toolkit: ``Bounds.cache_options``, ``check --cache-option``,
the ``option_families`` and the obligations that read those fields (``testing.obligations``)."""

from __future__ import annotations

import json

import pytest

from hicache_fsm.cli import main
from hicache_fsm.errors import ConfigError
from hicache_fsm.testing.explorer import Bounds, explore, quiet_cache_logs
from hicache_fsm.testing.protocol import default_families, families_for
from obligation_helpers import backed_up, flagged_only_when_planted

OPTION_FAMILIES = ("memory/headroom", "memory/load_back_limits", "memory/write_behind_batch",
                   "memory/selective_threshold_1")


def test_cache_options_are_sorted_pairs_of_config_fields():
    b = Bounds(cache_options={"load_back_threshold": 2, "eviction_headroom_tokens": 1})
    assert b.cache_options == (("eviction_headroom_tokens", 1), ("load_back_threshold", 2))
    assert hash(b) == hash(Bounds(cache_options=[("load_back_threshold", 2), ("eviction_headroom_tokens", 1)]))


@pytest.mark.parametrize("options, says", [
    ({"no_such_field": 1}, "unknown option(s) no_such_field"),
    ({"write_policy": "write_back"}, "bounds of their own"),
    ({"load_back_threshold": -1}, "load_back_threshold"),
    (5, "must be a mapping of field names"),
])
def test_bad_cache_options_are_a_config_error(options, says):
    with pytest.raises(ConfigError) as exc:
        Bounds(cache_options=options)
    assert says in str(exc.value)


def test_the_option_families_set_their_fields_and_hold_for_the_real_cache():
    fams = {n: (b, f) for n, b, f in default_families() if n in OPTION_FAMILIES}
    assert set(fams) == set(OPTION_FAMILIES) and all(b.cache_options for b, _ in fams.values())
    assert [n for n, _, _ in families_for({"cache_options": {"eviction_headroom_tokens": 1}})] == ["memory/headroom"]
    with quiet_cache_logs():
        for name, (bounds, factory) in fams.items():
            result = explore(bounds, factory)
            assert result.complete and not result.violations, name
            assert dict(bounds.cache_options).items() <= {k: getattr(factory(bounds).config, k)
                                                          for k, _ in bounds.cache_options}.items()


def test_check_takes_cache_options_and_names_them(capsys):
    assert main(["check", "--cache-option", "eviction_headroom_tokens=1", "--cache-option", "load_back_max_tokens=none",
                 "--max-depth", "2", "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "eviction_headroom_tokens=1" in out["adapter"] and out["complete"]
    assert main(["check", "--cache-option", "eviction_headroom_tokens=1", "--max-depth", "2", "--quiet"]) == 0
    assert "eviction_headroom_tokens=1" in capsys.readouterr().out


@pytest.mark.parametrize("option, says", [
    ("nope=1", "unknown option(s) nope"),
    ("load_back_threshold=x", "is not an int or none"),
    ("load_back_threshold=-2", "load_back_threshold must be an int >= 0"),
    ("=3", "NAME=VALUE"),
])
def test_a_bad_cache_option_is_a_usage_error_in_one_line(option, says, capsys):
    try:
        status = main(["check", "--cache-option", option, "--max-depth", "2", "--quiet"])
    except SystemExit as exc:  # refused by argparse
        status = exc.code
    assert status == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_an_allocation_evicts_its_shortfall_plus_the_headroom_and_only_when_short():
    steps = [lambda a: backed_up(a, (1,), (2,)),
             lambda a: backed_up(a, (3,)),  # one page free: no eviction
             lambda a: a.insert((4, 4))]  # two pages wanted, none free: the shortfall and one more
    flagged_only_when_planted(steps, ("alloc_ignores_headroom", "alloc_evicts_headroom_with_room"), "headroom_kept",
                               device_pages=3, host_pages=6, eviction_headroom_tokens=1)


def test_a_load_back_evicts_its_shortfall_plus_the_headroom():
    steps = [lambda a: backed_up(a, (1, 1)),
             lambda a: a.evict(2),  # a host-only chain of two tokens
             lambda a: backed_up(a, (2,), (3,)),  # one device page free, two that could go
             lambda a: a.load_back((1, 1))]
    flagged_only_when_planted(steps, ("load_back_ignores_headroom",), "headroom_kept",
                               device_pages=3, host_pages=6, eviction_headroom_tokens=1)


def test_a_load_back_starts_only_within_its_limits():
    steps = [lambda a: backed_up(a, (1,), (2, 2, 2)),
             lambda a: a.evict(4),
             lambda a: a.load_back((1,)),  # under the threshold
             lambda a: a.load_back((2, 2, 2))]  # over the cap
    flagged_only_when_planted(steps, ("load_back_ignores_threshold", "load_back_ignores_max_tokens"),
                               "load_back_limits", device_pages=4, host_pages=4, load_back_threshold=2,
                               load_back_max_tokens=2)


def test_write_behind_backs_up_within_its_batch_and_only_cold_nodes():
    two_cold = [lambda a: a.insert((1,)), lambda a: a.insert((2,)), lambda a: a.poll()]
    flagged_only_when_planted(two_cold, ("write_behind_ignores_batch",), "write_behind_batch", device_pages=2,
                               host_pages=2, write_policy="write_behind", write_behind_batch_tokens=1,
                               write_behind_idle_steps=1)
    polls = [lambda a: a.insert((1,)), lambda a: a.poll(), lambda a: a.poll()]
    flagged_only_when_planted(polls, ("write_behind_one_poll_early",), "write_behind_early", device_pages=2,
                               host_pages=2, write_policy="write_behind")
    flagged_only_when_planted(polls, ("write_behind_one_poll_late",), "write_behind_due", device_pages=2,
                               host_pages=2, write_policy="write_behind")


# =========================================================================== the storage tier's options

LIMITS = {"prefetch_threshold": 2, "prefetch_capacity_tokens": 3, "batch_pages": 1}


@pytest.mark.parametrize("bounds, says", [
    (dict(storage=True, storage_options={"timeout_max": 1}), "unknown option(s) timeout_max"),
    (dict(storage_options={"batch_pages": 1}), "need a storage tier"),
    (dict(storage=True, storage_options={"batch_pages": 0}), "batch_pages must be a positive int"),
])
def test_bad_storage_options_are_a_config_error(bounds, says):
    with pytest.raises(ConfigError) as exc:
        Bounds(**bounds)
    assert says in str(exc.value)


def test_the_prefetch_limits_family_sets_them_and_holds_for_the_real_cache():
    [(bounds, factory)] = [(b, f) for n, b, f in default_families() if n == "storage/prefetch_limits"]
    assert dict(bounds.storage_options) == LIMITS
    adapter = factory(bounds)
    assert "prefetch_threshold=2, prefetch_capacity_tokens=3, batch_pages=1" in adapter.describe()
    assert (adapter.cache.storage.options.prefetch_threshold, adapter.cache.storage.options.batch_pages) == (2, 1)
    adapter.close()
    with quiet_cache_logs():
        result = explore(bounds, factory)
    assert result.complete and not result.violations


def _storage_settled(a) -> None:
    """Every job and storage step run until nothing is queued (backups land and are stored)."""
    while a.pending_jobs() or a.storage_steps():
        for job in a.pending_jobs():
            a.complete_job(job.id)
        for step in a.storage_steps():
            a.complete_storage(step.id)


def test_a_prefetch_is_admitted_within_the_threshold_and_the_capacity():
    steps = [lambda a: a.prefetch((1,)),  # one page: under the threshold of two
             lambda a: a.prefetch((2, 2)),
             lambda a: a.prefetch((3, 3))]  # two more tokens beside two: over the capacity of three
    flagged_only_when_planted(steps, ("prefetch_admits_below_threshold",), "prefetch_admission", device_pages=2,
                              host_pages=6, storage=True, **LIMITS)
    flagged_only_when_planted(steps, ("prefetch_capacity_ignored",), "prefetch_admission", device_pages=2,
                              host_pages=6, storage=True, **LIMITS)


def test_a_hit_query_below_the_threshold_revokes_its_prefetch():
    steps = [lambda a: a.store_remote((1,)),
             lambda a: a.prefetch((1, 1)),  # two tokens asked, one stored: the query finds one page
             lambda a: [a.complete_storage(s.id) for s in a.storage_steps()]]
    flagged_only_when_planted(steps, ("prefetch_kept_below_threshold",), "prefetch_revoke", device_pages=2,
                              host_pages=6, storage=True, **LIMITS)


def test_storage_calls_take_at_most_a_batch_of_keys():
    steps = [lambda a: a.store_remote((1, 1)),
             lambda a: a.prefetch((1, 1)),
             lambda a: [a.complete_storage(s.id) for s in a.storage_steps()]]  # the hit query of two pages
    flagged_only_when_planted(steps, ("storage_calls_ignore_batch_pages",), "batch_bound", device_pages=2,
                              host_pages=6, storage=True, **LIMITS)


def test_verify_stored_asks_the_backend_a_batch_of_keys_at_a_time():
    from hicache_fsm.testing.adapter import HiCacheAdapter

    a = HiCacheAdapter(device_pages=4, host_pages=4, storage=True, batch_pages=1)
    a.insert((1, 1, 1))
    _storage_settled(a)
    assert a.cache.tree.walk(a.cache_form((1, 1, 1))[1])[0][-1].state.endswith("_stored")
    a.faults.widest = 0
    assert a.cache.storage.verify_stored() == 0
    assert a.faults.widest == 1  # three calls of one key, not one of three
    a.backend.inner.clear()
    assert a.cache.storage.verify_stored() == 1
    a.close()


# =========================================================================== another tenant on the same storage


def test_a_sibling_backend_writes_beside_its_store_under_another_namespace():
    import attrs

    from hicache_fsm.storage.memory import MemoryBackend

    ours = MemoryBackend()
    theirs = ours.sibling(attrs.evolve(ours.namespace, tenant="tenant-b"))
    assert theirs.batch_set(["p0"], [b"their page"]) == [True]
    assert ours.batch_exists(["p0"]) == 0 and theirs.batch_exists(["p0"]) == 1  # one store, two key spaces
    theirs.close()
    assert ours.stored_keys() == ["default/tenant-b/0of1/p0"]  # closing the sibling kept the store
    ours.close()


def test_remote_tenant_needs_storage_and_a_tenant_name_keys_accept():
    with pytest.raises(ConfigError, match="needs a storage tier"):
        Bounds(remote_tenant="tenant-b")
    with pytest.raises(ConfigError, match="Bounds.remote_tenant"):
        Bounds(storage=True, remote_tenant="a/b")


def test_another_tenants_pages_are_never_hit():
    [(bounds, factory)] = [(b, f) for n, b, f in default_families() if n == "storage/foreign_tenant"]
    assert bounds.remote_tenant == "tenant-b" and "remote_tenant=tenant-b" in factory(bounds).describe()
    with quiet_cache_logs():
        result = explore(bounds, factory)
    assert result.complete and not result.violations
    # keys without the tenant: the backup of the same tokens finds the other tenant's page and keeps it
    steps = [lambda a: a.store_remote((1,)), lambda a: a.insert((1,)), _storage_settled]
    flagged_only_when_planted(steps, ("storage_keys_ignore_tenant",), "stored_means_stored", device_pages=1,
                              host_pages=2, storage=True, remote_tenant="tenant-b")
