"""Benchmarks: each prints ratios against a baseline measured in the same run.

Every benchmark module exposes ``configure(parser)`` and ``run(args) -> dict``;
``hicache-fsm bench NAME [--json]`` prints a human table and, with ``--json``,
the result dict as the last line.
"""

BENCHMARKS = {
    "dispatch": "hicache_fsm.bench.dispatch",
    "copy": "hicache_fsm.bench.copy",
    "controller": "hicache_fsm.bench.controller",
    "storage": "hicache_fsm.bench.storage",
    "scale": "hicache_fsm.bench.scale",
    "insert": "hicache_fsm.bench.insert",
    "events": "hicache_fsm.bench.events",
    "all": "hicache_fsm.bench.all",
}
