"""Replay a trace's configurations in worker processes, one configuration per process.

The configurations of ``simulate --trace`` share nothing while they replay
(each has its own cache, and storage its own key space), so on a machine with
several cores each can run in its own process: the wall time is then about
that of the slowest configuration (the one with storage) instead of the sum.
A worker is ``python -m hicache_fsm.trace_workers``: it reads one JSON job on
stdin (the trace's requests, the configuration, the replay options) and
writes its result and latency as JSON on stdout. Nothing is pickled.
Every figure but the timings (wall, controller and executor seconds) is the
one an in-process replay gives.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Callable, Sequence

import attrs

import hicache_fsm
from hicache_fsm.errors import HiCacheError
from hicache_fsm.simulate import FULL, Tier, TierResult
from hicache_fsm.trace import BlockTokens, Trace, TraceRequest
from hicache_fsm.trace_replay import ConfigReplayer, Latency, replay_timed

WORKER_MODULE = "hicache_fsm.trace_workers"


def usable_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _job(tier: Tier, trace: Trace, page_size: int, layout: str, device: str, namespace: str) -> str:
    return json.dumps({
        "tier": attrs.asdict(tier),
        "trace": {"path": trace.path, "block_size": trace.block_size,
                  "requests": [[r.timestamp, r.input_length, r.output_length, list(r.hash_ids), r.line]
                               for r in trace.requests]},
        "page_size": page_size, "layout": layout, "device": device, "namespace": namespace,
    })


def _run_worker(payload: str) -> dict:
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(hicache_fsm.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([package_root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    done = subprocess.run([sys.executable, "-m", WORKER_MODULE], input=payload, capture_output=True, text=True,
                          env=env, check=False)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise HiCacheError(f"trace replay worker failed (exit {done.returncode}): {last}")
    return json.loads(done.stdout)


def replay_in_workers(jobs: int, tiers: Sequence[Tier], trace: Trace, page_size: int, layout: str, device: str,
                      namespace: str, on_tier: Callable[[], None] = lambda: None) -> list[tuple[TierResult, Latency]]:
    """``replay_timed`` of each configuration in its own worker process, at most ``jobs`` at once.

    Returns ``(TierResult, Latency)`` pairs in the order of ``tiers``. The
    storage configuration (the longest) starts first. ``on_tier()`` follows
    each finished configuration.
    """
    order = sorted(range(len(tiers)), key=lambda i: tiers[i].name != FULL)
    payloads = {i: _job(tiers[i], trace, page_size, layout, device, namespace) for i in order}
    out: dict[int, tuple] = {}
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {i: pool.submit(_run_worker, payloads[i]) for i in order}
        for i in order:
            answer = futures[i].result()
            out[i] = (TierResult(**answer["result"]), Latency(**answer["latency"]))
            on_tier()
    return [out[i] for i in range(len(tiers))]


def in_workers(jobs: int) -> ConfigReplayer:
    """What ``run_trace(..., elsewhere=...)`` takes: ``replay_in_workers`` with at most ``jobs`` at once."""
    return partial(replay_in_workers, jobs)


def main() -> int:
    """One worker: a JSON job on stdin, ``{"result": ..., "latency": ...}`` on stdout."""
    job = json.loads(sys.stdin.read())
    t = job["trace"]
    requests = tuple(TraceRequest(ts, n_in, n_out, tuple(ids), line) for ts, n_in, n_out, ids, line in t["requests"])
    trace = Trace(t["path"], t["block_size"], requests)
    [(result, latency)] = replay_timed([Tier(**job["tier"])], trace, BlockTokens(trace.block_size),
                                       job["page_size"], job["layout"], job["device"], job["namespace"])
    json.dump({"result": attrs.asdict(result), "latency": attrs.asdict(latency)}, sys.stdout)
    return 0


__all__ = ["in_workers", "replay_in_workers", "usable_cores"]


if __name__ == "__main__":
    sys.exit(main())
