"""A multi-turn chat workload run through ``HiCache`` with real KV tensors.

The workload has the shape of SGLang's multi-turn benchmark: ``clients``
conversations of ``rounds`` turns each. A request is the shared system prompt,
then the client's history (every earlier user turn and answer), then a new user
turn of ``request_length`` tokens; the answer is ``output_length`` greedy tokens
of the model, appended to the history. The model is
:class:`~hicache_fsm.model.TinyModel` (``tiny``) or a Hugging Face Llama
(``llama``, :class:`~hicache_fsm.llama_model.LlamaModel`: grouped-query
attention, rotary positions, random weights), both behind
:class:`~hicache_fsm.model.KVModel`.

Every request goes through an engine step loop over the cache (see
``hicache_fsm.cache``): ``match_prefix``; with storage attached, ``prefetch`` of
the part beyond the in-memory hit, polled until ready, then a second match;
``load_back`` of the host part; ``lock``; for each layer, the load's
``wait(layer)`` and then a read of that layer's KV from the device pool;
``alloc_device`` for the tokens to compute; the model's prefill over the rest
with the cached KV as its past; decode; the new KV written into the slots;
``insert``; ``unlock``; ``poll``.

Several cache configurations run the same requests in one run: device only,
device + host, device + host + storage, and an infinite cache (pools that hold
everything) as the bound. A cache-free run comes first and gives the reference
answers: every configuration must produce the same greedy tokens (checked token
by token; the reference tokens are then fed back, so every configuration sees
the same token stream).

KV check. Float kernels give results that depend on how a sequence is chunked
(a prefix computed in one piece or in two differs in the last bits), so the
reference for a page is the KV the model wrote for it in this configuration,
not a fresh recomputation. Each page is keyed by its whole prefix (a chained
hash of the tokens up to and including it: the client's history, the system
prompt being the shared start of every history); every KV the engine hands to
the cache is recorded under those keys, and every page the cache serves must
equal, bit for bit, a KV recorded for that prefix. A page recomputed after its
copy was dropped is recorded again (one more accepted version).

``run_simulation`` returns a :class:`Simulation`; ``hit_rate_sweep`` replays the
reference token stream without the model (a one-element KV shape) to map hit
rate against device and host capacity for ``--plot``.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import sys
import tempfile
import time
from typing import Callable, Hashable, Sequence, TextIO

import attrs
import torch

from hicache_fsm.cache import HiCache
from hicache_fsm.config import CacheConfig
from hicache_fsm.errors import ConfigError
from hicache_fsm.executors import TorchExecutor
from hicache_fsm.model import KVModel, TinyModel
from hicache_fsm.pools import LAYOUTS, DeviceKVPool, HostKVPool, KVShape, PoolConfig, build_pools, default_device
from hicache_fsm.tp import RankGroup, rank_view, view_digest

ARRIVALS = ("round-robin", "random")
MODELS = ("tiny", "llama")
NEVER = 1 << 62  # a write_through_selective threshold no node reaches: nothing is backed up
# A sequential engine waits for its prefetch; any full page is worth fetching (recompute is the alternative).
STORAGE_OPTIONS = {"stop_policy": "wait_complete"}
PREFETCH_TIMEOUT_S = 10.0  # a prefetch still running then is aborted (counted in prefetch_timeouts)
PREFETCH_POLL_S = 0.0005  # seconds between polls while a prefetch runs

Observer = Callable[[str, HiCache], None]

DEVICE = "device"
DEVICE_HOST = "device+host"
FULL = "device+host+storage"
INFINITE = "infinite"


def _positive_int(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _check_device(name: object) -> None:
    try:
        dev = torch.device(name)  # type: ignore[arg-type]
    except (RuntimeError, TypeError):
        raise ConfigError(f"device must be cpu, cuda or cuda:N, got {name!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device must be cpu, cuda or cuda:N, got {name!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name!r} requested but CUDA is not available (this torch has no usable GPU)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device {name!r} requested but only {torch.cuda.device_count()} GPUs are visible")


# ====================================================================== workload


@attrs.frozen
class Workload:
    """The requests: who asks what, in which order (token ids only)."""

    clients: int = 8
    rounds: int = 4
    request_length: int = 128
    output_length: int = 32
    system_prompt_length: int = 256
    arrival: str = "round-robin"
    seed: int = 0
    vocab: int = 256

    def __attrs_post_init__(self) -> None:
        _positive_int("clients", self.clients)
        _positive_int("rounds", self.rounds)
        _positive_int("request_length", self.request_length)
        _positive_int("output_length", self.output_length)
        _positive_int("system_prompt_length", self.system_prompt_length, 0)
        _positive_int("vocab", self.vocab, 2)
        if self.arrival not in ARRIVALS:
            raise ConfigError(f"arrival must be one of {', '.join(ARRIVALS)}, got {self.arrival!r}")

    @property
    def requests(self) -> int:
        return self.clients * self.rounds

    def _tokens(self, n: int, *salt: int) -> list[int]:
        rng = random.Random(":".join(map(str, (self.seed, *salt))))
        return [rng.randrange(self.vocab) for _ in range(n)]

    def system_prompt(self) -> list[int]:
        return self._tokens(self.system_prompt_length, -1)

    def user_turn(self, client: int, round_: int) -> list[int]:
        return self._tokens(self.request_length, client, round_)

    def schedule(self) -> list[tuple[int, int]]:
        """(client, round) in arrival order; a client's rounds always come in order."""
        if self.arrival == "round-robin":
            return [(c, r) for r in range(self.rounds) for c in range(self.clients)]
        rng = random.Random(f"{self.seed}:arrival")
        done = [0] * self.clients
        out = []
        while len(out) < self.requests:
            c = rng.choice([c for c in range(self.clients) if done[c] < self.rounds])
            out.append((c, done[c]))
            done[c] += 1
        return out

    def max_tokens(self) -> int:
        """Tokens of every client's full history (what an infinite cache holds at most)."""
        per_client = self.rounds * (self.request_length + self.output_length)
        return self.system_prompt_length + self.clients * per_client


