"""Every benchmark in one run, written up as docs/performance.md.

Runs ``dispatch``, ``copy`` (page_first and layer_first hosts, page 64),
``controller``, ``storage`` (a file backend in a temporary directory) and
``scale`` (per-operation cost from 1k to 1M cached nodes) one
after the other, each in its own interpreter and against the baseline it
measures in the same run, and
writes a Markdown page with the figures, the ratios, the machine and the
command that reproduces each figure. ``--quick`` shrinks every benchmark (for
tests; the figures are then noisy).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

from hicache_fsm.bench.common import machine_description
from hicache_fsm.commands.args import UsageError, path_arg

# (key, benchmark, arguments): the arguments are exactly what the reproduce command passes.
STEPS: list[tuple[str, str, list[str]]] = [
    ("dispatch", "dispatch", []),
    ("copy_page_first", "copy", ["--layout", "page_first", "--page-size", "64"]),
    ("copy_layer_first", "copy", ["--layout", "layer_first", "--page-size", "64"]),
    ("controller", "controller", []),
    ("storage_file", "storage", []),
    ("scale", "scale", []),
]

QUICK: dict[str, list[str]] = {
    "dispatch": ["--objects", "2000", "--repeats", "3"],
    "copy": ["--tokens", "1024", "--layers", "2", "--repeats", "3"],
    "controller": ["--requests", "50", "--repeats", "1", "--tp", "1,2", "--tp-requests", "50"],
    "storage": ["--pages", "4", "--repeats", "2", "--layers", "2"],
    "scale": ["--quick"],
}


def _tp_lines(tp: dict) -> list[str]:
    """Tensor-parallel rows: the loop on N rank processes (gloo on CPU), see docs/tensor-parallel.md."""
    out = []
    for world, f in sorted(tp.items(), key=lambda kv: int(kv[0])):
        out.append(f"- tp {world} ({world} rank processes, gloo on CPU): {_fmt(f.get('us_per_request'), 1)} us/request "
                   f"({_fmt(f.get('ratio_to_tp1'))}x tp 1), of which {_fmt(f.get('collective_us'), 1)} us in "
                   f"{_fmt(f.get('collectives_per_request'), 0)} MIN all-reduces (a bare one: "
                   f"{_fmt(f.get('raw_all_reduce_us'), 1)} us) and {_fmt(f.get('agreement_us'), 1)} us of agreement "
                   "bookkeeping")
    return out


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", "-o", default=None, type=path_arg,
                        help="where to write the page (default: docs/performance.md under the current directory)")
    parser.add_argument("--no-write", action="store_true", help="run and print, write nothing")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test (noisy figures)")


# The page's hand-written tail (measurements bench all cannot repeat, e.g. against an installed SGLang) starts at
# this line; a rewrite keeps it.
KEPT = "<!-- Written by hand, below this line: `hicache-fsm bench all` keeps it. -->"


def kept_tail(out: Path) -> str:
    """The hand-written part of the page ``out`` (from ``KEPT`` on), or "" when there is none."""
    try:
        page = out.read_text(encoding="utf-8")
    except FileNotFoundError:
        return ""
    at = page.find(KEPT)
    return "" if at < 0 else "\n" + page[at:]


def _run_one(name: str, argv: list[str]) -> dict:
    """Run one benchmark in a fresh interpreter, exactly as its reproduce command does.

    In one process, a benchmark inherited the heap, threads and caches the
    earlier ones left behind (once the controller measured 119 us/request
    there against 98-103 standalone). Its table goes to stderr, its JSON
    comes back.
    """
    cmd = [sys.executable, "-m", "hicache_fsm.cli", "bench", name, *argv, "--json"]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"bench all: `{_command(name, argv)}` failed with exit status {proc.returncode}")
    return json.loads(proc.stdout)


def _command(name: str, argv: list[str]) -> str:
    return " ".join(["hicache-fsm", "bench", name, *map(shlex.quote, argv)])


def _fmt(x: object, digits: int = 2) -> str:
    return f"{x:.{digits}f}" if isinstance(x, (int, float)) else "n/a"


def _first(result: dict, key: str) -> object:
    values = result.get(key) or [None]
    return values[0]


def _last(result: dict, key: str) -> object:
    values = result.get(key) or [None]
    return values[-1]


def _nodes(result: dict, i: int) -> str:
    nodes = result.get("nodes") or []
    return f"{nodes[i]:,}" if nodes else "n/a"


def _machine() -> dict:
    info = dict(machine_description())
    info["platform"] = platform.platform()
    info["cpus"] = os.cpu_count()
    try:
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - not on every OS
        info["load_average"] = None
    return info


def render(results: dict, commands: dict[str, str], machine: dict, started: str, seconds: float,
           quick: bool) -> str:
    """The Markdown page."""
    d = results.get("dispatch", {})
    cp = results.get("copy_page_first", {})
    cl = results.get("copy_layer_first", {})
    c = results.get("controller", {})
    s = results.get("storage_file", {})
    sc = results.get("scale", {})
    growth = sc.get("growth", {})
    lines = [
        "# Performance",
        "",
        "<!-- Generated by `hicache-fsm bench all`; edit hicache_fsm/bench/all.py, not this page. -->",
        "",
        "Every figure is measured against a baseline timed in the same run, on the same",
        "machine, interleaved with it where possible, so the ratios hold up on a shared or",
        "busy machine better than the absolute numbers do. Rerun everything with",
        "`hicache-fsm bench all` (the run's duration is under Machine); each section names",
        "the command that reproduces its own figure (add `--json` for the raw result).",
        "",
    ]
    if quick:
        lines += ["> **Quick run** (`--quick`): tiny sizes, the figures are noise.", ""]
    lines += [
        "## Summary",
        "",
        "| benchmark | figure | same-run baseline | ratio |",
        "| --- | --- | --- | --- |",
        f"| dispatch: compiled table | {_fmt(d.get('compiled_ns'), 0)} ns/transition "
        f"| `transitions` {_fmt(d.get('transitions_ns'), 0)} ns; bare dict {_fmt(d.get('dict_ns'), 0)} ns "
        f"| {_fmt(d.get('speedup_vs_transitions'), 1)}x faster than `transitions`; "
        f"{_fmt(d.get('ratio_vs_dict'))}x a bare dict |",
    ]
    for label, r in (("page_first", cp), ("layer_first", cl)):
        lines.append(
            f"| copy, {label} host, page {r.get('page_size', 64)} | d2h {_fmt(r.get('d2h_gbps'))} GB/s, "
            f"h2d {_fmt(r.get('h2d_gbps'))} GB/s | one contiguous copy: {_fmt(r.get('contiguous_d2h_gbps'))} / "
            f"{_fmt(r.get('contiguous_h2d_gbps'))} GB/s | {_fmt(r.get('ratio_d2h'))} / {_fmt(r.get('ratio_h2d'))} |")
    lines += [
        f"| controller per request | {_fmt(c.get('us_per_request'), 1)} us | through `transitions`: "
        f"{_fmt(c.get('transitions_us_per_request'), 1)} us | {_fmt(c.get('speedup'))}x faster |",
        f"| storage, file backend | set {_fmt(s.get('set_gbps'))} GB/s, get {_fmt(s.get('get_gbps'))} GB/s "
        f"| raw files: {_fmt(s.get('raw_set_gbps'))} / {_fmt(s.get('raw_get_gbps'))} GB/s "
        f"| {_fmt(s.get('set_ratio'))} / {_fmt(s.get('get_ratio'))} |",
        f"| scale: evict 64 pages / request cycle at {_nodes(sc, -1)} nodes | {_fmt(_last(sc, 'evict_us'), 1)} us / "
        f"{_fmt(_last(sc, 'cycle_us'), 1)} us | at {_nodes(sc, 0)} nodes: {_fmt(_first(sc, 'evict_us'), 1)} us / "
        f"{_fmt(_first(sc, 'cycle_us'), 1)} us | grows {_fmt(growth.get('evict_us'))}x / "
        f"{_fmt(growth.get('cycle_us'))}x |",
        "",
        "## Machine",
        "",
        f"- Run: {started}, {seconds:.0f} s in all",
        f"- Python {machine.get('python')}, torch {machine.get('torch')}, {machine.get('platform')}",
        f"- CPU: {machine.get('cpu')}, {machine.get('cpus')} logical CPUs; "
        f"load average at start {machine.get('load_average')}",
        f"- CUDA device: {machine.get('cuda') or 'none (CPU executor: copies run synchronously)'}",
        "",
        "## Dispatch",
        "",
        "One guarded, job-emitting transition cycle driven over many objects three ways: the",
        "compiled table (`CompiledMachine.fire`, the library's hot path), `transitions`' own",
        "trigger methods on models of one `transitions.Machine`, and a bare",
        "`table[trigger][state]` lookup with an attribute store (the floor any table",
        "dispatch pays). Median nanoseconds per transition.",
        "",
        f"- compiled {_fmt(d.get('compiled_ns'), 1)} ns, `transitions` {_fmt(d.get('transitions_ns'), 1)} ns, "
        f"bare dict {_fmt(d.get('dict_ns'), 1)} ns",
        f"- reproduce: `{commands['dispatch']}`",
        "",
        "## Copy",
        "",
        "Every page of the device pool is backed up to a shuffled set of host pages (D2H)",
        "and loaded back to a shuffled set of device pages (H2D) through `TorchExecutor`;",
        "the baseline is one contiguous `copy_` of the same bytes between the same buffers.",
        "On a CPU-only machine both sides are memory copies, so the ratio is the price of",
        "page gathers and scatters; on CUDA it is the price against one large DMA (figures",
        "measured on an NVIDIA H200: [On a GPU](gpu.md)).",
        "",
    ]
    for key, r in (("copy_page_first", cp), ("copy_layer_first", cl)):
        lines += [
            f"- {r.get('layout', key)}: {_fmt(r.get('bytes', 0) / 1e6 if r.get('bytes') else None, 1)} MB per "
            f"direction, device {r.get('device')}, pinned host {r.get('pinned')}; ratio d2h "
            f"{_fmt(r.get('ratio_d2h'))}, h2d {_fmt(r.get('ratio_h2d'))}",
            f"  - reproduce: `{commands[key]}`",
        ]
    lines += [
        "",
        "## Controller",
        "",
        f"Requests of {c.get('request_tokens', 'n/a')} tokens (page {c.get('page_size', 'n/a')}), each "
        "`match_prefix`, `insert` (write-through: one backup job), `poll`, `poll`; slot allocation",
        "is the engine's and left out; an executor acknowledges without copying, so this is the",
        "controller alone, with the tree already holding many other prefixes. Baseline: the same",
        "cache with every residency trigger fired through `transitions.Machine` (one model per",
        "node), as an engine using `transitions` directly would. The calls check every id",
        f"(validation on), handed each request's ids in the form `--ids {c.get('ids', 'n/a')}` names.",
        "",
        f"- {_fmt(c.get('us_per_request'), 1)} us/request against {_fmt(c.get('transitions_us_per_request'), 1)} "
        f"us/request: {_fmt(c.get('speedup'))}x",
        *_tp_lines(c.get("tp") or {}),
        f"- reproduce: `{commands['controller']}`",
        "",
        "## Storage (file backend)",
        "",
        f"{s.get('pages', 'n/a')} pages of {_fmt((s.get('page_bytes') or 0) / 2**20)} MiB stored with",
        "`batch_set_from` and read back with `batch_get_into` (zero-copy into a preallocated host",
        "pool) in a temporary directory; the baseline writes and reads the same bytes as plain",
        "files (one unbuffered write / `readinto` per page) in a sibling directory. Both sides",
        "delete what the previous round wrote first, so neither skips existing pages.",
        "",
        f"- set {_fmt(s.get('set_gbps'), 3)} GB/s (raw {_fmt(s.get('raw_set_gbps'), 3)}), get "
        f"{_fmt(s.get('get_gbps'), 3)} GB/s (raw {_fmt(s.get('raw_get_gbps'), 3)})",
        f"- reproduce: `{commands['storage_file']}`",
        "",
        "## Scale",
        "",
        "Per-operation controller cost against the size of the tree (page 64, 4,096-token",
        "requests sharing a 1,024-token prompt, metadata-sized KV, an executor that acknowledges",
        "without copying): the tree is filled with N one-page prefixes, all backed up to the host,",
        "and each figure is the median of repeated chunks of calls, in microseconds. `evict` frees",
        "64 pages from a full device; `cycle` is a whole request under device pressure with host",
        "backup (match, load back a host hit, lock, allocate with eviction, insert with its backup,",
        "unlock, poll). Eviction candidates are kept up to date as nodes change, so taking k",
        "victims costs O(k log N): the targets are evict and cycle within 2x, match, insert and",
        "lock within 1.5x from the smallest to the largest tree.",
        "",
        "| nodes | match | match, partial | match, miss | insert | lock + unlock | evict 64 pages | cycle "
        "| bytes/node | peak RSS MB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *[row for r in sc.get("per_size", []) for row in _scale_rows(r)],
        "",
        "Each size's second and third rows are ours / the same-run baseline doing the same work",
        "(`hicache_fsm.bench.baselines`: `plain`, a dict of page tuples; `sglang`, a minimal",
        "re-implementation of SGLang RadixCache's match / insert / lock / evict loop, device only,",
        "no token checks), timed interleaved chunk by chunk; bytes/node is the resident memory the",
        "fill took per node. The ids ours is handed: "
        + sc.get("ids", {}).get("ours", "the run recorded no form") + ".",
        "",
        "- growth from the smallest to the largest tree: "
        + ", ".join(f"{k.removesuffix('_us')} {_fmt(v)}x" for k, v in growth.items()),
        f"- reproduce: `{commands['scale']}`",
        "",
        "## Whole system",
        "",
        "`hicache-fsm simulate` runs a multi-turn chat workload with real KV through every cache",
        "configuration and prints hit rates by tier, bytes moved and controller time per",
        "request; see [getting-started.md](getting-started.md).",
        "",
    ]
    return "\n".join(lines)


def _scale_rows(r: dict) -> list[str]:
    """One size of ``bench scale``: microseconds, then ours / each baseline."""
    ops = ("match", "match_partial", "match_miss", "insert", "lock", "evict", "cycle")
    rows = [f"| {r.get('nodes')} | " + " | ".join(_fmt(r.get(f"{op}_us"), 1) for op in ops)
            + f" | {_fmt(r.get('bytes_per_node'), 0)} | {_fmt(r.get('peak_rss_mb'), 0)} |"]
    for name in ("plain", "sglang", "sglang_peer"):
        if f"vs_{name}_match" in r:
            base = r.get(f"{name}_bytes_per_node")
            mem = _fmt(r["bytes_per_node"] / base) + "x" if base else "-"
            rows.append(f"| / {name} | " + " | ".join(_fmt(r.get(f"vs_{name}_{op}")) + "x" for op in ops)
                        + f" | {mem} | |")
    return rows


def run(args: argparse.Namespace) -> dict:
    out = None
    if not args.no_write:
        out = Path(args.output) if args.output else Path("docs") / "performance.md"
        if not out.parent.is_dir():
            raise UsageError(f"{out.parent}/ does not exist; run from the repository root or pass --output")
        if out.is_dir():  # found now, not after the whole run
            raise UsageError(f"{out} is a directory; pass --output FILE.md")
    started = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = _machine()
    t0 = time.perf_counter()
    results: dict[str, dict] = {}
    commands: dict[str, str] = {}
    as_json = getattr(args, "json", False)
    with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():  # stdout: JSON only
        for key, name, argv in STEPS:
            commands[key] = _command(name, argv)
            full = argv + (QUICK.get(name, []) if args.quick else [])
            print(f"== {_command(name, full)}", flush=True)
            results[key] = _run_one(name, full)
            print(flush=True)
    seconds = time.perf_counter() - t0
    page = render(results, commands, machine, started, seconds, args.quick)
    if out is not None:
        out.write_text(page + kept_tail(out), encoding="utf-8")
        print(f"wrote {out}", file=sys.stderr)
    result = {"benchmark": "all", "results": results, "machine": machine, "seconds": round(seconds, 1),
              "output": str(out) if out else None}
    if as_json:
        print(json.dumps(result, sort_keys=True, default=str))
    return result
