"""What KV events cost the controller: ``bench controller``'s loop with events off and on, same run.

The loop and requests are ``bench controller``'s (4,096-token requests, page
64, write_through, acks without copying, a tree already holding
``--tree-nodes`` prefixes): ``match_prefix``, ``insert``, two ``poll``.
Three caches serve the same requests, their timed chunks alternating:

- ``off``: no listener;
- ``on (in-process)``: :func:`hicache_fsm.events.enable_kv_events` with a
  sink that keeps the hook's pending batches (what the hook costs the serving
  thread: recording each event); after each chunk, untimed, the serving thread
  renders them as structs (page hashes, ``KVEventBatch``);
- ``on (ZMQ)``: the sink is a :class:`ZmqEventPublisher` on 127.0.0.1 (the
  hand-off to its queue; hashing, writing the msgpack bytes and sending run on
  its thread); after each chunk, untimed, the serving thread sleeps until the
  publisher has sent the chunk's batches.

With events on, ``flush`` runs once per request (an engine step) inside the
timed part. The variants' order flips every chunk. Two figures per variant
against ``off``: its best chunk against off's best (``*_overhead_pct``), and
the median over chunks of its time against off's in the same chunk
(``*_paired_overhead_pct``, steadier on a busy machine). ``--clock thread``
(the default) times the serving thread's CPU; ``--clock wall`` its wall time
(where waiting for the GIL held by the publisher's thread shows).

The work that leaves the serving thread is not hidden: for every chunk the
process's CPU beyond the serving thread's (the publisher's sender thread,
libzmq's I/O thread), and for the in-process sink the serving thread's own
rendering, are added up (``*_beside_us_per_request``: mean CPU per request),
and with the thread clock ``*_process_cpu_overhead_pct`` compares the whole
process's CPU per request (the best timed chunk plus that mean) with events
off. ``zmq_backlog_batches``: the most batches still unsent when a chunk
ended (the sender runs when the serving thread lets go of the GIL).
"""

from __future__ import annotations