@attrs.frozen
class Reference:
    """The cache-free run: each request's prompt and greedy answer."""

    prompts: dict[tuple[int, int], tuple[int, ...]]
    outputs: dict[tuple[int, int], tuple[int, ...]]
    prompt_tokens: int
    seconds: float


def reference_run(model: KVModel, workload: Workload, on_request: Callable[[], None] = lambda: None) -> Reference:
    """Run every request from scratch (no cache) and keep prompts and answers."""
    start = time.perf_counter()
    system = workload.system_prompt()
    history = {c: list(system) for c in range(workload.clients)}
    prompts, outputs = {}, {}
    total = 0
    for c, r in workload.schedule():
        prompt = history[c] + workload.user_turn(c, r)
        out = model.generate(prompt, workload.output_length)
        prompts[(c, r)] = tuple(prompt)
        outputs[(c, r)] = tuple(out)
        total += len(prompt)
        history[c] = prompt + out
        on_request()
    return Reference(prompts, outputs, total, time.perf_counter() - start)


def token_stream(workload: Workload, outputs: dict[tuple[int, int], Sequence[int]]) -> Reference:
    """The prompts a given set of answers leads to (no model needed)."""
    system = workload.system_prompt()
    history = {c: list(system) for c in range(workload.clients)}
    prompts = {}
    total = 0
    for c, r in workload.schedule():
        prompt = history[c] + workload.user_turn(c, r)
        prompts[(c, r)] = tuple(prompt)
        total += len(prompt)
        history[c] = prompt + list(outputs[(c, r)])
    return Reference(prompts, dict(outputs), total, 0.0)


# ====================================================================== configurations


@attrs.frozen
class Tier:
    """One cache configuration of the comparison."""

    name: str
    device_tokens: int
    host_tokens: int
    storage_url: str | None = None
    write_policy: str = "write_through"
    write_through_threshold: int = 2
    has_host: bool = True  # False: no host tier (its pool is one unused page, so no size rule applies)

    def cache_config(self) -> CacheConfig:
        return CacheConfig(write_policy=self.write_policy, write_through_threshold=self.write_through_threshold)

    def pools(self, shape: KVShape, page_size: int, layout: str, device: str) -> tuple[DeviceKVPool, HostKVPool]:
        """This configuration's device and host pools (without a host tier, a host pool nothing writes)."""
        if self.has_host:
            pools = build_pools(PoolConfig(shape, self.device_tokens, page_size, layout,
                                           host_tokens=self.host_tokens, device=device))
            return pools.device, pools.host
        return DeviceKVPool(shape, self.device_tokens, page_size, device), HostKVPool(shape, self.host_tokens, page_size, layout)


def device_only(name: str, device_tokens: int, page_size: int) -> Tier:
    """No host tier: a one-page host pool that nothing is ever written to."""
    return Tier(name, device_tokens, page_size, None, "write_through_selective", NEVER, has_host=False)


def storage_available() -> bool:
    return all(hasattr(HiCache, name) for name in ("attach_storage", "prefetch", "prefetch_ready"))


# ====================================================================== timing


class _Clock:
    """Seconds inside HiCache calls and inside the executor (a subset of them).

    ``by_call`` splits the controller time by HiCache method, executor time excluded.
    """

    def __init__(self) -> None:
        self.controller = 0.0
        self.executor = 0.0
        self.by_call: dict[str, float] = {}

    def call(self, fn, *args, **kwargs):
        start, copies = time.perf_counter(), self.executor
        try:
            return fn(*args, **kwargs)
        finally:
            spent = time.perf_counter() - start
            self.controller += spent
            name = getattr(fn, "__name__", "?")
            self.by_call[name] = self.by_call.get(name, 0.0) + spent - (self.executor - copies)


class TimedExecutor:
    """Wraps an executor and adds the time of its calls to a clock (transfer time)."""

    manual = False

    def __init__(self, inner, clock: _Clock) -> None:
        self._inner = inner
        self._clock = clock

    def _timed(self, fn, *args):
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._clock.executor += time.perf_counter() - start

    def submit(self, batch):
        return self._timed(self._inner.submit, batch)

    def poll(self):
        return self._timed(self._inner.poll)

    def synchronize(self) -> None:
        self._timed(self._inner.synchronize)

    def close(self) -> None:
        self._inner.close()

    def __getattr__(self, name):
        return getattr(self._inner, name)


# ====================================================================== KV oracle


