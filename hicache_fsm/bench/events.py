"""What KV events cost the controller: ``bench controller``'s loop with events off and on, same run.

The loop and requests are ``bench controller``'s (4,096-token requests, page
64, write_through, acks without copying, a tree already holding
``--tree-nodes`` prefixes): ``match_prefix``, ``insert``, two ``poll``.
Three caches serve the same requests, their timed chunks alternating:

- ``off``: no listener;
- ``on (in-process)``: :func:`hicache_fsm.events.enable_kv_events` with a
  sink that keeps the hook's pending batches (what the hook costs the serving
  thread: recording each event); after each chunk, untimed, the sink renders
  them (page hashes, event structs), and that is timed apart as
  ``render_us_per_request``: the work an engine's publisher thread does;
- ``on (ZMQ)``: the sink is a :class:`ZmqEventPublisher` on 127.0.0.1 (the
  hand-off to its queue; rendering, encoding and sending run on its thread).

With events on, ``flush`` runs once per request (an engine step) inside the
timed part. The variants' order flips every chunk; the best chunk of each is kept.
``--clock thread`` (the default) times the serving thread's CPU time: other
processes on the machine do not count, and neither does the publisher's
thread (encoding and sending run off the request path). Result keys:
``off_us_per_request``, ``inprocess_us_per_request``, ``zmq_us_per_request``,
``inprocess_overhead_pct`` / ``zmq_overhead_pct`` against ``off``, and
``render_us_per_request`` (rendering a request's events, off the serving path).
"""

from __future__ import annotations

import argparse
import time

import torch

from hicache_fsm.bench.common import machine_description, report
from hicache_fsm.bench.controller import (
    CHUNK, PAGE_SIZE, REQUEST_TOKENS, SYSTEM_PROMPTS, fill, make_cache, make_requests, serve, system_prompts)
from hicache_fsm.commands.args import non_negative_int, positive_int
from hicache_fsm.events.hook import KVEventHook, enable_kv_events
from hicache_fsm.events.pending import PendingBatch, accepts_pending
from hicache_fsm.events.publisher import ZmqEventPublisher


class PendingLog:
    """An in-process sink that keeps the hook's pending batches and renders them when drained."""

    def __init__(self) -> None:
        self.pending: list[PendingBatch] = []

    @accepts_pending
    def publish(self, batch: PendingBatch) -> None:
        self.pending.append(batch)

    def drain(self) -> int:
        """Render every kept batch (page hashes, structs) and forget them; returns the events rendered."""
        events = sum(len(batch.render().events) for batch in self.pending)
        self.pending.clear()
        return events


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=positive_int, default=1000, help="timed requests per repeat (default 1000)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="runs of --requests new requests (default 3)")
    parser.add_argument("--tree-nodes", type=non_negative_int, default=None,
                        help="nodes in the tree before timing (default 10 x --requests)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="thread",
                        help="thread: the serving thread's CPU time (default; steady on a shared machine, and the "
                             "publisher thread's work is not counted); wall: perf_counter")


CLOCKS = {"thread": time.thread_time, "wall": time.perf_counter}


def _serve(cache, hook: KVEventHook | None, requests: list[tuple[int, ...]], pc=time.thread_time) -> float:
    """``bench controller``'s timed loop, plus one ``flush`` a request when events are on."""
    return serve(cache, requests, pc, None if hook is None else hook.flush)


def run(args: argparse.Namespace) -> dict:
    n, repeats = args.requests, args.repeats
    clock = CLOCKS[getattr(args, "clock", "thread")]
    tree_nodes = args.tree_nodes if args.tree_nodes is not None else 10 * n
    capacity = tree_nodes * PAGE_SIZE + (repeats * n + SYSTEM_PROMPTS) * REQUEST_TOKENS
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    kept = PendingLog()
    publisher = ZmqEventPublisher()
    try:
        caches = {name: make_cache(capacity) for name in ("off", "inprocess", "zmq")}
        for cache in caches.values():
            fill(cache, tree_nodes)
        hooks = {"off": None,
                 "inprocess": enable_kv_events(caches["inprocess"], kept.publish),
                 "zmq": enable_kv_events(caches["zmq"], publisher.publish)}
        snapshot_events = hooks["inprocess"].events  # the filled tree, published when events were enabled
        prompts = system_prompts(args.seed)
        chunk = min(CHUNK, n)
        best = {name: float("inf") for name in caches}
        kept.drain()
        render_s, rendered_requests = 0.0, 0
        for r in range(repeats):
            requests = make_requests(n, args.seed + 7919 * r, prompts)
            for start in range(0, n - chunk + 1, chunk):
                part = requests[start : start + chunk]
                order = list(caches) if (start // chunk + r) % 2 == 0 else list(reversed(caches))
                for name in order:  # alternate which variant goes first
                    best[name] = min(best[name], _serve(caches[name], hooks[name], part, clock) / chunk * 1e6)
                t0 = clock()
                kept.drain()  # the hashing and struct building the serving thread no longer does
                render_s += clock() - t0
                rendered_requests += chunk
        events = hooks["inprocess"].events - snapshot_events
    finally:
        publisher.close()
        torch.set_num_threads(threads)
    off = best["off"]
    result = {
        "benchmark": "events",
        "requests": n,
        "repeats": repeats,
        "tree_nodes": tree_nodes,
        "request_tokens": REQUEST_TOKENS,
        "page_size": PAGE_SIZE,
        "clock": getattr(args, "clock", "thread"),
        "timed": "bench controller's match_prefix + insert + 2 x poll (+ flush with events on); best chunk of 100",
        "off_us_per_request": round(off, 2),
        "inprocess_us_per_request": round(best["inprocess"], 2),
        "zmq_us_per_request": round(best["zmq"], 2),
        "inprocess_overhead_pct": round(100 * (best["inprocess"] / off - 1), 2),
        "zmq_overhead_pct": round(100 * (best["zmq"] / off - 1), 2),
        "render_us_per_request": round(render_s / max(1, rendered_requests) * 1e6, 2),
        "events_per_request": round(events / max(1, repeats * n), 2),
        "zmq_dropped": publisher.dropped,
        "machine": machine_description(),
    }
    rows = [
        ("requests", f"{repeats} x {n} x {REQUEST_TOKENS} tokens, page {PAGE_SIZE}, {tree_nodes} nodes already cached"),
        ("events off", f"{off:.1f} us/request"),
        ("events on, in-process sink", f"{best['inprocess']:.1f} us/request ({result['inprocess_overhead_pct']:+.1f}%)"),
        ("events on, ZMQ publisher", f"{best['zmq']:.1f} us/request ({result['zmq_overhead_pct']:+.1f}%)"),
        ("rendering them, off the serving path", f"{result['render_us_per_request']:.1f} us/request"),
        ("events per request", f"{result['events_per_request']}"),
    ]
    report("KV events: controller time per request, events off vs on", rows, result, getattr(args, "json", False))
    return result
