"""``hicache-fsm simulate --trace FILE.jsonl``: replay a production trace through the cache configurations."""

from __future__ import annotations

import argparse
import json
import sys

from hicache_fsm.commands import simulate_cluster
from hicache_fsm.commands.args import Given, UsageError, int_arg, path_arg, printable, was_given
from hicache_fsm.commands.plot_file import save_plot
from hicache_fsm.commands.table import columns
from hicache_fsm.errors import ConfigError, HiCacheError, TraceError
from hicache_fsm.simulate import INFINITE, TierResult
from hicache_fsm.trace import DEFAULT_BLOCK_SIZE, PrefixBound, check_tokens, load_trace, prefix_bound
from hicache_fsm.trace_replay import (
    ReplayProgress,
    TraceOptions,
    TraceSimulation,
    sweep_capacities,
)
from hicache_fsm.trace_workers import in_workers, usable_cores

# Default pool sizes follow the trace, so that every configuration shows what it adds: the device
# holds 1/32 of what an infinite cache would (at least the longest input), the host four times that.
DEVICE_SHARE = 32
HOST_PER_DEVICE = 4
DEFAULT_SIZES = (f"1/{DEVICE_SHARE} of the trace's distinct cacheable tokens, at least its longest input",
                 f"{HOST_PER_DEVICE}x the device pool")


