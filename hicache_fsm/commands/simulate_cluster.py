"""``simulate --trace FILE --instances N --router POLICY``: a cluster of caches behind a KV-aware router."""

from __future__ import annotations

import argparse
import json
import sys

from collections.abc import Callable
from typing import TYPE_CHECKING

from hicache_fsm.commands.args import Given, UsageError, int_arg, was_given
from hicache_fsm.commands.plot_file import save_plot
from hicache_fsm.commands.table import columns
from hicache_fsm.errors import ConfigError, HiCacheError, TraceError
from hicache_fsm.router.names import DEFAULT_LOAD_CAP, MAX_INSTANCES, POLICIES
from hicache_fsm.trace import Trace, check_tokens, load_trace

if TYPE_CHECKING:  # the cluster replay needs the events extra: imported when --instances is given
    from hicache_fsm.cluster_replay import ClusterResult

DEFAULT_INSTANCES_SWEEP = (1, 2, 4, 8)
MAX_SWEEP_COUNTS = 16  # each count is one replay of the whole trace per router policy

PROG = "hicache-fsm simulate"


def configure(parser: argparse.ArgumentParser) -> None:
    c = parser.add_argument_group("cluster replay (with --trace; see docs/cluster.md)")
    c.add_argument("--instances", type=int_arg, default=None, metavar="N",
                   help=f"replay the trace on N caches behind a KV-aware router, sharing one L3 (at most "
                        f"{MAX_INSTANCES})")
    c.add_argument("--router", action=Given, choices=POLICIES, default="prefix_aware",
                   help="placement policy with --instances (default prefix_aware)")
    c.add_argument("--load-cap", action=Given, type=float, default=DEFAULT_LOAD_CAP,
                   help=f"prefix_aware_capped: an instance above this multiple of a fair share of recent requests "
                        f"is skipped (default {DEFAULT_LOAD_CAP})")
    c.add_argument("--event-lag", action=Given, type=int_arg, default=0, metavar="K",
                   help="the router applies KV events K requests after they were published (default 0)")


def cluster_only_options(args: argparse.Namespace) -> list[str]:
    """Cluster options given without ``--instances``."""
    return [f"--{n.replace('_', '-')}" for n in ("router", "load_cap", "event_lag") if was_given(args, n)]


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def format_result(res: "ClusterResult") -> str:
    """One column per instance and one for the cluster."""
    def row(label: str, per, total: str) -> tuple[str, list[str]]:
        return label, [per(r) for r in res.results] + [total]

    d = res.as_dict()
    rows = [
        row("requests", lambda r: str(r.requests), str(d["requests"])),
        row("prompt tokens", lambda r: str(r.prompt_tokens), str(d["prompt_tokens"])),
        row("token hit rate", lambda r: _pct(r.hit_rate), _pct(res.hit_rate)),
        row("  from device", lambda r: _pct(r.rate(r.device_hit_tokens)), _pct(d["hit_rate_device"])),
        row("  from host", lambda r: _pct(r.rate(r.host_hit_tokens)), _pct(d["hit_rate_host"])),
        row("  from storage (shared L3)", lambda r: _pct(r.rate(r.storage_hit_tokens)), _pct(d["hit_rate_storage"])),
        row("controller us/request", lambda r: f"{r.controller_us_per_request:.0f}", "-"),
    ]
    table = columns([f"instance {i}" for i in range(res.instances)] + ["cluster"], rows)
    s = d["staleness"]
    lines = [
        table,
        "",
        f"{res.instances} instances, router {res.policy}, "
        + (f"shared L3 {res.storage_url}" if res.storage_url else "no L3"),
        f"requests per instance max/mean {d['requests_per_instance']['max']}/{d['requests_per_instance']['mean']:.1f}, "
        f"tokens per instance max/mean {d['tokens_per_instance']['max']}/{d['tokens_per_instance']['mean']:.0f}",
        f"router view: prediction exact for {100 * s['exact_share']:.1f}% of {s['decisions']} requests, "
        f"mean error {s['mean_abs_error_tokens']:.1f} tokens (over {s['over_predicted_tokens']}, "
        f"under {s['under_predicted_tokens']}), {s['mean_batches_behind']:.2f} batches behind on average",
        f"KV events: {res.events} in {res.batches} batches; index matched the caches in "
        f"{res.index_agreements}/{res.index_checks} checks",
    ]
    return "\n".join(lines)


def format_sweep(results: list["ClusterResult"]) -> str:
    rows = []
    for r in results:
        d = r.as_dict()
        rows.append((f"{r.instances} x {r.policy}", [
            _pct(r.hit_rate), _pct(d["hit_rate_device"]), _pct(d["hit_rate_host"]), _pct(d["hit_rate_storage"]),
            f"{d['requests_per_instance']['max']}/{d['requests_per_instance']['mean']:.1f}",
            f"{100 * d['staleness']['exact_share']:.1f}%", f"{r.index_agreements}/{r.index_checks}"]))
    return columns(["hit", "device", "host", "storage", "req max/mean", "view exact", "index ok"], rows)