import argparse
import statistics
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
SETTLE_TIMEOUT_S = 600.0  # a safety net only: the sender has a chunk's batches to send


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
    settle = {"off": lambda: None, "inprocess": kept.drain,
              "zmq": lambda: publisher.wait_sent(SETTLE_TIMEOUT_S) or _unsent(publisher)}
    try:
        caches = {name: make_cache(capacity) for name in ("off", "inprocess", "zmq")}
        for cache in caches.values():
            fill(cache, tree_nodes)
        hooks = {"off": None,
                 "inprocess": enable_kv_events(caches["inprocess"], kept.publish),
                 "zmq": enable_kv_events(caches["zmq"], publisher.publish)}
        snapshot_events = hooks["inprocess"].events  # the filled tree, published when events were enabled
        kept.drain()
        settle["zmq"]()
        prompts = system_prompts(args.seed)
        chunk = min(CHUNK, n)
        best = {name: float("inf") for name in caches}
        ratios: dict[str, list[float]] = {"inprocess": [], "zmq": []}  # per chunk, against off's same chunk
        beside = {name: 0.0 for name in caches}  # CPU seconds spent on events outside the timed part
        backlog = 0
        for r in range(repeats):
            requests = make_requests(n, args.seed + 7919 * r, prompts)
            for start in range(0, n - chunk + 1, chunk):
                part = requests[start : start + chunk]
                order = list(caches) if (start // chunk + r) % 2 == 0 else list(reversed(caches))
                spent = {}
                for name in order:  # alternate which variant goes first
                    process0, thread0 = time.process_time(), time.thread_time()
                    spent[name] = _serve(caches[name], hooks[name], part, clock) / chunk * 1e6
                    best[name] = min(best[name], spent[name])
                    if name == "zmq":
                        backlog = max(backlog, publisher.next_seq - publisher.sent - publisher.dropped)
                    thread1 = time.thread_time()
                    settle[name]()  # render (in-process sink) or wait until the publisher sent this chunk
                    thread2 = time.thread_time()
                    # the publisher's threads (its sender, libzmq's I/O thread), and the serving thread's own settling
                    beside[name] += (time.process_time() - process0) - (thread2 - thread0)
                    if name == "inprocess":
                        beside[name] += thread2 - thread1
                for name, chunk_ratios in ratios.items():
                    chunk_ratios.append(spent[name] / spent["off"])
        served = repeats * (n - n % chunk)
        events = hooks["inprocess"].events - snapshot_events
    finally:
        publisher.close()
        torch.set_num_threads(threads)
    off = best["off"]
    result_clock = getattr(args, "clock", "thread")
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
        "inprocess_paired_overhead_pct": round(100 * (statistics.median(ratios["inprocess"]) - 1), 2),
        "zmq_paired_overhead_pct": round(100 * (statistics.median(ratios["zmq"]) - 1), 2),
        "inprocess_beside_us_per_request": round(beside["inprocess"] / served * 1e6, 2),
        "zmq_beside_us_per_request": round(beside["zmq"] / served * 1e6, 2),
        "inprocess_process_cpu_overhead_pct": _pct_beside(result_clock, best, beside, served, "inprocess"),
        "zmq_process_cpu_overhead_pct": _pct_beside(result_clock, best, beside, served, "zmq"),
        "zmq_backlog_batches": backlog,
        "events_per_request": round(events / max(1, repeats * n), 2),
        "zmq_dropped": publisher.dropped,
        "machine": machine_description(),
    }
    clock_name = "serving thread's CPU" if result["clock"] == "thread" else "wall"
    rows = [
        ("requests", f"{repeats} x {n} x {REQUEST_TOKENS} tokens, page {PAGE_SIZE}, {tree_nodes} nodes already cached"),
        (f"serving thread ({clock_name})", "us/request, against events off"),
        ("  events off", f"{off:.1f}"),
        ("  events on, in-process sink", f"{best['inprocess']:.1f} ({result['inprocess_overhead_pct']:+.1f}%)"),
        ("  events on, ZMQ publisher", f"{best['zmq']:.1f} ({result['zmq_overhead_pct']:+.1f}%)"),
        ("  median of each chunk against off's", f"in-process {result['inprocess_paired_overhead_pct']:+.1f}%, "
                                                 f"ZMQ {result['zmq_paired_overhead_pct']:+.1f}%"),
        ("rendering and sending events, beside the timed part", "CPU us/request"),
        ("  in-process sink (rendered by the serving thread)", f"{result['inprocess_beside_us_per_request']:.1f}"),
        ("  ZMQ publisher (its sender and I/O threads)", f"{result['zmq_beside_us_per_request']:.1f}"),
    ]
    if result_clock == "thread":
        rows += [("whole process CPU, against events off", ""),
                 ("  events on, in-process sink", f"{result['inprocess_process_cpu_overhead_pct']:+.1f}%"),
                 ("  events on, ZMQ publisher", f"{result['zmq_process_cpu_overhead_pct']:+.1f}%")]
    rows += [
        ("ZMQ batches unsent at a chunk's end (most)", f"{backlog} of {chunk}"),
        ("events per request", f"{result['events_per_request']}"),
    ]
    report("KV events: controller time per request, events off vs on", rows, result, getattr(args, "json", False))
    return result


def _pct_beside(clock: str, best: dict, beside: dict, served: int, name: str) -> float | None:
    """The whole process's CPU per request with events on against off: the serving thread's best chunk
    plus the mean CPU spent on events beside it (thread clock only; None when timing wall time)."""
    if clock != "thread":
        return None
    total = {k: best[k] + beside[k] / served * 1e6 for k in ("off", name)}
    return round(100 * (total[name] / total["off"] - 1), 2)


def _unsent(publisher: ZmqEventPublisher) -> None:
    raise RuntimeError(f"the ZMQ publisher did not send its batches within {SETTLE_TIMEOUT_S} s")
