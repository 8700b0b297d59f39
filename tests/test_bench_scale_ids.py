"""``bench scale`` times ours with ids in both forms an engine may hand over, on one cache, and names each form."""

from __future__ import annotations

from hicache_fsm.bench import scale


def test_ours_is_timed_with_a_tuple_per_call_and_with_ids_packed_once_per_request():
    out = scale.measure(100, chunks=1, calls=2, headroom_pages=0, seed=0, warmup_cycles=2)
    assert set(out["ids"]) == {"ours", "packed"}
    for key in scale.ID_OPS:
        assert out[key] >= 0 and out[f"packed_{key}"] >= 0
        for name in scale.BASELINES:
            assert f"vs_{name}_packed_{key[:-3]}" in out
    assert "packed_lock_us" not in out and "packed_evict_us" not in out  # they take no ids
    assert out["pack_us"] >= 0