class KVOracle:
    """Every KV page the engine wrote, keyed by its whole prefix; checks what the cache serves."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._pages: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.checked_pages = 0
        self.mismatched_pages = 0
        self.versions = 0

    def keys(self, tokens: Sequence[int], n_pages: int) -> list[int]:
        ps = self.page_size
        out, h = [], 0
        for i in range(n_pages):
            h = hash((h, tuple(tokens[i * ps : (i + 1) * ps])))
            out.append(h)
        return out

    def record(self, tokens: Sequence[int], start: int, end: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """KV ``k``/``v`` (layers, >= end, heads, dim) of ``tokens[start:end]`` was handed to the cache."""
        ps = self.page_size
        keys = self.keys(tokens, end // ps)
        for p in range(start // ps, end // ps):
            kp, vp = k[:, p * ps : (p + 1) * ps], v[:, p * ps : (p + 1) * ps]
            versions = self._pages.setdefault(keys[p], [])
            if not any(torch.equal(kp, a) and torch.equal(vp, b) for a, b in versions):
                versions.append((kp.clone(), vp.clone()))
                self.versions += 1

    def check(self, tokens: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> int:
        """Pages of ``k``/``v`` (the served prefix of ``tokens``) that match no recorded KV."""
        ps = self.page_size
        n_pages = k.shape[1] // ps
        bad = 0
        for p, key in enumerate(self.keys(tokens, n_pages)):
            kp, vp = k[:, p * ps : (p + 1) * ps], v[:, p * ps : (p + 1) * ps]
            if not any(torch.equal(kp, a) and torch.equal(vp, b) for a, b in self._pages.get(key, ())):
                bad += 1
        self.checked_pages += n_pages
        self.mismatched_pages += bad
        return bad


# ====================================================================== results


@attrs.define
class TierResult:
    """What one configuration did over the whole workload."""

    name: str
    device_tokens: int
    host_tokens: int
    storage_url: str | None
    requests: int = 0
    prompt_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    computed_tokens: int = 0
    kv_checked_pages: int = 0
    kv_mismatches: int = 0
    output_tokens: int = 0
    output_mismatches: int = 0
    ranks_disagree: int = 0  # requests after which the ranks' trees differed (tensor parallelism)
    alloc_failures: int = 0
    load_back_skipped: int = 0
    prefetches: int = 0
    prefetch_timeouts: int = 0
    prefetch_wait_s: float = 0.0
    controller_s: float = 0.0
    agreement_s: float = 0.0  # of controller_s: agreeing with the other ranks (waiting for them included)
    transfer_s: float = 0.0
    model_s: float = 0.0
    wall_s: float = 0.0
    bytes: dict = attrs.Factory(dict)
    counters: dict = attrs.Factory(dict)
    controller_by_call: dict = attrs.Factory(dict)

    @property
    def hit_tokens(self) -> int:
        return self.device_hit_tokens + self.host_hit_tokens + self.storage_hit_tokens

    def rate(self, tokens: int) -> float:
        return tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def hit_rate(self) -> float:
        return self.rate(self.hit_tokens)

    @property
    def controller_us_per_request(self) -> float:
        return self.controller_s / self.requests * 1e6 if self.requests else 0.0

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "device_tokens": self.device_tokens,
            "host_tokens": self.host_tokens,
            "storage": self.storage_url is not None,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "hit_rate": round(self.hit_rate, 4),
            "hit_rate_device": round(self.rate(self.device_hit_tokens), 4),
            "hit_rate_host": round(self.rate(self.host_hit_tokens), 4),
            "hit_rate_storage": round(self.rate(self.storage_hit_tokens), 4),
            "prefill_tokens_saved": self.hit_tokens,
            "prefill_tokens_computed": self.computed_tokens,
            "bytes": dict(self.bytes),
            "kv_checked_pages": self.kv_checked_pages,
            "kv_mismatches": self.kv_mismatches,
            "output_tokens": self.output_tokens,
            "output_mismatches": self.output_mismatches,
            "ranks_disagree": self.ranks_disagree,
            "alloc_failures": self.alloc_failures,
            "load_back_skipped": self.load_back_skipped,
            "prefetches": self.prefetches,
            "prefetch_timeouts": self.prefetch_timeouts,
            "prefetch_wait_ms": round(self.prefetch_wait_s * 1e3, 2),
            "controller_us_per_request": round(self.controller_us_per_request, 1),
            "agreement_us_per_request": round(self.agreement_s / self.requests * 1e6, 1) if self.requests else 0.0,
            "controller_us_per_request_by_call": {
                k: round(v / self.requests * 1e6, 1) for k, v in sorted(self.controller_by_call.items())
            } if self.requests else {},
            "transfer_ms": round(self.transfer_s * 1e3, 2),
            "model_s": round(self.model_s, 3),
            "wall_s": round(self.wall_s, 3),
        }


@attrs.define
class Simulation:
    """Every configuration's result plus the workload and the cache-free reference."""

    workload: Workload
    page_size: int
    layout: str
    device: str
    tiers: list[TierResult]
    reference_s: float
    wall_s: float
    storage_skipped: str | None = None
    reference: Reference | None = attrs.field(default=None, repr=False)
    model: str = "tiny"  # which of MODELS served the requests
    model_name: str = ""  # its geometry, dtype and seed (KVModel.name)
    tp: int = 1
    rank_tiers: list[list[TierResult]] = attrs.Factory(list)  # with tp > 1: every rank's results, by rank

    def tier(self, name: str) -> TierResult | None:
        return next((t for t in self.tiers if t.name == name), None)

    @property
    def hierarchy(self) -> TierResult:
        """The fullest real hierarchy of the run (with storage when it ran)."""
        return self.tier(FULL) or self.tier(DEVICE_HOST) or self.tiers[0]

    def _all_tiers(self) -> list[TierResult]:
        return [t for tiers in self.rank_tiers for t in tiers] if self.rank_tiers else self.tiers

    @property
    def kv_mismatches(self) -> int:
        return sum(t.kv_mismatches for t in self._all_tiers())

    @property
    def output_mismatches(self) -> int:
        return sum(t.output_mismatches for t in self._all_tiers())

    @property
    def ranks_agree(self) -> bool:
        return all(t.ranks_disagree == 0 for t in self._all_tiers())

    def as_dict(self) -> dict:
        full = self.hierarchy
        bound = self.tier(INFINITE)
        return {
            "hit_rate": round(full.hit_rate, 4),
            "hit_rate_bound": round(bound.hit_rate, 4) if bound else None,
            "hierarchy": full.name,
            "kv_mismatches": self.kv_mismatches,
            "output_mismatches": self.output_mismatches,
            "requests": self.workload.requests,
            "controller_us_per_request": round(full.controller_us_per_request, 1),
            "configs": {t.name: t.as_dict() for t in self.tiers},
            "workload": attrs.asdict(self.workload),
            "page_size": self.page_size,
            "layout": self.layout,
            "device": self.device,
            "model": self.model,
            "model_name": self.model_name,
            "storage_skipped": self.storage_skipped,
            "reference_s": round(self.reference_s, 3),
            "wall_s": round(self.wall_s, 3),
            "tp": self.tp,
            "ranks_agree": self.ranks_agree,
            "ranks": [
                {"rank": r, "configs": {t.name: {k: v for k, v in t.as_dict().items() if k in _PER_RANK}
                                        for t in tiers}}
                for r, tiers in enumerate(self.rank_tiers)
            ],
        }


