"""Run a multi-turn chat workload (or replay a trace) through the cache tiers and compare them."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

import torch

from hicache_fsm.commands.args import (Given, UsageError, bounded_int, int_arg, output_path, path_arg, positive_int,
                                      seed_int, storage_url)
from hicache_fsm.commands import simulate_trace
from hicache_fsm.commands.plot_file import check_plot_path, save_plot
from hicache_fsm.commands.table import columns
from hicache_fsm.errors import HiCacheError, MissingExtra
from hicache_fsm.pools import LAYOUTS
from hicache_fsm.simulate import (
    ARRIVALS,
    DEVICE,
    DEVICE_HOST,
    FULL,
    INFINITE,
    MODELS,
    Options,
    Progress,
    Simulation,
    TierResult,
    Workload,
    hit_rate_sweep,
)
from hicache_fsm.simulate_config import MAX_MODEL_HEADS

_DEFAULTS = Options()
_W = _DEFAULTS.workload
MAX_THREADS = 256  # torch intra-op threads; more than the cores only adds barriers


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Serve a multi-turn chat workload (SGLang multi-turn benchmark shape) with a deterministic "
        "model through four cache configurations in one run: device only, device + host, "
        "device + host + storage, and an infinite cache as the bound. Every KV page the cache serves is "
        "checked bit for bit and every answer against a cache-free run. With --trace, a production trace "
        "(Mooncake format) is replayed instead, without a model.")
    w = parser.add_argument_group("workload")
    w.add_argument("--clients", action=Given, type=int_arg, default=_W.clients,
                   help=f"conversations (default {_W.clients})")
    w.add_argument("--rounds", action=Given, type=int_arg, default=_W.rounds,
                   help=f"turns per conversation (default {_W.rounds})")
    w.add_argument("--request-length", action=Given, type=int_arg, default=_W.request_length,
                   help=f"tokens of each new user turn (default {_W.request_length})")
    w.add_argument("--output-length", action=Given, type=int_arg, default=_W.output_length,
                   help=f"greedy answer tokens per request (default {_W.output_length})")
    w.add_argument("--system-prompt-length", action=Given, type=int_arg, default=_W.system_prompt_length,
                   help=f"tokens of the system prompt every client shares (default {_W.system_prompt_length})")
    w.add_argument("--arrival", action=Given, choices=ARRIVALS, default=_W.arrival,
                   help="round-robin: every client's round r before any round r+1; random: a random client "
                        "with turns left each time (default round-robin)")
    w.add_argument("--seed", action=Given, type=seed_int, default=_W.seed,
                   help="seeds the model weights and the tokens (a 64-bit integer; default 0)")
    w.add_argument("--model", action=Given, choices=MODELS, default=_DEFAULTS.model,
                   help="tiny: the hand-written TinyModel (fastest); llama: a Hugging Face LlamaForCausalLM with "
                        "grouped-query attention and rotary positions, random weights, float64 (needs the "
                        "`llama` extra: transformers) (default tiny)")
    c = parser.add_argument_group("cache")
    c.add_argument("--device-tokens", type=int_arg, default=None,
                   help=f"device (L1) pool size in tokens (default {_DEFAULTS.device_tokens}; "
                        f"with --trace {simulate_trace.DEFAULT_SIZES[0]})")
    c.add_argument("--host-tokens", type=int_arg, default=None,
                   help=f"host (L2) pool size in tokens (default {_DEFAULTS.host_tokens}; "
                        f"with --trace {simulate_trace.DEFAULT_SIZES[1]})")
    c.add_argument("--storage-url", default=None, type=storage_url,
                   help="L3 storage URL (file:///DIR, redis://HOST:PORT/DB, memory://); "
                        "default: a file:// directory in a temporary directory, removed afterwards "
                        "(with --trace: memory://)")
    c.add_argument("--no-storage", action="store_true", help="leave out the device + host + storage configuration")
    c.add_argument("--page-size", type=int_arg, default=_DEFAULTS.page_size,
                   help=f"tokens per page (default {_DEFAULTS.page_size})")
    c.add_argument("--layout", choices=LAYOUTS, default=_DEFAULTS.layout,
                   help=f"host pool layout (default {_DEFAULTS.layout})")
    c.add_argument("--device", default=None,
                   help="torch device of the model and device pool (default: cuda if present)")
    c.add_argument("--tp", action=Given, type=positive_int, default=1,
                   help="tensor-parallel ranks: run every configuration on this many processes (gloo over "
                        "127.0.0.1), each caching its shard of the KV heads; the ranks must agree (default 1)")
    c.add_argument("--model-heads", action=Given, type=bounded_int(1, MAX_MODEL_HEADS),
                   default=_DEFAULTS.model_heads,
                   help=f"attention heads of the tiny model, at most {MAX_MODEL_HEADS}; --tp must divide it "
                        f"(default {_DEFAULTS.model_heads})")
    simulate_trace.configure(parser)
    o = parser.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print only one JSON object on stdout (hit_rate, hit_rate_bound, ...); the table goes to stderr")
    o.add_argument("--plot", metavar="FILE.png", type=path_arg,
                   help="also draw hit rate against device and host capacity (with --trace: device-only hit rate against "
                        "capacity); needs the `plot` extra: matplotlib")
    o.add_argument("--threads", type=bounded_int(1, MAX_THREADS), default=1,
                   help=f"torch CPU threads, at most {MAX_THREADS} (default 1: the tiny model is latency-bound)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    o.add_argument("--record", metavar="FILE.jsonl", type=output_path,
                   help="record one configuration's cache events as a JSONL trace (`hicache-fsm replay` checks it, "
                        "`hicache-fsm diagram residency --counts FILE` draws its heat map); the chat workload "
                        "with --tp 1 only (not with --trace)")
    o.add_argument("--record-tier", choices=(DEVICE, DEVICE_HOST, FULL, INFINITE), default=None,
                   help="the configuration --record records (default: device+host+storage, "
                        "or device+host with --no-storage); needs --record")


class Recording:
    """``--record``: a trace of one configuration's cache, and the residency transitions its machine fired.

    The tally comes from a listener on the cache's compiled residency machine,
    not from the trace, so the two can be checked against each other.
    """

    def __init__(self, path: str, tier: str) -> None:
        self.path = path
        self.tier = tier
        self.recorder = None
        self.fired: Counter[str] = Counter()

    def observe(self, tier: str, cache) -> None:
        if tier != self.tier:
            return
        from hicache_fsm.testing.trace import TraceRecorder

        self.recorder = TraceRecorder(cache, self.path, meta={"recorded_by": "simulate", "tier": tier})
        cache.residency.add_listener(self._count)

    def _count(self, obj, transition) -> None:
        self.fired[f"{transition.source} --{transition.trigger}--> {transition.dest}"] += 1

    def close(self) -> None:
        if self.recorder is not None:
            self.recorder.close()

    def summary(self) -> str:
        if self.recorder is None:
            return f"nothing recorded: configuration {self.tier} did not run"
        return (f"trace of {self.tier} written to {self.path}: {len(self.recorder.events)} events, "
                f"{sum(self.fired.values())} residency transitions")

    def as_dict(self) -> dict:
        return {"tier": self.tier, "trace": self.path,
                "events": len(self.recorder.events) if self.recorder is not None else 0,
                "transitions": {"residency": dict(sorted(self.fired.items()))}}


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


_SPLIT = (  # TierResult.controller_split_us's parts, as the table names them
    ("loop", "match+insert"),
    ("poll", "poll"),
    ("alloc", "alloc_device (evicts)"),
    ("locks", "lock+unlock"),
    ("loads", "load_back+wait"),
    ("prefetch", "prefetch calls"),
    ("token_checks", "token ids (packed once)"),
)


def format_table(sim: Simulation) -> str:
    """One column per configuration, one row per figure."""
    tiers = sim.tiers

    def cap(t: TierResult) -> str:
        if t.name == INFINITE:
            return "unbounded"
        host = "-" if t.name == "device" else str(t.host_tokens)
        return f"{t.device_tokens}/{host}" + ("/L3" if t.storage_url else "")

    def pct(x: float) -> str:
        return f"{100 * x:.1f}%"

    per_rank = f" (per rank, of {sim.tp})" if sim.tp > 1 else ""  # each rank moves only its heads' bytes

    rows: list[tuple[str, list[str]]] = [
        ("capacity device/host(/L3)", [cap(t) for t in tiers]),
        ("token hit rate", [pct(t.hit_rate) for t in tiers]),
        ("  from device", [pct(t.rate(t.device_hit_tokens)) for t in tiers]),
        ("  from host", [pct(t.rate(t.host_hit_tokens)) for t in tiers]),
        ("  from storage", [pct(t.rate(t.storage_hit_tokens)) for t in tiers]),
        ("prefill tokens reused", [str(t.reused_tokens) for t in tiers]),
        ("prefill tokens computed", [str(t.computed_tokens) for t in tiers]),
        ("prefill work (counted)", [f"{t.prefill_flops / 1e9:.2f} GFLOP" for t in tiers]),
        ("model prefill time", [f"{t.prefill_s:.2f} s" for t in tiers]),
        ("time to first token mean", [f"{t.ttft_ms():.1f} ms" for t in tiers]),
        ("time to first token p90", [f"{t.ttft_ms(0.9):.1f} ms" for t in tiers]),
        (f"bytes device->host{per_rank}", [_mb(t.bytes.get("d2h", 0)) for t in tiers]),
        (f"bytes host->device{per_rank}", [_mb(t.bytes.get("h2d", 0)) for t in tiers]),
        (f"bytes host->storage{per_rank}", [_mb(t.bytes["h2s"]) if "h2s" in t.bytes else "-" for t in tiers]),
        (f"bytes storage->host{per_rank}", [_mb(t.bytes["s2h"]) if "s2h" in t.bytes else "-" for t in tiers]),
        ("controller us/request", [f"{t.controller_us_per_request:.0f}" for t in tiers]),
        *[(f"  {label}", [f"{t.controller_split_us()[part]:.0f}" for t in tiers]) for part, label in _SPLIT],
        ("KV copies us/request", [f"{t.per_request_us(t.transfer_s):.0f}" for t in tiers]),
        ("transfer time (executor)", [f"{t.transfer_s * 1e3:.1f} ms" for t in tiers]),
        ("prefetch wait (storage I/O)", [f"{t.prefetch_wait_s * 1e3:.1f} ms" if t.storage_url else "-" for t in tiers]),
        ("model time prefill+decode", [f"{t.prefill_s:.2f}+{t.decode_s:.2f} s" for t in tiers]),
        ("KV pages checked", [str(t.kv_checked_pages) for t in tiers]),
        ("KV mismatches", [str(t.kv_mismatches) for t in tiers]),
        ("answer tokens != cache-free", [str(t.output_mismatches) for t in tiers]),
    ]
    return columns([t.name for t in tiers], rows)


def summary(sim: Simulation) -> str:
    w = sim.workload
    full = sim.hierarchy
    bound = sim.tier(INFINITE)
    dev = sim.tier("device")
    out = [
        f"workload: {w.clients} clients x {w.rounds} rounds, system prompt {w.system_prompt_length}, "
        f"turn {w.request_length}, answer {w.output_length} tokens, {w.arrival} arrival, "
        f"page {sim.page_size}, host layout {sim.layout}, model {sim.model_name} on {sim.device}",
    ]
    if bound is not None and bound.hit_rate:
        line = (f"{full.name}: hit rate {100 * full.hit_rate:.1f}% = "
                f"{100 * full.hit_rate / bound.hit_rate:.1f}% of the infinite bound ({100 * bound.hit_rate:.1f}%)")
        if dev is not None:
            line += f"; device only {100 * dev.hit_rate:.1f}%"
        out.append(line)
    saved = sim.prefill_saved()
    if saved is not None and dev is not None:
        out.append(f"prefill: {full.name} computed {full.computed_tokens} prompt tokens against {dev.computed_tokens} "
                   f"on device only: {100 * saved['tokens']:.0f}% fewer tokens, {100 * saved['flops']:.0f}% less "
                   f"counted work (attention to the reused past remains), {100 * saved['seconds']:.0f}% less prefill "
                   f"time ({full.prefill_s:.2f} s vs {dev.prefill_s:.2f} s); time to first token "
                   f"{full.ttft_ms():.1f} ms vs {dev.ttft_ms():.1f} ms mean")
    split = full.controller_split_us()
    out.append(
        f"controller {full.controller_us_per_request:.0f} us/request ({full.name}): match+insert "
        f"{split['loop']:.0f} and poll {split['poll']:.0f} (the loop `bench controller` times, there on "
        f"4096-token requests, page 64, no copies, a poll that only applies acks; here poll starts the "
        f"backups), alloc_device {split['alloc']:.0f}, locks {split['locks']:.0f}, loads {split['loads']:.0f}, "
        f"prefetch {split['prefetch']:.0f}, token ids checked and packed once {split['token_checks']:.0f}. "
        f"Not in it: KV copies {full.per_request_us(full.transfer_s):.0f} us, model "
        f"{full.per_request_us(full.model_s) / 1e3:.1f} ms per request")
    ok = sim.kv_mismatches == 0 and sim.output_mismatches == 0
    out.append(f"KV served: {sum(t.kv_checked_pages for t in sim.tiers)} pages checked, "
               f"{sim.kv_mismatches} mismatches; answers differing from the cache-free run: "
               f"{sim.output_mismatches} tokens -> {'OK' if ok else 'MISMATCH'}")
    if sim.tp > 1:
        out.append(f"tensor parallelism: {sim.tp} ranks, trees compared after every request: "
                   f"{'identical' if sim.ranks_agree else 'DIFFERENT'}")
        for r, tiers in enumerate(sim.rank_tiers):
            cells = ", ".join(f"{t.name} {100 * t.hit_rate:.1f}% / {t.controller_us_per_request:.0f} us "
                              f"({t.agreement_s / max(1, t.requests) * 1e6:.0f} agreeing)" for t in tiers)
            out.append(f"  rank {r}: hit rate / controller us per request: {cells}")
    if sim.storage_skipped:
        out.append(f"storage configuration skipped: {sim.storage_skipped}")
    out.append(f"wall time {sim.wall_s:.1f} s (cache-free reference {sim.reference_s:.1f} s)")
    return "\n".join(out)


def plot(sim: Simulation, options: Options, path: str) -> None:
    """Hit rate against device capacity (one line per host size) and against host capacity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    storage_url = "memory://" if sim.tier(FULL) is not None else None
    sweep = hit_rate_sweep(options, sim.reference, storage_url)
    bound = sim.tier(INFINITE)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    panels = (
        (axes[0], sweep["by_device"], "device capacity (tokens)", options.device_tokens),
        (axes[1], sweep["by_host"], "host capacity (tokens)", options.host_tokens),
    )
    for ax, series, xlabel, chosen in panels:
        for label, pts in series.items():
            ax.plot([x for x, _ in pts], [100 * r for _, r in pts], marker="o", markersize=4, label=label)
        if bound is not None:
            ax.axhline(100 * bound.hit_rate, color="gray", linestyle="--", label="infinite cache (bound)")
        ax.axvline(chosen, color="lightgray", linestyle=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    axes[0].set_ylabel("token hit rate (%)")
    axes[0].set_ylim(0, 100)
    w = options.workload
    fig.suptitle(f"{w.clients} clients x {w.rounds} rounds ({w.arrival}), system prompt {w.system_prompt_length}, "
                 f"turn {w.request_length}, answer {w.output_length}, page {options.page_size}", fontsize=10)
    fig.tight_layout()
    save_plot(fig, path)
    plt.close(fig)
    if sweep["skipped"]:
        print(f"plot: left out {len(sweep['skipped'])} capacities whose host pool is not larger than "
              f"the device pool (e.g. {sweep['skipped'][0].split(':')[0]})", file=sys.stderr)


def check_record(args: argparse.Namespace) -> None:
    """Refuse a ``--record``/``--record-tier`` that would record nothing: exit 0 and no file would look like success.

    Likewise a ``--storage-url`` that ``--no-storage`` leaves unused.
    """
    if args.storage_url is not None and args.no_storage:
        raise UsageError("--storage-url names the L3 of a configuration --no-storage leaves out")
    if args.record is None:
        if args.record_tier is not None:
            raise UsageError("--record-tier needs --record FILE.jsonl")
        return
    if args.trace is not None:
        raise UsageError("--record records the chat workload's cache; a --trace replay cannot record")
    if args.tp > 1:
        raise UsageError(f"--record needs --tp 1: with --tp {args.tp} every cache lives in a rank process")
    if args.record_tier == FULL and args.no_storage:
        raise UsageError(f"--record-tier {FULL} does not run with --no-storage")


def run(args: argparse.Namespace) -> int:
    check_record(args)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:  # like --model llama without transformers: cli.main prints it, exit 1
            raise MissingExtra("--plot", "matplotlib", "plot") from None
        check_plot_path(args.plot)
    torch.set_num_threads(args.threads)
    if args.trace is not None:
        return simulate_trace.run(args)
    trace_only = simulate_trace.trace_only_options(args)
    if trace_only:
        raise UsageError(f"{', '.join(trace_only)} {'needs' if len(trace_only) == 1 else 'need'} --trace")
    device_tokens = _DEFAULTS.device_tokens if args.device_tokens is None else args.device_tokens
    host_tokens = _DEFAULTS.host_tokens if args.host_tokens is None else args.host_tokens
    try:
        workload = Workload(args.clients, args.rounds, args.request_length, args.output_length,
                            args.system_prompt_length, args.arrival, args.seed)
        options = Options(workload, device_tokens, host_tokens, args.storage_url, not args.no_storage,
                          args.page_size, args.layout, args.device, model=args.model,
                          model_heads=args.model_heads, tp=args.tp)
    except HiCacheError as exc:  # an impossible configuration is a usage error
        raise UsageError(str(exc)) from None
    from hicache_fsm.simulate import run_simulation

    progress = Progress(0, sys.stderr, enabled=False if args.no_progress else None)
    tier = args.record_tier or (FULL if options.storage else DEVICE_HOST)
    recording = Recording(args.record, tier) if args.record else None
    try:  # a runtime HiCacheError: cli.main prints it, exit 1
        sim = run_simulation(options, progress, observe=recording.observe if recording else None)
    finally:
        if recording is not None:
            recording.close()
    out = sys.stderr if args.json else sys.stdout  # with --json, stdout holds only the JSON object
    print(format_table(sim), file=out)
    print(file=out)
    print(summary(sim), file=out)
    if args.plot:
        plot(sim, options, args.plot)
        print(f"plot written to {args.plot}", file=out)
    if recording is not None:
        print(recording.summary(), file=out)
    if args.json:
        report = sim.as_dict()
        if recording is not None:
            report["recorded"] = recording.as_dict()
        print(json.dumps(report, sort_keys=True))
    return 0 if sim.kv_mismatches == 0 and sim.output_mismatches == 0 and sim.ranks_agree else 1

