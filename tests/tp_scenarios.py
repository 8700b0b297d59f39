"""What each rank process runs in the tensor-parallel tests (module level: spawned processes import it).

Every rank serves the same requests through its own ``HiCache`` (a
``ManualExecutor``, so the test decides when each copy ends) and injects its
own differences: which pending copies finish this step, in which order, which
fail. After every step the ranks compare ``rank_view`` digests over the group;
each returns its list of digests so the parent compares them too.
"""

from __future__ import annotations

import os
import random
import time
import zlib

import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from hicache_fsm.cache import HiCache
from hicache_fsm.config import CacheConfig
from hicache_fsm.errors import GroupError
from hicache_fsm.executors import ManualExecutor
from hicache_fsm.pools import DeviceKVPool, HostKVPool, KVShape
from hicache_fsm.tp import RankGroup, rank_view, view_digest

PAGE = 4
SHAPE = KVShape(layers=2, heads=1, head_dim=2)  # one rank's shard of the heads
QUIET = settings(max_examples=3, derandomize=True, database=None, deadline=None, phases=[Phase.explicit, Phase.generate],
                 suppress_health_check=list(HealthCheck))


def shard_kv(tokens, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """KV of each token as a function of its prefix and the rank (each rank holds other heads)."""
    vals, crc = [], rank
    for t in tokens:
        crc = zlib.crc32(int(t).to_bytes(8, "little"), crc)
        vals.append(float(crc % 100_003))
    base = torch.tensor(vals, dtype=torch.float32).view(1, -1, 1, 1)
    grid = torch.arange(SHAPE.layers * SHAPE.heads * SHAPE.head_dim, dtype=torch.float32).view(
        SHAPE.layers, 1, SHAPE.heads, SHAPE.head_dim)
    return (base + grid * 0.25).contiguous(), (-base - grid * 0.5).contiguous()


def make_cache(group: RankGroup, policy: str = "write_through", device_pages: int = 12,
               host_pages: int = 20) -> tuple[HiCache, ManualExecutor]:
    dev = DeviceKVPool(SHAPE, device_pages * PAGE, PAGE, "cpu")
    host = HostKVPool(SHAPE, host_pages * PAGE, PAGE, "layer_first", pin_memory=False)
    ex = ManualExecutor(dev, host)
    cache = HiCache(dev, host, CacheConfig(write_policy=policy, load_back_threshold=0), ex,
                    group=group)
    return cache, ex


def prompts(seed: int, n: int) -> list[tuple[int, ...]]:
    """Requests with shared prefixes (the same on every rank)."""
    rng = random.Random(seed)
    stems = [tuple(rng.randrange(50) for _ in range(2 * PAGE)) for _ in range(3)]
    return [rng.choice(stems) + tuple(rng.randrange(50) for _ in range(PAGE * rng.randrange(1, 4))) for _ in range(n)]


def serve(cache: HiCache, tokens: tuple, rank: int) -> None:
    """One request the engine way: match, load back, lock, allocate, write this rank's KV, insert, unlock."""
    m = cache.match_prefix(tokens)
    lb = cache.load_back(m.last_host_node) if m.host_hit_length else None
    node = lb.last_node if lb is not None else m.last_device_node
    cache.lock(node)
    try:
        parts = [m.device_indices] + ([lb.device_indices] if lb is not None else [])
        have = sum(int(p.numel()) for p in parts)
        if lb is None and m.host_hit_length:
            return  # not loaded (device short): the engine would recompute; keep it simple
        n_new = len(tokens) - have
        idx = cache.alloc_device(n_new) if n_new else torch.empty(0, dtype=torch.int64)
        if idx is None:
            return
        k, v = shard_kv(tokens, rank)
        if n_new:
            cache.device_pool.write(idx, None, k[:, have:], v[:, have:])
        cache.insert(tokens, torch.cat(parts + [idx]))
    finally:
        cache.unlock(node)


def finish_copies(ex: ManualExecutor, rng: random.Random, share: float, fail: float) -> None:
    """This rank's copies: a random share of the pending ones end now, in a random order, some failing."""
    pending = ex.pending_job_ids()
    rng.shuffle(pending)
    for job_id in pending[: int(len(pending) * share + 0.5)]:
        if rng.random() < fail:
            ex.fail(job_id, "injected on this rank")
        else:
            ex.complete(job_id)


def agree_view(cache: HiCache, group: RankGroup, step: str) -> int:
    d = view_digest(rank_view(cache))
    if not group.same(d):
        raise AssertionError(f"rank {group.rank}: tree differs from another rank's after {step}: {rank_view(cache)}")
    return d


def drain(cache: HiCache, ex: ManualExecutor) -> None:
    for _ in range(50):
        ex.complete_all()
        cache.poll()
        if not cache.pending_job_ids():
            return
    raise AssertionError(f"jobs still pending: {cache.pending_job_ids()}")


def check_kv(cache: HiCache, ex: ManualExecutor, served: list[tuple], rank: int) -> int:
    """Every cached prefix reads back bit-exact (host-only parts loaded back first); pages checked."""
    checked = 0
    for tokens in served:
        m = cache.match_prefix(tokens)
        if m.host_hit_length:
            cache.load_back(m.last_host_node)
            drain(cache, ex)
            m = cache.match_prefix(tokens)
        n = m.device_hit_length
        if not n:
            continue
        k, v = cache.device_pool.read(m.device_indices)
        ek, ev = shard_kv(tokens[:n], rank)
        if not (torch.equal(k, ek) and torch.equal(v, ev)):
            raise AssertionError(f"rank {rank}: KV of {tokens[:n]} is not what was written")
        checked += n // PAGE
    return checked


def run_acks(rank: int, group: RankGroup, policy: str, seed: int, steps: int, share: float, fail: float,
             fail_rank: int) -> tuple[list[int], int]:
    """``steps`` requests, this rank finishing its copies its own way; views compared after every step."""
    cache, ex = make_cache(group, policy)
    rng = random.Random(f"{seed}:{rank}")  # per-rank differences
    reqs = prompts(seed, steps)
    digests = []
    for i, tokens in enumerate(reqs):
        serve(cache, tokens, rank)
        finish_copies(ex, rng, share, fail if rank == fail_rank else 0.0)
        cache.poll()
        cache.check_invariants()
        digests.append(agree_view(cache, group, f"request {i}"))
        if policy == "write_back" and i % 3 == 2:
            cache.evict(2 * PAGE)
    drain(cache, ex)
    cache.check_invariants()
    digests.append(agree_view(cache, group, "drain"))
    checked = check_kv(cache, ex, reqs, rank)
    digests.append(agree_view(cache, group, "read-back"))
    cache.check_invariants()
    if cache.acks.arrived:
        raise AssertionError(f"rank {rank}: completions held but never agreed: {sorted(cache.acks.arrived)}")
    return digests, checked


def rank_differences(world: int) -> dict:
    """Strategies for what each rank does its own way: a request seed, each rank's share of pending copies
    ended a step, a failure rate and the rank that fails."""
    return {"seed": st.integers(0, 10_000),
            "shares": st.lists(st.sampled_from([0.0, 0.3, 0.6, 1.0]), min_size=world, max_size=world),
            "fail": st.sampled_from([0.0, 0.2, 0.5]), "fail_rank": st.integers(0, world - 1)}


def acks_property(rank: int, world: int, pg, policy: str, examples: int) -> list[int]:
    """Hypothesis (same examples on every rank) picks each rank's share, failure rate and order seed."""
    group = RankGroup(pg, timeout_s=120.0)  # a safety stop only
    seen: list[int] = []

    @settings(QUIET, max_examples=examples)
    @given(**rank_differences(world))
    @example(seed=1, shares=[1.0] + [0.3] * (world - 1), fail=0.3, fail_rank=world - 1)  # late, out of order, failing
    def prop(seed, shares, fail, fail_rank):
        digests, checked = run_acks(rank, group, policy, seed, 14, shares[rank], fail, fail_rank)
        seen.extend(digests)
        seen.append(checked)

    prop()
    return seen


def rank_dies(rank: int, world: int, pg, victim: int, timeout_s: float) -> tuple[str, float]:
    """The victim rank exits mid-run; the others must get a GroupError within the timeout."""
    group = RankGroup(pg, timeout_s=timeout_s)
    cache, ex = make_cache(group)
    reqs = prompts(7, 6)
    for i, tokens in enumerate(reqs):
        serve(cache, tokens, rank)
        ex.complete_all()
        if i == 3 and rank == victim:
            os._exit(17)
        start = time.monotonic()
        try:
            cache.poll()
        except GroupError as exc:
            elapsed = time.monotonic() - start
            try:  # a failed group stays failed
                cache.poll()
            except GroupError:
                return type(exc).__name__, elapsed
            return "poll worked after a group failure", elapsed
    return "no error", 0.0


# ====================================================================== storage


def attach(cache: HiCache, rank: int, world: int, url: str, mla: bool, stop_policy: str = "wait_complete"):
    """A manual storage tier (the test runs each storage step) behind a fault plan of this rank."""
    from hicache_fsm.storage import open_backend
    from hicache_fsm.storage.faults import FaultyBackend
    from hicache_fsm.storage.keys import KeyNamespace
    from hicache_fsm.testing.storage import FaultPlan, ManualStorageTier

    plan = FaultPlan()
    ns = KeyNamespace("tp-test", rank, world, mla)
    backend = FaultyBackend(open_backend(url, namespace=ns), plan)
    tier = ManualStorageTier.attach_to(cache, backend, prefetch_threshold=PAGE, stop_policy=stop_policy,
                                       timeout_base=0.02, timeout_per_1k_tokens=0.0, retry_interval=0.01,
                                       batch_pages=2, namespace=ns)
    return tier, plan


def run_storage_steps(tier, rng: random.Random, share: float) -> None:
    """This rank's storage threads: a random share of the queued work, in a random order."""
    steps = [s.id for s in tier.steps()]
    rng.shuffle(steps)
    for step_id in steps:
        if rng.random() < share:
            tier.run(step_id)


def settle(cache: HiCache, ex: ManualExecutor, tier, group: RankGroup, what: str) -> None:
    """Run everything until no job is pending and no storage work is queued (failed backups retried)."""
    for _ in range(200):
        ex.complete_all()
        for step in tier.steps():
            tier.run(step.id)
        cache.poll()
        agree_view(cache, group, what)
        busy = bool(cache.pending_job_ids()) or bool(tier.steps()) or any(
            n.state in ("device_host", "host") for n in cache.tree.nodes())
        if not group.min([0 if busy else 1])[0] == 0:
            return
        time.sleep(0.01)  # the agreed clock must pass the retry interval
    raise AssertionError(f"{what}: storage did not settle: {cache.pending_job_ids()} {tier.steps()}")


def run_storage(rank: int, world: int, group: RankGroup, url: str, mla: bool, seed: int, share: float,
                set_fail_rank: int, miss_rank: int, short_rank: int, stop_policy: str = "wait_complete",
                set_fault: str = "short") -> tuple[list[int], int]:
    """Store requests to L3, drop the cache, prefetch them back; ranks differ in pace, misses and failures."""
    from hicache_fsm.testing.adapter import StorageFault

    cache, ex = make_cache(group, "write_through", device_pages=16, host_pages=24)
    tier, plan = attach(cache, rank, world, url, mla, stop_policy)
    kv_rank = 0 if mla else rank  # MLA: one latent shared by every rank
    rng = random.Random(f"{seed}:{rank}")
    reqs = prompts(seed, 8)
    digests = []
    if rank == set_fail_rank:
        # two backups refused ("short") or storage down ("raise": this rank sees it unhealthy) on this rank only
        plan.arm(StorageFault(set_fault, "set", after=1, count=2))
    for i, tokens in enumerate(reqs):
        serve(cache, tokens, kv_rank)
        finish_copies(ex, rng, share, 0.0)
        run_storage_steps(tier, rng, share)
        cache.poll()
        cache.check_invariants()
        digests.append(agree_view(cache, group, f"store {i}"))
    settle(cache, ex, tier, group, "stores")
    stored = cache.stats()["storage"]["backup_tokens_stored"]
    cache.reset()
    digests.append(agree_view(cache, group, "reset"))
    if rank == miss_rank:
        plan.arm(StorageFault("short", "exists", after=0, count=1))  # this rank's first hit query misses a page
    if rank == short_rank:
        plan.arm(StorageFault("short", "get", after=1, count=1))  # one transfer batch comes back short
    checked = 0
    for i, tokens in enumerate(reqs[:4]):
        m = cache.match_prefix(tokens)
        rid = f"r{i}"
        if cache.prefetch(rid, tokens, m):
            for _ in range(300):
                run_storage_steps(tier, rng, share if rank else 1.0)  # rank 0 fast, the others at their pace
                cache.poll()
                cache.check_invariants()
                ready = cache.prefetch_ready(rid)
                digests.append(agree_view(cache, group, f"prefetch {i}"))
                if ready:
                    break
                time.sleep(0.001)
            else:
                raise AssertionError(f"rank {rank}: prefetch {rid} never ended")
        checked += check_kv(cache, ex, [tokens], kv_rank)
        cache.check_invariants()
        digests.append(agree_view(cache, group, f"read {i}"))
    settle(cache, ex, tier, group, "end")
    digests.append(stored)
    return digests, checked


def storage_property(rank: int, world: int, pg, url: str, mla: bool, examples: int,
                     stop_policy: str = "wait_complete") -> list[int]:
    group = RankGroup(pg, timeout_s=120.0)  # a safety stop only
    seen: list[int] = []

    @settings(QUIET, max_examples=examples)
    @given(seed=st.integers(0, 10_000), share=st.sampled_from([0.3, 0.7, 1.0]),
           set_fail_rank=st.integers(-1, world - 1), miss_rank=st.integers(-1, world - 1),
           short_rank=st.integers(-1, world - 1), set_fault=st.sampled_from(["short", "raise"]))
    @example(seed=1, share=0.7, set_fail_rank=world - 1, miss_rank=world - 1, short_rank=0, set_fault="raise")
    def prop(seed, share, set_fail_rank, miss_rank, short_rank, set_fault):
        run_url = url if not url.startswith("file://") else f"{url}/{seed}-{set_fail_rank}-{miss_rank}-{short_rank}"
        digests, checked = run_storage(rank, world, group, run_url, mla, seed, share, set_fail_rank, miss_rank,
                                       short_rank, stop_policy, set_fault)
        seen.extend(digests)
        seen.append(checked)

    prop()
    return seen


def fed_differently(rank: int, world: int, pg) -> str:
    """Rank 1 serves one request more than the others: the next poll raises RanksDiverged, nobody hangs."""
    from hicache_fsm.errors import RanksDiverged

    group = RankGroup(pg, timeout_s=120.0)  # a safety stop only: divergence is seen by digest, not by time
    cache, ex = make_cache(group)
    reqs = prompts(3, 4)
    for tokens in reqs[:3]:
        serve(cache, tokens, rank)
        cache.poll()
        ex.complete_all()
        cache.poll()
    if rank == 1:
        serve(cache, reqs[3], rank)  # its backup job is one pending job the others do not have
    try:
        cache.poll()
    except RanksDiverged as exc:
        return type(exc).__name__
    return "no error"


def attach_alone(rank: int, world: int, pg, others_poll: bool) -> tuple[str, str, bool]:
    """Rank 0 attaches storage while the others poll (or leave): typed errors, no process dies.

    Returns (what rank 0's attach or another rank's poll raised, what the next agreed step
    gave: the view digest agreed or the error, whether this rank has a storage tier).
    """
    from hicache_fsm.errors import HiCacheError

    group = RankGroup(pg, timeout_s=10.0)
    cache, ex = make_cache(group)
    for tokens in prompts(5, 2):
        serve(cache, tokens, rank)
        drain(cache, ex)
    agree_view(cache, group, "warm-up")
    outcome = "no error"
    try:
        if rank == 0:
            cache.attach_storage("memory://", prefetch_threshold=PAGE)
        elif others_poll:
            cache.poll()
        else:
            return "left", "", cache.storage is not None
    except HiCacheError as exc:
        outcome = type(exc).__name__
    if not others_poll:
        return outcome, "", cache.storage is not None
    serve(cache, prompts(6, 1)[0], rank)  # the group goes on: same requests, same trees
    drain(cache, ex)
    return outcome, str(agree_view(cache, group, "after the lone attach")), cache.storage is not None