_PER_RANK = ("hit_rate", "kv_checked_pages", "kv_mismatches", "output_mismatches", "ranks_disagree",
             "controller_us_per_request", "agreement_us_per_request", "transfer_ms", "bytes", "wall_s")


# ====================================================================== tensor parallelism


class Shard:
    """This process's part of a tensor-parallel run: its rank, its heads and the group.

    The cache of each rank holds only its heads' KV. The engine gathers the
    served KV of every rank (an all-gather along the heads) and runs the whole
    model on it, so every rank computes the answers of the one-rank run, bit
    for bit; only the KV is sharded.
    """

    def __init__(self, group: RankGroup, heads: int) -> None:
        if heads % group.size:
            raise ConfigError(f"{heads} heads cannot be split over {group.size} ranks")
        self.group = group
        self.rank, self.world = group.rank, group.size
        per = heads // group.size
        self.heads = slice(self.rank * per, (self.rank + 1) * per)
        self.local_heads = per

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """(layers, n, local heads, dim) of every rank -> (layers, n, all heads, dim)."""
        return torch.cat(self.group.all_gather(t), dim=2)

    def agree_view(self, cache: HiCache) -> bool:
        """Whether every rank's tree equals this one's (one collective)."""
        return self.group.same(view_digest(rank_view(cache)))


# ====================================================================== the engine loop


def prefetch_and_wait(clock, cache: HiCache, res: TierResult, rid: Hashable, tokens: tuple, m,
                      agreed: Callable[[bool], bool] = bool, poll_s: float = PREFETCH_POLL_S):
    """Prefetch what storage adds to ``m``, wait for it, and return the new match.

    The wait is not controller time of this request (a real scheduler serves
    other requests meanwhile): ``clock``'s totals are restored after it and the
    wait is counted in ``res.prefetch_wait_s``. ``agreed`` turns "give up now"
    into the whole rank group's decision.
    """
    call = clock.call
    if not call(cache.prefetch, rid, tokens, m):
        return m
    res.prefetches += 1
    start, c0, e0, b0 = time.perf_counter(), clock.controller, clock.executor, dict(clock.by_call)
    while not call(cache.prefetch_ready, rid):
        if agreed(time.perf_counter() > start + PREFETCH_TIMEOUT_S):
            res.prefetch_timeouts += 1
            call(cache.abort_prefetch, rid)
            break
        time.sleep(poll_s)
        call(cache.poll)
    clock.controller, clock.executor, clock.by_call = c0, e0, b0
    res.prefetch_wait_s += time.perf_counter() - start
    return call(cache.match_prefix, tokens)


