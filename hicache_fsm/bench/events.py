"""What KV events cost the controller: ``bench controller``'s loop with events off and on, same run.

The loop and requests are ``bench controller``'s (4,096-token requests, page
64, write_through, acks without copying, a tree already holding
``--tree-nodes`` prefixes): ``match_prefix``, ``insert``, two ``poll``. Three
caches serve the same requests:

- ``off``: no listener;
- ``inprocess``: :func:`hicache_fsm.events.enable_kv_events` with a sink that
  keeps the hook's pending batches; after each chunk, untimed, the serving
  thread renders them as ``KVEventBatch`` structs (what an in-process
  consumer reads);
- ``zmq``: the sink is a :class:`ZmqEventPublisher` on 127.0.0.1 (the
  hand-off to its queue; hashing, writing the msgpack bytes and sending run
  on its thread); after each chunk the serving thread sleeps until the
  publisher has sent the chunk's batches.

With events on, ``flush`` runs once per request (an engine step) inside the
timed part. Interleaved as finely as the loop allows: within each chunk of
100 requests every request runs on the three caches in turn (the order
rotates per request), so machine noise hits the variants alike; the
collector is off during a chunk. Figures per variant against ``off``:

- ``serving_best_chunk_pct``: its best chunk against off's best chunk
  (``bench controller``'s figure);
- ``serving_median_chunk_pct``: the median over chunks of its time against
  off's in the same chunk (the steady one on a busy machine);
- ``beside_cpu_us_per_request``: CPU spent on events outside the timed part:
  the in-process rendering (serving thread, after each chunk); the
  publisher's sender and libzmq's I/O thread (all the process's CPU beyond
  the serving thread, during the chunk and its settling);
- ``process_cpu_median_chunk_pct`` and ``process_cpu_pct``: the whole
  process's CPU (timed part plus beside) against off's, per chunk (median)
  and over the run.

``--clock thread`` (the default) times the serving thread's CPU; ``--clock
wall`` its wall time (the whole-process figures need the thread clock). The
publisher keeps the last ``--replay-batches`` batches for replay (1,000; a
server's buffer, full, recycles its oldest batch's memory for each new one,
and so does this run once it has published that many).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from hicache_fsm.bench.common import machine_description, report
from hicache_fsm.bench.controller import (
    CHUNK, PAGE_SIZE, REQUEST_TOKENS, check_sizes, fill, make_cache, make_requests, serve_one, system_prompts)
from hicache_fsm.commands.args import bounded_int, non_negative_int, positive_int, seed_int
from hicache_fsm.events.hook import enable_kv_events
from hicache_fsm.events.pending import PendingBatch, accepts_pending
from hicache_fsm.events.publisher import MAX_HWM, ZmqEventPublisher

VARIANTS = ("off", "inprocess", "zmq")
TARGET_PCT = 10.0  # the budget: events on cost at most this much of the controller's time per request
CLOCKS = {"thread": time.thread_time, "wall": time.perf_counter}
SETTLE_TIMEOUT_S = 600.0  # a safety net only: the sender has a chunk's batches to send


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
    parser.add_argument("--seed", type=seed_int, default=0)
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="thread",
                        help="thread: the serving thread's CPU time (default; steady on a shared machine, and the "
                             "publisher thread's work is counted beside it); wall: perf_counter")
    parser.add_argument("--replay-batches", type=bounded_int(1, MAX_HWM), default=1000,
                        help="batches the publisher keeps for replay (default 1000)")


def _pct(ratio: float) -> float:
    return round(100 * (ratio - 1), 2)


def run(args: argparse.Namespace) -> dict:
    n, repeats = args.requests, args.repeats
    clock_name = getattr(args, "clock", "thread")
    pc = CLOCKS[clock_name]
    tree_nodes = args.tree_nodes if args.tree_nodes is not None else 10 * n
    capacity = check_sizes(n, repeats, tree_nodes, caches=len(VARIANTS))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    kept = PendingLog()
    publisher = ZmqEventPublisher(buffer_steps=getattr(args, "replay_batches", 1000))
    chunk = min(CHUNK, n)
    timed = {v: [] for v in VARIANTS}  # per chunk: seconds of the serving thread's timed part
    beside = {v: [] for v in VARIANTS}  # per chunk: CPU seconds spent on events outside it
    sent_in_chunks = 0  # ZMQ batches the sender sent while a chunk ran (it gives way while the cache steps)
    backlog = 0
    try:
        caches = {v: make_cache(capacity) for v in VARIANTS}
        for cache in caches.values():
            fill(cache, tree_nodes)
        hooks = {"off": None, "inprocess": enable_kv_events(caches["inprocess"], kept.publish),
                 "zmq": enable_kv_events(caches["zmq"], publisher.publish)}
        snapshot_events = hooks["inprocess"].events  # the filled tree, published when events were enabled
        kept.drain()
        _settle(publisher)
        prompts = system_prompts(args.seed)
        for r in range(repeats):
            requests = make_requests(n, args.seed + 7919 * r, prompts)
            for start in range(0, n - chunk + 1, chunk):
                spent = dict.fromkeys(VARIANTS, 0.0)
                sent0 = publisher.sent
                gc.collect()
                gc.disable()  # as timeit does: a collection pass landing in one variant's request is noise
                process0, thread0 = time.process_time(), time.thread_time()
                try:
                    for i, tokens in enumerate(requests[start : start + chunk]):
                        for k in range(3):  # the order rotates per request
                            v = VARIANTS[(i + k) % 3]
                            hook = hooks[v]
                            spent[v] += serve_one(caches[v], tokens, pc, None if hook is None else hook.flush)
                finally:
                    gc.enable()
                sent_in_chunks += publisher.sent - sent0
                backlog = max(backlog, publisher.next_seq - publisher.sent - publisher.dropped)
                thread1 = time.thread_time()
                kept.drain()  # the in-process rendering, on the serving thread
                thread2 = time.thread_time()
                _settle(publisher)  # sleeps until the sender has sent this chunk's batches
                others = (time.process_time() - process0) - (time.thread_time() - thread0)
                for v in VARIANTS:
                    timed[v].append(spent[v])
                beside["off"].append(0.0)
                beside["inprocess"].append(thread2 - thread1)
                beside["zmq"].append(others)  # every other thread of the process works for the publisher
        events = hooks["inprocess"].events - snapshot_events
    finally:
        publisher.close()
        torch.set_num_threads(threads)
    return _report(args, clock_name, chunk, timed, beside, events, publisher, sent_in_chunks, backlog, tree_nodes)


def _settle(publisher: ZmqEventPublisher) -> None:
    if not publisher.wait_sent(SETTLE_TIMEOUT_S):
        raise RuntimeError(f"the ZMQ publisher did not send its batches within {SETTLE_TIMEOUT_S} s")


def _report(args, clock_name: str, chunk: int, timed: dict, beside: dict, events: int,
            publisher: ZmqEventPublisher, sent_in_chunks: int, backlog: int, tree_nodes: int) -> dict:
    n, repeats = args.requests, args.repeats
    served = len(timed["off"]) * chunk
    us = {v: min(timed[v]) / chunk * 1e6 for v in VARIANTS}  # best chunk
    thread_clock = clock_name == "thread"
    result = {
        "benchmark": "events",
        "requests": n,
        "repeats": repeats,
        "tree_nodes": tree_nodes,
        "request_tokens": REQUEST_TOKENS,
        "page_size": PAGE_SIZE,
        "clock": clock_name,
        "timed": "bench controller's match_prefix + insert + 2 x poll (+ flush with events on), each request on the "
                 f"three caches in turn; chunks of {chunk}",
        "target_pct": TARGET_PCT,
        "off_us_per_request": round(us["off"], 2),
    }
    for v in VARIANTS[1:]:
        chunk_ratios = [a / b for a, b in zip(timed[v], timed["off"])]
        process = [(a + s) / b for a, s, b in zip(timed[v], beside[v], timed["off"])]
        result[f"{v}_us_per_request"] = round(us[v], 2)
        result[f"{v}_serving_best_chunk_pct"] = _pct(us[v] / us["off"])
        result[f"{v}_serving_median_chunk_pct"] = _pct(statistics.median(chunk_ratios))
        result[f"{v}_beside_cpu_us_per_request"] = round(sum(beside[v]) / served * 1e6, 2)
        result[f"{v}_process_cpu_median_chunk_pct"] = _pct(statistics.median(process)) if thread_clock else None
        result[f"{v}_process_cpu_pct"] = (_pct((sum(timed[v]) + sum(beside[v])) / sum(timed["off"]))
                                          if thread_clock else None)
    result.update({
        "zmq_sent_during_chunks_pct": round(100 * sent_in_chunks / max(1, publisher.next_seq), 2),
        "zmq_backlog_batches": backlog,
        "events_per_request": round(events / max(1, served), 2),
        "zmq_dropped": publisher.dropped,
        "machine": machine_description(),
    })
    report("KV events: controller time per request, events off vs on", _rows(result, clock_name, chunk, tree_nodes),
           result, getattr(args, "json", False))
    return result


def _rows(result: dict, clock_name: str, chunk: int, tree_nodes: int) -> list[tuple[str, str]]:
    clock = "serving thread's CPU" if clock_name == "thread" else "wall"
    rows = [
        ("requests", f"{result['repeats']} x {result['requests']} x {REQUEST_TOKENS} tokens, page {PAGE_SIZE}, "
                     f"{tree_nodes} nodes already cached"),
        (f"serving thread ({clock})", f"us/request (best chunk); against events off: best chunk, median chunk "
                                      f"(target {TARGET_PCT:.0f}%)"),
        ("  events off", f"{result['off_us_per_request']:.1f}"),
    ]
    for v, name in (("inprocess", "in-process sink"), ("zmq", "ZMQ publisher")):
        rows.append((f"  events on, {name}", f"{result[f'{v}_us_per_request']:.1f}: "
                                             f"{result[f'{v}_serving_best_chunk_pct']:+.1f}%, "
                                             f"{result[f'{v}_serving_median_chunk_pct']:+.1f}%"))
    rows += [
        ("rendering and sending events, beside the timed part", "CPU us/request"),
        ("  in-process sink (rendered by the serving thread)", f"{result['inprocess_beside_cpu_us_per_request']:.1f}"),
        ("  ZMQ publisher (its sender and I/O threads)", f"{result['zmq_beside_cpu_us_per_request']:.1f}"),
    ]
    if clock_name == "thread":
        rows.append(("whole process CPU, against events off", "median chunk, whole run"))
        for v, name in (("inprocess", "in-process sink"), ("zmq", "ZMQ publisher")):
            rows.append((f"  events on, {name}", f"{result[f'{v}_process_cpu_median_chunk_pct']:+.1f}%, "
                                                 f"{result[f'{v}_process_cpu_pct']:+.1f}%"))
    rows += [
        ("ZMQ batches sent while a chunk ran", f"{result['zmq_sent_during_chunks_pct']:.1f}%"),
        ("ZMQ batches unsent at a chunk's end (most)", f"{result['zmq_backlog_batches']} of {chunk}"),
        ("events per request", f"{result['events_per_request']}"),
    ]
    return rows