def plot_sweep(results: list["ClusterResult"], path: str) -> None:
    """Cluster hit rate (solid) and device hit rate (dashed) against the instance count, one colour per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for colour, policy in zip(("tab:blue", "tab:orange", "tab:green"), POLICIES):
        pts = [r for r in results if r.policy == policy]
        if not pts:
            continue
        xs = [r.instances for r in pts]
        ax.plot(xs, [100 * r.hit_rate for r in pts], marker="o", color=colour, label=f"{policy}: all tiers")
        ax.plot(xs, [100 * r.as_dict()["hit_rate_device"] for r in pts], marker="s", linestyle="--", color=colour,
                label=f"{policy}: device")
    ax.set_xlabel("instances")
    ax.set_ylabel("cluster token hit rate (%)")
    ax.set_ylim(0, 100)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_plot(fig, path)
    plt.close(fig)


def _counts(text: str | None) -> list[int]:
    if text is None or text == "auto":
        return list(DEFAULT_INSTANCES_SWEEP)
    try:
        counts = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        counts = []
    if not counts or counts[0] < 1:
        raise ConfigError(f"with --instances, --sweep wants comma-separated instance counts, got {text[:80]!r}")
    if len(counts) > MAX_SWEEP_COUNTS:
        raise ConfigError(f"with --instances, --sweep takes at most {MAX_SWEEP_COUNTS} counts, got {len(counts)}")
    return _at_most_max_instances(counts, "--sweep")


def _at_most_max_instances(counts: list[int], flag: str) -> list[int]:
    """``counts``, or ConfigError past ``MAX_INSTANCES``: no router window, nor memory, is sized for more."""
    if max(counts) > MAX_INSTANCES:
        raise ConfigError(f"{flag} {max(counts)}: a cluster has at most {MAX_INSTANCES} instances")
    return counts


def _check_pool_memory(instances: int, device_tokens: int, host_tokens: int) -> None:
    """Refuse pools the machine cannot hold before the first cache is built: every instance has its own."""
    check_tokens(instances * (device_tokens + host_tokens), f"{instances} instances' device and host tokens")


def run(args: argparse.Namespace, pool_sizes: Callable[[Trace], tuple[int, int]]) -> int:
    """The ``--instances`` branch of ``simulate --trace``; ``pool_sizes(trace)`` gives each instance's device and host tokens."""
    try:
        from hicache_fsm.cluster_replay import ClusterOptions, run_cluster, sweep_cluster
        from hicache_fsm.trace_replay import ReplayProgress
    except ModuleNotFoundError as exc:
        print(f"{PROG}: --instances needs {exc.name}: pip install 'hicache_fsm[events]'", file=sys.stderr)
        return 1
    sweeping = args.sweep is not None or bool(args.plot)
    if sweeping and was_given(args, "router"):
        raise UsageError("--router picks one policy; --sweep (and --plot) replay every policy")
    if not sweeping and was_given(args, "load_cap") and args.router != "prefix_aware_capped":
        raise UsageError(f"--load-cap is prefix_aware_capped's; --router {args.router} does not read it")
    try:
        _at_most_max_instances([args.instances], "--instances")  # before the trace is read
        counts = _counts(args.sweep) if sweeping else None
        trace = load_trace(args.trace, args.block_size)
        device_tokens, host_tokens = pool_sizes(trace)
        _check_pool_memory(max(counts or [args.instances]), device_tokens, host_tokens)
        options = ClusterOptions(trace, args.instances, args.router, device_tokens, host_tokens, args.storage_url,
                                 not args.no_storage, args.page_size, args.layout, args.device, args.load_cap,
                                 args.event_lag)
    except (TraceError, ConfigError) as exc:  # cli.main prints it as a usage error
        raise UsageError(str(exc)) from None
    # progress only to a terminal, as simulate --trace: a log or a pipe gets the table
    progress = ReplayProgress(stream=sys.stderr, enabled=not args.no_progress and sys.stderr.isatty())
    out = sys.stderr if args.json else sys.stdout
    try:
        if counts is None:
            result = run_cluster(options, progress)
            print(format_result(result), file=out)
            payload = result.as_dict()
            agreed = result.index_agreements == result.index_checks
        else:
            results = sweep_cluster(options, counts, POLICIES, progress)
            print(format_sweep(results), file=out)
            if args.plot:
                plot_sweep(results, args.plot)
                print(f"plot written to {args.plot}", file=out)
            payload = {"sweep": [r.as_dict() for r in results]}
            agreed = all(r.index_agreements == r.index_checks for r in results)
    except HiCacheError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(payload, sort_keys=True))
    return 0 if agreed else 1


__all__ = ["cluster_only_options", "configure", "format_result", "format_sweep", "plot_sweep", "run"]