def fetch_prefix(call: Callable, cache: HiCache, tokens: tuple, cacheable: int,
                 prefetch: Callable | None, res: TierResult) -> tuple:
    """An engine step's first half: match, prefetch what storage may add, load back what the host holds.

    ``call`` wraps each cache call (timing); ``prefetch(tokens, match)`` returns
    the match after a prefetch and is used when the memory tiers hold fewer than
    ``cacheable`` tokens. Counts the served tokens by the tier that held them
    and returns ``(match, load_back or None, served device indices)``.
    """
    m = call(cache.match_prefix, tokens)
    first_device, first_host = m.device_hit_length, m.host_hit_length
    if prefetch is not None and first_device + first_host < cacheable:
        m = prefetch(tokens, m)
    lb = call(cache.load_back, m.last_host_node) if m.host_hit_length else None
    if m.host_hit_length and lb is None:
        res.load_back_skipped += 1
    served = m.device_indices if lb is None else torch.cat([m.device_indices, lb.device_indices])
    n_served = int(served.numel())
    device_part = min(first_device, n_served)
    host_part = min(first_host, n_served - device_part)
    res.device_hit_tokens += device_part
    res.host_hit_tokens += host_part
    res.storage_hit_tokens += n_served - device_part - host_part
    return m, lb, served


