"""Benchmarks: each prints ratios against a baseline measured in the same run.

Every benchmark module exposes ``configure(parser)`` and ``run(args) -> dict``;
``hicache-fsm bench NAME [--json]`` prints a human table and, with ``--json``,
the result dict as the last line.
"""

# Benchmark name -> (module, one-line help). The help lines live here so that listing the
# benchmarks imports none of them: ``bench copy`` must run where the events extra is missing.
BENCHMARKS = {
    "dispatch": ("hicache_fsm.bench.dispatch",
                 "Dispatch cost: the compiled table vs `transitions`' own trigger vs a bare dict, same run."),
    "copy": ("hicache_fsm.bench.copy",
             "Page copy throughput of TorchExecutor (random page order) beside a plain contiguous copy."),
    "controller": ("hicache_fsm.bench.controller",
                   "Controller overhead per request: HiCache on the compiled table vs through ``transitions``."),
    "storage": ("hicache_fsm.bench.storage",
                "L3 storage page throughput (set/get GB/s) against raw I/O on the same medium."),
    "scale": ("hicache_fsm.bench.scale",
              "Per-operation cost against the size of the tree: does the controller stay flat at 10^6 nodes?"),
    "insert": ("hicache_fsm.bench.insert",
               "Insert, call by call after a collection: ours, with and without its host backup, "
               "against same-run baselines."),
    "events": ("hicache_fsm.bench.events",
               "What KV events cost the controller: ``bench controller``'s loop with events off and on, same run."),
    "all": ("hicache_fsm.bench.all", "Every benchmark in one run, written up as docs/performance.md."),
}
