"""Protocol fuzzing and verification for prefix KV caches (ours, or yours through an adapter).

- ``adapter``:    ``CacheAdapter`` (the interface every tool drives) and ``HiCacheAdapter``;
- ``strategies``: hypothesis strategies for prompts, multi-turn workloads and fault schedules;
- ``stateful``:   ``CacheProtocolMachine``, a ``RuleBasedStateMachine`` checking the invariant
                  catalogue after every step; ``run_fuzz`` runs it outside pytest;
- ``explorer``:   exhaustive bounded BFS over the composed cache state (``hicache-fsm check``);
- ``paths``:      shortest spec paths to every state / transition, and ``CoverageTracker``;
- ``trace``:      JSONL recording of a cache's events and ``replay`` against the specs;
- ``storage``:    ``ManualStorageTier`` (the storage tier run step by step, no threads) and ``FaultPlan``;
- ``protocol``:   ``ProtocolAdapter`` (policy obligations, load-back indices, attach / detach, partial
                  storage results) and the families ``hicache-fsm check`` explores by default;
- ``cp``:         ``CPAdapter``: CP layer writes with draft layers on simulated ranks;
- ``blockstore``: the outsider profile for asynchronous block stores (``BlockStoreAdapter``, its
                  reference model, explorer and machine);
- ``mutants``:    planted controller bugs (tests only) that the tools must catch.

See ``docs/fuzzing.md`` for a worked example on a cache written from scratch.
"""

from hicache_fsm.errors import MissingExtra

try:
    import hypothesis  # noqa: F401  (strategies and the protocol state machine are built on it)
except ModuleNotFoundError as exc:
    if exc.name != "hypothesis":
        raise
    raise MissingExtra("hicache_fsm.testing", "hypothesis", "testing") from None

from hicache_fsm.testing.adapter import (
    CacheAdapter,
    HiCacheAdapter,
    JobInfo,
    MatchInfo,
    NotSupported,
    Occupancy,
    Rejected,
    StorageFault,
    decode_kv_lists,
    encode_kv,
    kv_fingerprint,
)
from hicache_fsm.testing.blockstore import (
    BlockStoreAdapter,
    StoreBounds,
    StoreJob,
    explore_store,
    run_store_fuzz,
    store_machine,
)
from hicache_fsm.testing.checks import Outcome, Step, catalogue, perform, replay_steps
from hicache_fsm.testing.explorer import (
    Bounds,
    Explorer,
    ExploreResult,
    Violation,
    explore,
)
from hicache_fsm.testing.paths import (
    CoverageTracker,
    SpecPath,
    run_path,
    shortest_paths,
    spec_paths,
)
from hicache_fsm.testing.cp import CPAdapter
from hicache_fsm.testing.protocol import ProtocolAdapter, default_families
from hicache_fsm.testing.stateful import (
    HICACHE_VARIANTS,
    CacheProtocolMachine,
    FuzzResult,
    hicache_machine,
    protocol_test_case,
    regression_test,
    run_fuzz,
)
from hicache_fsm.testing.storage import FaultPlan, ManualStorageTier, StorageStep
from hicache_fsm.testing.strategies import (
    FaultSchedule,
    Request,
    Workload,
    fault_schedules,
    multi_turn_workloads,
    pages_to_tokens,
    prefix_families,
    prompt_pages,
    token_sequences,
)
from hicache_fsm.testing.trace import (
    Divergence,
    ReplayResult,
    TraceRecorder,
    load_trace,
    record,
    replay,
)

__all__ = [
    "HICACHE_VARIANTS",
    "BlockStoreAdapter",
    "Bounds",
    "CPAdapter",
    "CacheAdapter",
    "CacheProtocolMachine",
    "CoverageTracker",
    "Divergence",
    "ExploreResult",
    "Explorer",
    "FaultPlan",
    "FaultSchedule",
    "FuzzResult",
    "HiCacheAdapter",
    "JobInfo",
    "ManualStorageTier",
    "MatchInfo",
    "NotSupported",
    "Occupancy",
    "Outcome",
    "ProtocolAdapter",
    "Rejected",
    "ReplayResult",
    "Request",
    "SpecPath",
    "Step",
    "StoreBounds",
    "StoreJob",
    "StorageFault",
    "StorageStep",
    "TraceRecorder",
    "Violation",
    "Workload",
    "catalogue",
    "decode_kv_lists",
    "default_families",
    "encode_kv",
    "explore",
    "explore_store",
    "fault_schedules",
    "hicache_machine",
    "kv_fingerprint",
    "load_trace",
    "multi_turn_workloads",
    "pages_to_tokens",
    "perform",
    "prefix_families",
    "prompt_pages",
    "protocol_test_case",
    "record",
    "regression_test",
    "replay",
    "replay_steps",
    "run_fuzz",
    "run_path",
    "run_store_fuzz",
    "shortest_paths",
    "spec_paths",
    "store_machine",
    "token_sequences",
]