class _Engine:
    """Serves requests one at a time through a HiCache, the way an engine's step loop would."""

    def __init__(self, tier: Tier, workload: Workload, model: KVModel | None, page_size: int, layout: str,
                 device: str, storage_options: dict | None = None, observe: Observer | None = None,
                 shard: Shard | None = None) -> None:
        self.tier = tier
        self.workload = workload
        self.model = model
        self.ps = page_size
        self.clock = _Clock()
        self.shard = shard
        shape = model.kv_shape if model is not None else KVShape(1, 1, 2)
        if shard is not None:
            shape = KVShape(shape.layers, shard.local_heads, shape.head_dim, shape.dtype)
        device_pool, host_pool = tier.pools(shape, page_size, layout, device)
        self.pool = device_pool
        executor = TimedExecutor(TorchExecutor(device_pool, host_pool), self.clock)
        self.cache = HiCache(device_pool, host_pool, tier.cache_config(), executor,
                             group=shard.group if shard is not None else None)
        self.oracle = KVOracle(page_size) if model is not None else None
        self.result = TierResult(tier.name, tier.device_tokens, tier.host_tokens, tier.storage_url)
        self.storage = False
        if tier.storage_url is not None:
            model_name = model.name if model is not None else f"tokens-only-s{workload.seed}"
            options = dict(STORAGE_OPTIONS, model=model_name, prefetch_threshold=page_size)
            if shard is not None:
                options.update(tp_rank=shard.rank, tp_size=shard.world)
            options.update(storage_options or {})
            self.cache.attach_storage(tier.storage_url, **options)  # setup, not per-request controller time
            self.storage = True
        if observe is not None:
            observe(tier.name, self.cache)
        self._next_request = 0
        self._untimed_agreement_s = 0.0  # agreeing inside waits that are not controller time

    # ------------------------------------------------------------------ one request

    def serve(self, prompt: Sequence[int], answer: Sequence[int]) -> None:
        call = self.clock.call
        cache, ps, res = self.cache, self.ps, self.result
        res.requests += 1
        res.prompt_tokens += len(prompt)
        prompt = tuple(prompt)
        aligned_prompt = len(prompt) // ps * ps

        m, lb, served = fetch_prefix(call, cache, prompt, aligned_prompt, self._prefetch if self.storage else None, res)
        node = lb.last_node if lb is not None else m.last_device_node
        call(cache.lock, node)
        try:
            n_served = int(served.numel())

            out_len = len(answer)
            kv_len = len(prompt) + out_len - 1  # the last answer token is never run through the model
            aligned = kv_len // ps * ps
            n_new = aligned - n_served
            new = call(cache.alloc_device, n_new) if n_new > 0 else None
            if n_new > 0 and new is None:
                res.alloc_failures += 1

            past_k, past_v = self._read_past(m, lb, served)
            if self.model is None:
                res.computed_tokens += len(prompt) - n_served
            else:
                start = time.perf_counter()
                k, v = self._compute(prompt, answer, past_k, past_v)
                res.model_s += time.perf_counter() - start
                if n_served:
                    bad = self.oracle.check(prompt, *self._mine(past_k, past_v))
                    res.kv_mismatches += bad
                if new is not None:
                    k, v = self._mine(k, v)
                    self.pool.write(new, None, k[:, n_served:aligned], v[:, n_served:aligned])
                    self.oracle.record(prompt + tuple(answer), n_served, aligned, k, v)
            if new is not None:
                indices = new if not n_served else torch.cat([served, new])
                call(cache.insert, (prompt + tuple(answer))[:aligned], indices)
        finally:
            call(cache.unlock, node)
        call(cache.poll)
        if self.shard is not None and not self.shard.agree_view(cache):
            res.ranks_disagree += 1

    def _mine(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's heads of full-model KV (all of it without tensor parallelism)."""
        if self.shard is None:
            return k, v
        h = self.shard.heads
        return k[:, :, h].contiguous(), v[:, :, h].contiguous()

    def _agreed(self, flag: bool) -> bool:
        """``flag`` on every rank (the engine's own decisions, such as giving up on a prefetch)."""
        return flag if self.shard is None else self.shard.group.all_true(flag)

    def _prefetch(self, prompt: tuple, m):
        rid = f"req-{self._next_request}"
        self._next_request += 1
        a0 = self.cache.agreement.seconds
        m = prefetch_and_wait(self.clock, self.cache, self.result, rid, prompt, m, self._agreed)
        self._untimed_agreement_s += self.cache.agreement.seconds - a0
        return m

    def _read_past(self, m, lb, served: torch.Tensor):
        """Per layer: wait for that layer's loads, then read it (as a forward pass would)."""
        if not served.numel():
            return None, None
        if self.model is None:
            for layer in range(self.pool.layers):
                self.clock.call(m.wait, layer)
                if lb is not None:
                    self.clock.call(lb.wait, layer)
            return None, None
        if self.shard is not None:  # this rank's heads, then every rank's: the whole model's past
            k, v = self._read_layers(m, lb, served)
            return self.shard.gather(k), self.shard.gather(v)
        return self._read_layers(m, lb, served)

    def _read_layers(self, m, lb, served: torch.Tensor):
        idx = served.to(self.pool.device)
        ks, vs = [], []
        for layer in range(self.pool.layers):
            self.clock.call(m.wait, layer)
            if lb is not None:
                self.clock.call(lb.wait, layer)
            ks.append(self.pool.k[layer].index_select(0, idx))
            vs.append(self.pool.v[layer].index_select(0, idx))
        return torch.stack(ks), torch.stack(vs)

    def _compute(self, prompt: tuple, answer: Sequence[int], past_k, past_v):
        """Prefill the uncached part, then decode the answer with the reference tokens fed back.

        Returns K and V of ``prompt + answer[:-1]`` (layers, tokens, heads, dim).
        """
        model, res = self.model, self.result
        n_past = 0 if past_k is None else past_k.shape[1]
        if n_past == len(prompt):  # everything cached: run the last token again for its logits
            n_past -= 1
        pk = past_k[:, :n_past] if n_past else None
        pv = past_v[:, :n_past] if n_past else None
        logits, k, v = model.prefill(prompt[n_past:], pk, pv)
        res.computed_tokens += len(prompt) - n_past
        k_all = k if pk is None else torch.cat([pk, k], 1)
        v_all = v if pv is None else torch.cat([pv, v], 1)
        if past_k is not None and past_k.shape[1] > n_past:  # keep the cache's KV for the re-run token
            k_all = torch.cat([past_k, k_all[:, past_k.shape[1]:]], 1)
            v_all = torch.cat([past_v, v_all[:, past_v.shape[1]:]], 1)
        for j, tok in enumerate(answer):
            res.output_tokens += 1
            if int(torch.argmax(logits)) != tok:
                res.output_mismatches += 1
            if j == len(answer) - 1:
                break
            logits, k, v = model.prefill([tok], k_all, v_all)
            k_all = torch.cat([k_all, k], 1)
            v_all = torch.cat([v_all, v], 1)
        return k_all, v_all

    # ------------------------------------------------------------------ wrap up

    def finish(self) -> TierResult:
        cache, res = self.cache, self.result
        a0 = cache.agreement.seconds
        if self.storage:
            deadline = time.perf_counter() + 10.0
            while cache.pending_job_ids() and self._agreed(time.perf_counter() < deadline):  # backups land (untimed)
                cache.poll()
                time.sleep(0.001)
        counters = cache.stats()
        res.counters = {k: v for k, v in counters.items() if isinstance(v, (int, float))}
        res.bytes = {kind: int(counters.get(f"bytes_{kind}", 0)) for kind in ("d2h", "h2d")}
        storage = counters.get("storage")
        if isinstance(storage, dict):
            backend = storage.get("backend_stats") or {}
            res.bytes["h2s"] = int(backend.get("bytes_written", counters.get("bytes_h2s", 0)))
            res.bytes["s2h"] = int(backend.get("bytes_read", 0))
        res.kv_checked_pages = self.oracle.checked_pages if self.oracle else 0
        res.controller_s = max(0.0, self.clock.controller - self.clock.executor)
        res.transfer_s = self.clock.executor
        res.agreement_s = a0 - self._untimed_agreement_s
        res.controller_by_call = dict(self.clock.by_call)
        cache.check_invariants()
        cache.close()
        return res


def run_tier(tier: Tier, workload: Workload, reference: Reference, model: KVModel | None, page_size: int,
             layout: str = "page_first", device: str | None = None, storage_options: dict | None = None,
             on_request: Callable[[], None] = lambda: None, observe: Observer | None = None,
             shard: Shard | None = None) -> TierResult:
    """Serve the reference's requests through one configuration (``model=None``: tokens only, no KV).

    With ``shard`` this process is one rank of a tensor-parallel group (see ``Shard``).
    """
    start = time.perf_counter()
    engine = _Engine(tier, workload, model, page_size, layout, device or "cpu", storage_options, observe, shard)
    try:
        for key in workload.schedule():
            engine.serve(reference.prompts[key], reference.outputs[key])
            on_request()
    except BaseException:
        engine.cache.close()
        raise
    result = engine.finish()
    result.wall_s = time.perf_counter() - start
    return result


# ====================================================================== the whole comparison


@attrs.frozen
class Options:
    """Everything ``hicache-fsm simulate`` takes."""

    workload: Workload = Workload()
    device_tokens: int = 1024
    host_tokens: int = 3072
    storage_url: str | None = None  # None: a file:// directory in a fresh temporary directory
    storage: bool = True
    page_size: int = 16
    layout: str = "page_first"
    device: str | None = None  # None: CUDA when present, else CPU
    model: str = "tiny"  # one of MODELS
    model_layers: int = 4
    model_heads: int = 2  # KV heads per layer (tiny: also its query heads)
    model_head_dim: int = 16
    model_query_heads: int = 4  # llama only: query heads, sharing the model_heads KV heads (grouped-query)
    tp: int = 1  # rank processes, each caching its shard of the heads

    def __attrs_post_init__(self) -> None:
        if self.model not in MODELS:
            raise ConfigError(f"model must be one of {', '.join(MODELS)}, got {self.model!r}")
        ps = _positive_int("page_size", self.page_size)
        _positive_int("model_heads", self.model_heads)
        if _positive_int("tp", self.tp) > 1 and self.model != "tiny":
            raise ConfigError(f"--tp {self.tp} runs the tiny model only; --model {self.model} is not sharded across ranks")
        if self.tp > 1 and self.model_heads % self.tp:
            raise ConfigError(f"--tp {self.tp} needs a head count it divides; the model has {self.model_heads} "
                              f"heads (raise --model-heads)")
        for name in ("device_tokens", "host_tokens"):
            value = _positive_int(name, getattr(self, name))
            if value % ps:
                raise ConfigError(f"{name} {value} is not a multiple of page_size {ps}")
        if self.host_tokens <= self.device_tokens:
            raise ConfigError(
                f"host_tokens {self.host_tokens} must be larger than device_tokens {self.device_tokens}: "
                "the host tier keeps a copy of everything on the device, so a host pool no larger "
                "than the device loses hits instead of adding them")
        if self.device is not None:
            _check_device(self.device)
        if self.layout not in LAYOUTS:
            raise ConfigError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        per_request = self.workload.system_prompt_length + self.workload.rounds * (
            self.workload.request_length + self.workload.output_length)
        if self.device_tokens < per_request:
            raise ConfigError(
                f"device_tokens {self.device_tokens} cannot hold one conversation "
                f"({per_request} tokens); raise --device-tokens or shorten the workload")

    def infinite_tokens(self) -> int:
        n = self.workload.max_tokens() + self.workload.requests * self.page_size
        return math.ceil(n / self.page_size) * self.page_size

    def tiers(self, storage_url: str | None) -> list[Tier]:
        ps = self.page_size
        out = [
            device_only(DEVICE, self.device_tokens, ps),
            Tier(DEVICE_HOST, self.device_tokens, self.host_tokens),
        ]
        if storage_url is not None:
            out.append(Tier(FULL, self.device_tokens, self.host_tokens, storage_url))
        big = self.infinite_tokens()
        out.append(Tier(INFINITE, big, big + ps))
        return out


def build_model(options: Options, device: str) -> KVModel:
    """The model ``options.model`` names, with seeded random weights, on ``device``.

    The Llama runs in float64: a prefix computed in one piece or in two (past
    from the cache, then the rest) may differ in the last bits; in float64 that
    is many orders of magnitude below the gap between the two best logits, so a
    greedy answer does not flip on a near tie (in float32 it could, rarely).
    """
    w = options.workload
    if options.model == "tiny":
        return TinyModel(options.model_layers, options.model_heads, options.model_head_dim, vocab=w.vocab,
                         seed=w.seed, device=device)
    try:
        from hicache_fsm.llama_model import LlamaModel
    except ImportError as exc:
        raise ConfigError(f"model 'llama' needs transformers ({exc}); install the extra: "
                          "pip install -e '.[llama]'") from None
    return LlamaModel(options.model_layers, options.model_query_heads, options.model_heads, options.model_head_dim,
                      vocab=w.vocab, seed=w.seed, dtype=torch.float64, device=device)


class Progress:
    """A one-line progress bar on a terminal (no output when the stream is not one)."""

    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool | None = None, width: int = 30) -> None:
        self.total = max(1, total)
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.width = width
        self.label = ""
        self._last = 0.0

    def step(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if self.enabled and (now - self._last > 0.1 or self.done >= self.total):
            self._last = now
            filled = int(self.width * self.done / self.total)
            bar = "#" * filled + "." * (self.width - filled)
            self.stream.write(f"\r[{bar}] {self.done}/{self.total} {self.label:<22}")
            self.stream.flush()

    def set_label(self, label: str) -> None:
        self.label = label
        self.step(0)

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * (self.width + 40) + "\r")
            self.stream.flush()


