"""The engine loop of ``simulate``: requests served one at a time through a HiCache with real KV.

Every request goes through the steps of an engine's loop over the cache (see
``hicache_fsm.cache``): ``match_prefix``; with storage attached, ``prefetch`` of
the part beyond the in-memory hit, polled until ready, then a second match;
``load_back`` of the host part; ``lock``; for each layer, the load's
``wait(layer)`` and then a read of that layer's KV from the device pool;
``alloc_device`` for the tokens to compute; the model's prefill over the rest
with the cached KV as its past; decode; the new KV written into the slots;
``insert``; ``unlock``; ``poll``. A request's ids are checked and packed once,
when it arrives (``pack_token_ids``), and grown by its answer for ``insert``
(only the answer's ids checked): every cache call takes the packed ids as they
are, and the packing is timed as controller time of its own.

KV check. Float kernels give results that depend on how a sequence is chunked
(a prefix computed in one piece or in two differs in the last bits), so the
reference for a page is the KV the model wrote for it in this configuration,
not a fresh recomputation. Each page is keyed by its whole prefix (a chained
hash of the tokens up to and including it); every KV the engine hands to the
cache is recorded under those keys, and every page the cache serves must
equal, bit for bit, a KV recorded for that prefix. A page recomputed after its
copy was dropped is recorded again (one more accepted version).

Settled storage. By default the storage tier's threads run beside the engine,
as in a real server: whether a later request finds a page in storage depends
on whether its backup landed in time, and a prefetch still running after
``PREFETCH_TIMEOUT_S`` is given up. With ``settle_storage`` the engine waits,
after each request, until every job it emitted has landed, and waits for every
prefetch to finish: storage hits then depend on the workload only, never on
how fast the threads ran (tests). Work still running after ``SETTLE_SAFETY_S``
is stuck, and the run fails with ``StorageTimeout`` instead of going on.
"""

from __future__ import annotations

import time
from typing import Callable, Hashable, Sequence

import torch

from hicache_fsm.cache import HiCache
from hicache_fsm.executors import TorchExecutor
from hicache_fsm.model import KVModel
from hicache_fsm.pools import KVShape
from hicache_fsm.tokens import TokenIds, pack_token_ids
from hicache_fsm.errors import ConfigError, StorageTimeout
from hicache_fsm.simulate_config import STORAGE_OPTIONS, Tier
from hicache_fsm.simulate_results import TierResult
from hicache_fsm.simulate_workload import Reference, Workload
from hicache_fsm.tp import PURPOSE_ENGINE, RankGroup, rank_view, view_digest

PREFETCH_TIMEOUT_S = 10.0  # a prefetch still running then is aborted (counted in prefetch_timeouts)
PREFETCH_POLL_S = 0.0005  # seconds between polls while a prefetch runs
SETTLE_SAFETY_S = 600.0  # settled storage: work still running then is stuck (the run fails, never goes on)

Observer = Callable[[str, HiCache], None]


