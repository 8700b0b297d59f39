"""Two cache instances in two processes share one Redis: what one writes, the other prefetches."""

from __future__ import annotations

import multiprocessing as mp

import torch
from storage_util import (
    load_and_read,
    make_cache,
    path_nodes,
    prompt,
    put,
    ready,
    settle,
    wait_until,
)

TOKENS = prompt(64, seed=42)
OPTIONS = {"model": "tiny", "prefetch_threshold": 8, "stop_policy": "wait_complete", "batch_pages": 4}


def _writer(url: str, out_path: str) -> None:
    """Child process: compute KV, back it up through host memory to Redis, save what was written."""
    cache = make_cache()
    try:
        cache.attach_storage(url, **OPTIONS)
        put(cache, TOKENS)
        wait_until(cache, lambda: all(n.state.endswith("stored") for n in path_nodes(cache, TOKENS)[0]),
                   what="backup to redis")
        path, _ = path_nodes(cache, TOKENS)
        host = torch.cat([n.host_indices for n in path])
        torch.save(cache.host_pool.read(host), out_path)
        cache.check_invariants()
    finally:
        cache.close()


def test_two_processes_share_pages_through_redis(redis_server, tmp_path):
    out = str(tmp_path / "written.pt")
    proc = mp.get_context("spawn").Process(target=_writer, args=(redis_server.url, out))
    proc.start()
    proc.join(300)  # a safety stop only: spawning a torch process is slow on a busy machine
    if proc.is_alive():
        proc.kill()
        proc.join(5)
        raise AssertionError("writer process hung")
    assert proc.exitcode == 0, f"writer process failed with exit code {proc.exitcode}"
    written_k, written_v = torch.load(out)

    cache = make_cache()
    try:
        cache.attach_storage(redis_server.url, **OPTIONS)
        m = cache.match_prefix(TOKENS)
        assert m.device_hit_length == m.host_hit_length == 0  # nothing local: all from the other process
        assert cache.prefetch("req", TOKENS, m)
        ready(cache, "req")
        assert cache.stats()["storage"]["prefetch_inserted_tokens"] == len(TOKENS)
        k, v, n = load_and_read(cache, TOKENS)
        assert n == len(TOKENS)
        assert torch.equal(k, written_k) and torch.equal(v, written_v), "served KV differs from what was written"
        settle(cache)
        cache.check_invariants()
    finally:
        cache.close()