def run_simulation(options: Options = Options(), progress: Progress | None = None,
                   storage_options: dict | None = None, observe: Observer | None = None) -> Simulation:
    """Run the cache-free reference and every configuration on the same requests.

    ``observe(tier_name, cache)`` is called with each configuration's cache before
    its first request (to record a trace or count transitions). With ``options.tp`` > 1
    every configuration runs on that many rank processes (see ``simulate_tp``).
    """
    start = time.perf_counter()
    w = options.workload
    device = options.device or str(default_device())
    model = build_model(options, device)
    storage_skipped = None
    tmp = None
    storage_url = None
    if options.storage:
        if not storage_available():
            storage_skipped = "this build of HiCache has no storage tier (attach_storage)"
        elif options.storage_url is not None:
            storage_url = options.storage_url
        else:
            tmp = tempfile.mkdtemp(prefix="hicache-sim-")
            storage_url = "file://" + os.path.join(tmp, "l3")
    tiers = options.tiers(storage_url)
    if progress is None:
        progress = Progress(w.requests * (len(tiers) + 1), enabled=False)
    else:
        progress.total = w.requests * (len(tiers) + 1)
    try:
        progress.set_label("cache-free reference")
        reference = reference_run(model, w, progress.step)
        rank_tiers: list[list[TierResult]] = []
        if options.tp > 1:
            from hicache_fsm.simulate_tp import run_ranks_tiers

            progress.set_label(f"{options.tp} ranks")
            rank_tiers = run_ranks_tiers(options, tiers, reference, device, storage_options)
            progress.step(w.requests * len(tiers))
            results = rank_tiers[0]
        else:
            results = []
            for tier in tiers:
                progress.set_label(tier.name)
                results.append(run_tier(tier, w, reference, model, options.page_size, options.layout, device,
                                        storage_options, progress.step, observe))
    finally:
        progress.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return Simulation(w, options.page_size, options.layout, device, results, reference.seconds,
                      time.perf_counter() - start, storage_skipped, reference, options.model, model.name,
                      options.tp, rank_tiers)


