"""What ``simulate`` measured: one ``TierResult`` per configuration, gathered in a ``Simulation``."""

from __future__ import annotations

import math

import attrs

from hicache_fsm.simulate_config import DEVICE, DEVICE_HOST, FULL, INFINITE
from hicache_fsm.simulate_workload import Reference, Workload


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
    computed_tokens: int = 0  # prompt tokens the model ran in prefill (or would: tokens only)
    reused_tokens: int = 0  # prompt tokens whose KV came from the cache as the prefill's past
    prefill_flops: int = 0  # work of those prefills, counted from the model's geometry (KVModel.prefill_flops)
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
    prefill_s: float = 0.0  # model time up to each request's first token
    decode_s: float = 0.0  # model time of the rest of each answer (the same in every configuration)
    ttft_s: list = attrs.Factory(list)  # per request: arrival to the first token's logits (with a model)
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

    @property
    def model_s(self) -> float:
        return self.prefill_s + self.decode_s

    def per_request_us(self, seconds: float) -> float:
        return seconds / self.requests * 1e6 if self.requests else 0.0

    def controller_split_us(self) -> dict[str, float]:
        """Controller time per request by part: what ``bench controller`` times, and the rest.

        ``loop``: match_prefix + insert, and ``poll``: the calls ``bench controller``
        times (there with 4,096-token requests, page 64, no copies, and a poll that
        only applies acks; here poll also starts the backups to host and storage); ``alloc``:
        alloc_device (evicting to make room); ``locks``: lock + unlock; ``loads``:
        load_back + the per-layer waits; ``prefetch``: prefetch calls (their wait is
        not in it); ``token_checks``: the engine checking and packing a request's
        ids once (``pack_token_ids``) and its answer's for ``insert``
        (``grown_ids``; ``simulate --trace`` packs outside the timed loop). The
        parts add up to the controller time; KV copies (the executor) and the
        model are not in it.
        """
        by = self.controller_by_call
        parts = {"loop": ("match_prefix", "insert"), "poll": ("poll",), "alloc": ("alloc_device",),
                 "locks": ("lock", "unlock"), "loads": ("load_back", "wait"),
                 "prefetch": ("prefetch", "prefetch_ready", "abort_prefetch"),
                 "token_checks": ("pack_token_ids", "grown_ids")}
        return {name: self.per_request_us(sum(by.get(c, 0.0) for c in calls)) for name, calls in parts.items()}

    def ttft_ms(self, quantile: float | None = None) -> float:
        """Mean time to first token (``quantile`` None) or that quantile, in ms; 0 without a model."""
        if not self.ttft_s:
            return 0.0
        if quantile is None:
            return sum(self.ttft_s) / len(self.ttft_s) * 1e3
        ordered = sorted(self.ttft_s)
        return ordered[max(0, math.ceil(quantile * len(ordered)) - 1)] * 1e3

    def take_counters(self, counters: dict) -> None:
        """Keep a cache's final ``stats()``: its numeric counters and the bytes moved per transfer kind
        (storage bytes as the backend counted them)."""
        self.counters = {k: v for k, v in counters.items() if isinstance(v, (int, float))}
        self.bytes = {kind: int(counters.get(f"bytes_{kind}", 0)) for kind in ("d2h", "h2d")}
        storage = counters.get("storage")
        if isinstance(storage, dict):
            backend = storage.get("backend_stats") or {}
            self.bytes["h2s"] = int(backend.get("bytes_written", counters.get("bytes_h2s", 0)))
            self.bytes["s2h"] = int(backend.get("bytes_read", 0))

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
            "prefill_tokens_reused": self.reused_tokens,
            "prefill_gflop": round(self.prefill_flops / 1e9, 4),
            "prefill_s": round(self.prefill_s, 3),
            "decode_s": round(self.decode_s, 3),
            "ttft_ms_mean": round(self.ttft_ms(), 2),
            "ttft_ms_p90": round(self.ttft_ms(0.9), 2),
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
            "controller_us_per_request_split": {k: round(v, 1) for k, v in self.controller_split_us().items()},
            "transfer_us_per_request": round(self.per_request_us(self.transfer_s), 1),
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

    def prefill_saved(self) -> dict[str, float] | None:
        """What the hierarchy's prefill saved against device only, as fractions (None without both).

        ``tokens``: prompt tokens not computed; ``flops``: counted prefill work
        (attention to the reused past is still paid, so it falls a little less);
        ``seconds``: measured prefill time.
        """
        dev, full = self.tier(DEVICE), self.hierarchy
        if dev is None or full is dev or not dev.computed_tokens:
            return None

        def saved(a: float, b: float) -> float:
            return 1.0 - b / a if a else 0.0

        return {"tokens": saved(dev.computed_tokens, full.computed_tokens),
                "flops": saved(dev.prefill_flops, full.prefill_flops),
                "seconds": saved(dev.prefill_s, full.prefill_s)}

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
            "prefill_saved": {k: round(v, 4) for k, v in (self.prefill_saved() or {}).items()},
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
                {"rank": r, "configs": {t.name: {k: v for k, v in t.as_dict().items() if k in PER_RANK}
                                        for t in tiers}}
                for r, tiers in enumerate(self.rank_tiers)
            ],
        }


PER_RANK = ("hit_rate", "kv_checked_pages", "kv_mismatches", "output_mismatches", "ranks_disagree",
             "controller_us_per_request", "agreement_us_per_request", "transfer_ms", "bytes", "wall_s")


__all__ = ["PER_RANK", "Simulation", "TierResult"]
