"""``bench scale`` times ours with ids in two forms an engine may hand over, on one cache, and names each form."""

from __future__ import annotations

import argparse
from array import array

import pytest

from hicache_fsm.bench import scale


@pytest.mark.parametrize("ids", sorted(scale.ID_FORMS))
def test_ours_is_timed_with_ids_in_the_named_form_per_call_and_with_ids_packed_once_per_request(ids):
    out = scale.measure(100, chunks=1, calls=2, headroom_pages=0, seed=0, warmup_cycles=2, ids=ids)
    assert out["ids"] == {"ours": scale.ID_FORMS[ids][1], "packed": "a TokenIds packed once per request"}
    for key in scale.ID_OPS:
        assert out[key] >= 0 and out[f"packed_{key}"] >= 0
        for name in scale.BASELINES:
            assert f"vs_{name}_packed_{key[:-3]}" in out
    assert "packed_lock_us" not in out and "packed_evict_us" not in out  # they take no ids
    assert out["pack_us"] >= 0


def test_the_default_form_is_the_array_sglangs_scheduler_holds_ids_in():
    """The peer is handed ``array("q")``: by default ours gets the same form, so the ratio compares like inputs."""
    parser = argparse.ArgumentParser()
    scale.configure(parser)
    default = parser.parse_args([]).ids
    form = scale.ID_FORMS[default][0]((1, 2, 3))
    peer = scale.sglang_peer.PEER_FORMS[scale.sglang_peer.peer_form(default)][0]((1, 2, 3))
    assert type(form) is array and type(peer) is array and form == peer


@pytest.mark.parametrize("ids", ["tuple", "list"])
def test_with_python_ids_the_peer_is_handed_python_ids_too(ids):
    """Ours timed on a tuple or list is compared with SGLang handed a list (it keeps no tuples), never an array."""
    peer = scale.sglang_peer.PEER_FORMS[scale.sglang_peer.peer_form(ids)][0]((1, 2, 3))
    assert type(peer) is list and peer == [1, 2, 3]


def test_the_insert_timed_without_its_backup_starts_that_backup_once_the_clock_has_stopped(monkeypatch):
    """``insert_nobackup_us`` reads the clock around the insert alone: the backup the insert asks for starts after
    the second read, and it does start (the new node ends backed up), so the cache is left as ``insert_timed``
    leaves it."""
    from hicache_fsm.eviction import Eviction

    ours = scale.OursVariant(64, 4, 0)
    ours.fill(64)
    tok = scale.RequestTokens(0)
    for _ in range(2):
        ours.put(tok.request())
    reads: list[int] = []
    backups_after: list[int] = []
    real_backup = Eviction.try_backup

    def counted_backup(self, node):
        backups_after.append(len(reads))
        return real_backup(self, node)

    monkeypatch.setattr(Eviction, "try_backup", counted_backup)
    tokens = tok.request()
    spent = ours.insert_without_backup_timed(tokens, lambda: reads.append(0) or float(len(reads)))
    assert spent == 1.0 and len(reads) == 2
    assert backups_after == [2]  # one backup, after both reads
    assert "try_backup" not in vars(ours.cache.eviction)
    leaf = ours.cache.match_prefix(tokens).last_device_node
    assert leaf.state == "device_host"