# ====================================================================== capacity sweep (for --plot)


def capacity_grid(options: Options) -> tuple[list[int], list[int]]:
    """Device sizes and host sizes to sweep: from one conversation (device) or one page (host) to everything."""
    ps = options.page_size
    w = options.workload
    one = w.system_prompt_length + w.rounds * (w.request_length + w.output_length)
    top = options.infinite_tokens()

    def pages(x: float) -> int:
        return max(ps, math.ceil(x / ps) * ps)

    devices = sorted({pages(one * f) for f in (1, 1.5, 2, 3, 4, 6, 8)} | {options.device_tokens})
    devices = [d for d in devices if d < top] + [top]
    hosts = sorted({pages(top * f) for f in (0.125, 0.25, 0.375, 0.5, 0.75, 1.0)} | {options.host_tokens})
    return devices, hosts


def sweep_hit_rate(options: Options, reference: Reference, device_tokens: int, host_tokens: int,
                   storage_url: str | None = None) -> float:
    """Token hit rate of the reference stream for one capacity (host 0 = device only).

    No model runs: a one-element KV shape and the reference answers; hit rates
    depend only on tokens and capacities.
    """
    ps = options.page_size
    if host_tokens == 0:
        tier = device_only("sweep", device_tokens, ps)
    else:
        tier = Tier("sweep", device_tokens, host_tokens, storage_url)
    return run_tier(tier, options.workload, reference, None, ps, options.layout, "cpu").hit_rate


def hit_rate_sweep(options: Options, reference: Reference, storage_url: str | None = None) -> dict[str, dict]:
    """Hit rate against device capacity (one line per host size) and against host capacity.

    Returns ``{"by_device": {label: [(device_tokens, rate)]}, "by_host": {label: [(host_tokens, rate)]},
    "skipped": [reason]}``; with ``storage_url`` each panel also has a line with storage added. Points
    whose host pool is not larger than the device pool cannot be configured; they are left out and
    ``skipped`` says which.
    """
    devices, hosts = capacity_grid(options)
    skipped: list[str] = []

    def line(points: list[tuple[int, int]], x: int, storage: str | None = None) -> list[tuple[int, float]]:
        """Hit rate at each (device, host) point, keyed by its ``x``-th coordinate."""
        out = []
        for point in points:
            d, h = point
            if 0 < h <= d:
                skipped.append(f"device {d} / host {h}: the host pool must be larger than the device pool")
            else:
                out.append((point[x], sweep_hit_rate(options, reference, d, h, storage)))
        return out

    by_device: dict[str, list[tuple[int, float]]] = {}
    for host in (0, *sorted({hosts[1], options.host_tokens, hosts[-3]})):
        label = "device only" if host == 0 else f"host {host}"
        by_device[label] = line([(d, host) for d in devices], 0)
    if storage_url is not None:
        by_device[f"host {options.host_tokens} + storage"] = line(
            [(d, options.host_tokens) for d in devices], 0, storage_url)
    by_host: dict[str, list[tuple[int, float]]] = {}
    dev = options.device_tokens
    by_host[f"device {dev}"] = line([(dev, h) for h in hosts], 1)
    if storage_url is not None:
        by_host[f"device {dev} + storage"] = line([(dev, h) for h in hosts], 1, storage_url)
    return {"by_device": by_device, "by_host": by_host, "skipped": sorted(set(skipped))}


__all__ = [
    "ARRIVALS", "DEVICE", "DEVICE_HOST", "FULL", "INFINITE", "KVOracle", "MODELS", "Options", "Progress", "Reference",
    "Shard", "Simulation", "Tier", "TierResult", "TimedExecutor", "Workload", "build_model", "capacity_grid", "device_only", "fetch_prefix", "prefetch_and_wait",
    "hit_rate_sweep", "reference_run", "sweep_hit_rate", "run_simulation", "run_tier", "storage_available",
    "token_stream",
]