def default_sizes(trace, page_size: int, device_tokens: int | None, host_tokens: int | None,
                  bound: PrefixBound | None = None) -> tuple[int, int]:
    """Device and host pool sizes: those given, else sized to the trace (``DEFAULT_SIZES``), in whole pages.

    ``bound``: the trace's ``prefix_bound`` at ``page_size`` when the caller has it (else computed here).
    """
    def pages(x: int) -> int:
        return max(page_size, -(-x // page_size) * page_size)

    if device_tokens is None:
        unique = (bound or prefix_bound(trace, page_size)).unique_tokens
        device_tokens = pages(max(unique // DEVICE_SHARE, trace.max_input_length))
    if host_tokens is None:
        host_tokens = HOST_PER_DEVICE * device_tokens
    return device_tokens, host_tokens


# a worker process pays seconds of start-up (imports): worth it only when each configuration replays longer
PARALLEL_FROM_REQUESTS = 2000
MAX_SWEEP_SIZES = 64  # each size is one more replay of the whole trace
_WORKLOAD_OPTIONS = ("clients", "rounds", "request_length", "output_length", "system_prompt_length", "arrival", "seed")


def configure(parser: argparse.ArgumentParser) -> None:
    t = parser.add_argument_group("trace replay (metadata mode: no model, one KV element per token)")
    t.add_argument("--trace", metavar="FILE.jsonl", type=path_arg,
                   help="replay this Mooncake-format trace instead of the chat workload (see docs/traces.md)")
    t.add_argument("--block-size", action=Given, type=int_arg, default=DEFAULT_BLOCK_SIZE,
                   help=f"tokens per hash id of the trace (default {DEFAULT_BLOCK_SIZE})")
    t.add_argument("--sweep", nargs="?", const="auto", metavar="N,N,...",
                   help="also replay device-only caches of these sizes in tokens (bare: ten sizes from the longest "
                        "input to everything the trace caches, log-spaced); the JSON gets a 'sweep' entry; with "
                        "--instances: instance counts (bare: 1,2,4,8), each with every router policy")
    t.add_argument("--jobs", type=_jobs, default=None, metavar="N",
                   help="replay the configurations (and --sweep's sizes) in up to N worker processes, one each (default: "
                        f"the cores this process may use for a trace of {PARALLEL_FROM_REQUESTS}+ requests, else 1: "
                        "all in this process); the figures are the same")
    simulate_cluster.configure(parser)  # cluster replay: --instances, --router, ...


def _jobs(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants a positive number of processes, got {text!r}") from None
    if not 1 <= value <= 256:
        raise argparse.ArgumentTypeError(f"wants 1..256 processes, got {value}")
    return value


def _sweep(text: str | None, options: TraceOptions, want_plot: bool, bound: PrefixBound) -> list[int] | None:
    if text is None and not want_plot:
        return None
    if text is None or text == "auto":
        return sweep_capacities(options.trace, options.page_size, bound)
    parts = text.split(",")
    if len(parts) > MAX_SWEEP_SIZES:
        raise ConfigError(f"--sweep takes at most {MAX_SWEEP_SIZES} sizes, got {len(parts)}")
    try:
        sizes = sorted({int(x) for x in parts if x.strip()})
    except ValueError:
        raise ConfigError(f"--sweep wants comma-separated token counts, got {text[:80]!r}") from None
    for size in sizes:
        check_tokens(size, "--sweep size")
    ps = options.page_size
    bad = [s for s in sizes if s < ps or s % ps]
    if not sizes or bad:
        raise ConfigError(f"--sweep sizes must be positive multiples of page size {ps}, got {text!r}")
    return sizes


def trace_only_options(args: argparse.Namespace) -> list[str]:
    """Trace options given without ``--trace`` (they mean nothing to the chat workload)."""
    given = ["--sweep"] if args.sweep is not None else []
    given += ["--jobs"] if args.jobs is not None else []
    given += ["--instances"] if args.instances is not None else []  # cluster replay
    given += simulate_cluster.cluster_only_options(args)
    return given + (["--block-size"] if was_given(args, "block_size") else [])


def _unused_workload_options(args: argparse.Namespace) -> list[str]:
    return [f"--{n.replace('_', '-')}" for n in _WORKLOAD_OPTIONS if was_given(args, n)]


def _unused_model_options(args: argparse.Namespace) -> list[str]:
    """Model and rank options a trace replay would ignore: it runs no model, in one process per configuration."""
    return [f"--{n.replace('_', '-')}" for n in ("model", "model_heads", "tp") if was_given(args, n)]


def format_table(sim: TraceSimulation) -> str:
    """One column per configuration, one row per figure."""
    tiers = sim.tiers

    def cap(t: TierResult) -> str:
        if t.name == INFINITE:
            return f"{t.device_tokens} (all)"
        host = "-" if t.name == "device" else str(t.host_tokens)
        return f"{t.device_tokens}/{host}" + ("/L3" if t.storage_url else "")

    def pct(x: float) -> str:
        return f"{100 * x:.1f}%"

    def mb(t: TierResult, kind: str) -> str:
        return f"{t.bytes[kind] / 1e6:.2f} MB" if kind in t.bytes else "-"

    rows: list[tuple[str, list[str]]] = [
        ("capacity device/host(/L3)", [cap(t) for t in tiers]),
        ("token hit rate", [pct(t.hit_rate) for t in tiers]),
        ("  from device", [pct(t.rate(t.device_hit_tokens)) for t in tiers]),
        ("  from host", [pct(t.rate(t.host_hit_tokens)) for t in tiers]),
        ("  from storage", [pct(t.rate(t.storage_hit_tokens)) for t in tiers]),
        ("prefill tokens saved", [str(t.hit_tokens) for t in tiers]),
        ("prefill tokens computed", [str(t.computed_tokens) for t in tiers]),
        ("bytes device->host", [mb(t, "d2h") for t in tiers]),
        ("bytes host->device", [mb(t, "h2d") for t in tiers]),
        ("bytes host->storage", [mb(t, "h2s") for t in tiers]),
        ("bytes storage->host", [mb(t, "s2h") for t in tiers]),
        ("controller us/request", [f"{t.controller_us_per_request:.0f}" for t in tiers]),
        ("transfer time (executor)", [f"{t.transfer_s * 1e3:.1f} ms" for t in tiers]),
        ("TTFT mean / p90 (simulated)", [_ttft(sim, t.name) for t in tiers]),
        ("requests not cached (no room)", [str(t.alloc_failures) for t in tiers]),
        ("wall time", [f"{t.wall_s:.1f} s" for t in tiers]),
    ]
    return columns([t.name for t in tiers], rows)


def _ttft(sim: TraceSimulation, name: str) -> str:
    lat = sim.latency.get(name)
    if lat is None:
        return "-"
    d = lat.as_dict()
    return f"{d['ttft_mean_s'] * 1e3:.1f} / {d['ttft_p90_s'] * 1e3:.1f} ms"


def bound_matches(sim: TraceSimulation) -> bool:
    """The replayed infinite cache hits exactly what the hash ids say it must."""
    infinite = sim.tier(INFINITE)
    return infinite is not None and infinite.hit_tokens == sim.bound.hit_tokens


def summary(sim: TraceSimulation) -> str:
    s = sim.trace.summary()
    full, bound = sim.hierarchy, sim.tier(INFINITE)
    out = [f"trace {printable(s['path'])}: {s['requests']} requests, mean input {s['mean_input_length']:.0f} tokens "
           f"(max {s['max_input_length']}), block {s['block_size']}, page {sim.page_size}, "
           f"{sim.bound.unique_tokens} distinct cacheable tokens, pools on {sim.device}"]
    if bound is not None and bound.hit_rate:
        out.append(f"{full.name}: hit rate {100 * full.hit_rate:.1f}% = "
                   f"{100 * full.hit_rate / bound.hit_rate:.1f}% of the infinite bound ({100 * bound.hit_rate:.1f}%)")
    verdict = "OK" if bound_matches(sim) else "MISMATCH"
    out.append(f"infinite cache hit {bound.hit_tokens if bound else '-'} tokens; from the hash ids alone: "
               f"{sim.bound.hit_tokens} -> {verdict}")
    saved = sim.prefill_saved_vs_device()
    if saved is not None:
        out.append(f"{full.name} computed {100 * saved:.1f}% fewer prefill tokens than device only "
                   f"(TTFT on the simulated clock: {sim.costs.describe()})")
    if sim.sweep:
        out.append("device-only sweep: " + ", ".join(f"{c}: {100 * r:.1f}%" for c, r in sim.sweep))
    if sim.storage_skipped:
        out.append(f"storage configuration skipped: {sim.storage_skipped}")
    out.append(f"wall time {sim.wall_s:.1f} s")
    return "\n".join(out)


def plot(sim: TraceSimulation, path: str) -> None:
    """Hit rate of a device-only cache against its capacity (log axis), with the infinite bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    pts = sim.sweep or []
    ax.plot([c for c, _ in pts], [100 * r for _, r in pts], marker="o", markersize=4, label="device only (LRU)")
    for color, t in zip(("tab:orange", "tab:green"), [t for t in sim.tiers if t.name not in ("device", INFINITE)]):
        ax.axhline(100 * t.hit_rate, color=color, linestyle=":", linewidth=1.2,
                   label=f"{t.name} at device {t.device_tokens}, host {t.host_tokens}")
    device = sim.tier("device")
    if device is not None:
        ax.axvline(device.device_tokens, color="lightgray", linestyle=":")
    ax.axhline(100 * sim.bound.hit_rate, color="gray", linestyle="--", label="infinite cache (bound)")
    ax.set_xscale("log")
    ax.set_xlabel("device capacity (tokens)")
    ax.set_ylabel("token hit rate (%)")
    ax.set_ylim(0, 100)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    s = sim.trace.summary()
    ax.set_title(f"{printable(s['path'].rsplit('/', 1)[-1])}: {s['requests']} requests, mean input "
                 f"{s['mean_input_length']:.0f} tokens, block {s['block_size']}, page {sim.page_size}", fontsize=9)
    fig.tight_layout()
    save_plot(fig, path)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """The ``--trace`` branch of ``simulate`` (called after its generic checks)."""
    prog = "hicache-fsm simulate"
    unused = _unused_workload_options(args)
    if unused:
        raise UsageError(f"{', '.join(unused)} {'describes' if len(unused) == 1 else 'describe'} the chat workload; "
                         "a trace brings its own requests")
    unused = _unused_model_options(args)
    if unused:
        raise UsageError(f"{', '.join(unused)} {'needs' if len(unused) == 1 else 'need'} the chat workload; a trace "
                         "replays in metadata mode (no model, no rank processes)")
    if args.instances is not None and args.jobs is not None:
        raise UsageError("--jobs runs trace configurations in worker processes; a cluster replay (--instances) "
                         "runs in this one")
    # cluster replay (hicache_fsm.cluster_replay): its own report
    if args.instances is not None:
        return simulate_cluster.run(
            args, lambda trace: default_sizes(trace, args.page_size, args.device_tokens, args.host_tokens))
    cluster_only = simulate_cluster.cluster_only_options(args)
    if cluster_only:
        raise UsageError(f"{', '.join(cluster_only)} {'needs' if len(cluster_only) == 1 else 'need'} --instances")
    try:
        for flag, tokens in (("--device-tokens", args.device_tokens), ("--host-tokens", args.host_tokens)):
            if isinstance(tokens, int):
                check_tokens(tokens, flag)
        trace = load_trace(args.trace, args.block_size)
        bound = prefix_bound(trace, args.page_size)  # computed once: the pool sizes, the sweep and the check use it
        options = TraceOptions(
            trace,
            *default_sizes(trace, args.page_size, args.device_tokens, args.host_tokens, bound),
            args.storage_url, not args.no_storage, args.page_size, args.layout, args.device)
        sweep = _sweep(args.sweep, options, bool(args.plot), bound)
    except (TraceError, ConfigError) as exc:  # cli.main prints it as a usage error
        raise UsageError(str(exc)) from None
    from hicache_fsm.trace_replay import run_trace

    # progress only to a terminal: a log or a pipe gets the table, not a line every few seconds
    progress = ReplayProgress(stream=sys.stderr, enabled=not args.no_progress and sys.stderr.isatty())
    try:
        jobs = args.jobs if args.jobs is not None else (
            usable_cores() if len(trace.requests) >= PARALLEL_FROM_REQUESTS else 1)
        sim = run_trace(options, progress, sweep, bound, in_workers(jobs) if jobs > 1 else None)
    except HiCacheError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    out = sys.stderr if args.json else sys.stdout  # with --json, stdout holds only the JSON object
    print(format_table(sim), file=out)
    print(file=out)
    print(summary(sim), file=out)
    if args.plot:
        plot(sim, args.plot)
        print(f"plot written to {args.plot}", file=out)
    if args.json:
        print(json.dumps(sim.as_dict(), sort_keys=True))
    return 0 if bound_matches(sim) else 1


__all__ = ["configure", "format_table", "plot", "run", "summary", "trace_only_options"]