class CallClock:
    """Seconds inside the calls it times (HiCache calls, the engine packing ids) and inside the executor (a subset).

    ``by_call`` splits the controller time by the name of the function called, executor time excluded.
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

    def __init__(self, inner, clock: CallClock) -> None:
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
        return self.group.same(view_digest(rank_view(cache)), PURPOSE_ENGINE)


def prefetch_and_wait(clock, cache: HiCache, res: TierResult, rid: Hashable, tokens: "tuple | TokenIds", m,
                      agreed: Callable[[bool], bool] = bool, poll_s: float = PREFETCH_POLL_S,
                      settle: bool = False):
    """Prefetch what storage adds to ``m``, wait for it, and return the new match.

    The wait is not controller time of this request (a real scheduler serves
    other requests meanwhile): ``clock``'s totals are restored after it and the
    wait is counted in ``res.prefetch_wait_s``. ``agreed`` turns "give up now"
    into the whole rank group's decision. With ``settle`` the prefetch is never
    given up: ``StorageTimeout`` after ``SETTLE_SAFETY_S`` (stuck threads).
    """
    call = clock.call
    if not call(cache.prefetch, rid, tokens, m):
        return m
    res.prefetches += 1
    start, c0, e0, b0 = time.perf_counter(), clock.controller, clock.executor, dict(clock.by_call)
    limit = SETTLE_SAFETY_S if settle else PREFETCH_TIMEOUT_S
    while not call(cache.prefetch_ready, rid):
        if agreed(time.perf_counter() > start + limit):
            if settle:
                raise StorageTimeout(f"prefetch {rid!r} still running after {limit:.0f} s: "
                                     "the storage threads are stuck")
            res.prefetch_timeouts += 1
            call(cache.abort_prefetch, rid)
            break
        time.sleep(poll_s)
        call(cache.poll)
    clock.controller, clock.executor, clock.by_call = c0, e0, b0
    res.prefetch_wait_s += time.perf_counter() - start
    return call(cache.match_prefix, tokens)


def grown_ids(ids: TokenIds, answer: Sequence[int], length: int) -> TokenIds:
    """What ``insert`` gets: a request's packed ids and its answer's (only these checked), the first ``length``."""
    return ids.extended(answer)[:length]


def fetch_prefix(call: Callable, cache: HiCache, tokens: "tuple | TokenIds", cacheable: int,
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


class ChatEngine:
    """Serves requests one at a time through a HiCache, the way an engine's step loop would."""

    def __init__(self, tier: Tier, workload: Workload, model: KVModel | None, page_size: int, layout: str,
                 device: str, storage_options: dict | None = None, observe: Observer | None = None,
                 shard: Shard | None = None, settle_storage: bool = False) -> None:
        self.tier = tier
        self.settle_storage = settle_storage
        self.workload = workload
        self.model = model
        self.ps = page_size
        self.clock = CallClock()
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
            options = dict(STORAGE_OPTIONS, prefetch_threshold=page_size)
            if isinstance(tier.storage_url, str):  # an open backend (tests) keeps the keys it was opened with
                options["model"] = model.name if model is not None else f"tokens-only-s{workload.seed}"
                if shard is not None:
                    options.update(tp_rank=shard.rank, tp_size=shard.world)
            options.update(storage_options or {})
            self.cache.attach_storage(tier.storage_url, **options)  # setup, not per-request controller time
            self.storage = True
        if observe is not None:
            observe(tier.name, self.cache)
        self._next_request = 0
        self._arrived = 0.0  # when the request being served arrived (for its time to first token)
        self._untimed_agreement_s = 0.0  # agreeing inside waits that are not controller time

    # ------------------------------------------------------------------ one request

    def serve(self, prompt: Sequence[int], answer: Sequence[int]) -> None:
        call = self.clock.call
        cache, ps, res = self.cache, self.ps, self.result
        prompt = tuple(prompt)
        self._arrived = time.perf_counter()
        ids = call(pack_token_ids, prompt)  # checked and packed once: every cache call takes them as they are
        res.requests += 1
        res.prompt_tokens += len(prompt)
        aligned_prompt = len(prompt) // ps * ps

        m, lb, served = fetch_prefix(call, cache, ids, aligned_prompt, self._prefetch if self.storage else None, res)
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
                res.reused_tokens += n_served
            else:
                k, v = self._compute(prompt, answer, past_k, past_v)
                if n_served:
                    bad = self.oracle.check(prompt, *self._mine(past_k, past_v))
                    res.kv_mismatches += bad
                if new is not None:
                    k, v = self._mine(k, v)
                    self.pool.write(new, None, k[:, n_served:aligned], v[:, n_served:aligned])
                    self.oracle.record(prompt + tuple(answer), n_served, aligned, k, v)
            if new is not None:
                indices = new if not n_served else torch.cat([served, new])
                call(cache.insert, call(grown_ids, ids, answer, aligned), indices)
        finally:
            call(cache.unlock, node)
        call(cache.poll)
        if self.settle_storage:
            self._settle()
        if self.shard is not None and not self.shard.agree_view(cache):
            res.ranks_disagree += 1

    def _settle(self) -> None:
        """Wait until every job emitted so far landed: the next request sees settled storage.

        Untimed: copies the polls run here count neither as controller nor as transfer time.
        """
        cache, clock = self.cache, self.clock
        c0, e0 = clock.controller, clock.executor
        deadline = time.perf_counter() + SETTLE_SAFETY_S
        while cache.pending_job_ids():
            if self._agreed(time.perf_counter() > deadline):
                raise StorageTimeout(f"{len(cache.pending_job_ids())} transfer jobs still running after "
                                     f"{SETTLE_SAFETY_S:.0f} s: the storage threads are stuck")
            time.sleep(PREFETCH_POLL_S)
            cache.poll()
        clock.controller, clock.executor = c0, e0

    def _mine(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's heads of full-model KV (all of it without tensor parallelism)."""
        if self.shard is None:
            return k, v
        h = self.shard.heads
        return k[:, :, h].contiguous(), v[:, :, h].contiguous()

    def _agreed(self, flag: bool) -> bool:
        """``flag`` on every rank (the engine's own decisions, such as giving up on a prefetch)."""
        return flag if self.shard is None else self.shard.group.all_true(flag, PURPOSE_ENGINE)

    def _prefetch(self, prompt: TokenIds, m):
        rid = f"req-{self._next_request}"
        self._next_request += 1
        a0 = self.cache.agreement.seconds
        m = prefetch_and_wait(self.clock, self.cache, self.result, rid, prompt, m, self._agreed,
                              settle=self.settle_storage)
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
        start = time.perf_counter()
        logits, k, v = model.prefill(prompt[n_past:], pk, pv)
        first_token = time.perf_counter()
        res.prefill_s += first_token - start
        res.ttft_s.append(first_token - self._arrived)
        res.computed_tokens += len(prompt) - n_past
        res.reused_tokens += n_past
        res.prefill_flops += model.prefill_flops(len(prompt) - n_past, n_past)
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
        res.decode_s += time.perf_counter() - first_token
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
        res.take_counters(cache.stats())
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
             shard: Shard | None = None, settle_storage: bool = False) -> TierResult:
    """Serve the reference's requests through one configuration (``model=None``: tokens only, no KV).

    With ``shard`` this process is one rank of a tensor-parallel group (see ``Shard``);
    ``settle_storage``: see the module docstring.
    """
    start = time.perf_counter()
    engine = ChatEngine(tier, workload, model, page_size, layout, device or "cpu", storage_options, observe, shard,
                        settle_storage)
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


__all__ = ["PREFETCH_POLL_S", "PREFETCH_TIMEOUT_S", "SETTLE_SAFETY_S", "CallClock", "ChatEngine", "KVOracle",
           "Observer", "Shard", "TimedExecutor", "fetch_prefix", "prefetch_and_wait", "run_tier"]
