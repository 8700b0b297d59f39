"""The cache configurations ``simulate`` compares, and the options that size them.

Device only, device + host, device + host + storage and an infinite cache (pools
that hold everything, the bound); ``Options`` is everything the command takes,
checked once, and ``build_model`` the model it names.
"""

from __future__ import annotations

import attrs
import torch

from hicache_fsm.cache import HiCache
from hicache_fsm.config import CacheConfig, check_positive_int
from hicache_fsm.errors import ConfigError, MissingExtra
from hicache_fsm.input_limits import InputRefused, check_count
from hicache_fsm.model import KVModel, TinyModel
from hicache_fsm.pools import LAYOUTS, DeviceKVPool, HostKVPool, KVShape, PoolConfig, build_pools, check_device
from hicache_fsm.simulate_workload import Workload
from hicache_fsm.tp import MAX_RANKS

MODELS = ("tiny", "llama")
MAX_MODEL_HEADS = 64  # the tiny model's width grows with its heads: 64 heads of 16 make ~200 MB of weights
TOKEN_TUPLE_BYTES = 8  # a token id in the prompts the reference run keeps (a pointer to a shared small int)
NEVER = 1 << 62  # a write_through_selective threshold no node reaches: nothing is backed up
# A sequential engine waits for its prefetch; any full page is worth fetching (recompute is the alternative).
STORAGE_OPTIONS = {"stop_policy": "wait_complete"}


DEVICE = "device"
DEVICE_HOST = "device+host"
FULL = "device+host+storage"
INFINITE = "infinite"


def check_pool_options(device_tokens: object, host_tokens: object, page_size: int, layout: object,
                       device: object) -> None:
    """The pool options every run shares: whole pages, a host larger than the device, a known layout and device."""
    for name, value in (("device_tokens", device_tokens), ("host_tokens", host_tokens)):
        if check_positive_int(name, value) % page_size:
            raise ConfigError(f"{name} {value} is not a multiple of page_size {page_size}")
    if host_tokens <= device_tokens:  # type: ignore[operator]  (both ints now)
        raise ConfigError(
            f"host_tokens {host_tokens} must be larger than device_tokens {device_tokens}: "
            "the host tier keeps a copy of everything on the device, so a host pool no larger "
            "than the device loses hits instead of adding them")
    if device is not None:
        check_device(device)
    if layout not in LAYOUTS:
        raise ConfigError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")


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
        ps = check_positive_int("page_size", self.page_size)
        check_positive_int("model_heads", self.model_heads)
        if check_positive_int("tp", self.tp) > MAX_RANKS:
            raise ConfigError(f"--tp {self.tp}: at most {MAX_RANKS} rank processes")
        if self.model_heads > MAX_MODEL_HEADS:
            raise ConfigError(f"model_heads {self.model_heads}: at most {MAX_MODEL_HEADS}")
        if self.tp > 1 and self.model != "tiny":
            raise ConfigError(f"--tp {self.tp} runs the tiny model only; --model {self.model} is not sharded across ranks")
        if self.tp > 1 and self.model_heads % self.tp:
            raise ConfigError(f"--tp {self.tp} needs a head count it divides; the model has {self.model_heads} "
                              f"heads (raise --model-heads)")
        check_pool_options(self.device_tokens, self.host_tokens, ps, self.layout, self.device)
        per_request = self.workload.system_prompt_length + self.workload.rounds * (
            self.workload.request_length + self.workload.output_length)
        if self.device_tokens < per_request:
            raise ConfigError(
                f"device_tokens {self.device_tokens} cannot hold one conversation "
                f"({per_request} tokens); raise --device-tokens or shorten the workload")
        self._check_workload_memory(per_request)

    def _check_workload_memory(self, per_request: int) -> None:
        """Refuse a workload the machine cannot hold before it runs (it would grow until the machine gives out).

        Per token the infinite cache holds: its KV in that cache's device and host pools, and its share of the
        prompts the reference run keeps (at most ``per_request`` tokens a request).
        """
        tokens = self.infinite_tokens()
        kv = KVShape(self.model_layers, self.model_heads, self.model_head_dim, torch.float32).token_bytes
        prompt_ids_per_token = -(-self.workload.requests * per_request // tokens)
        try:
            check_count(tokens, 2 * kv + TOKEN_TUPLE_BYTES * prompt_ids_per_token, "the workload's tokens")
        except InputRefused as exc:
            raise ConfigError(f"{exc}; lower --clients, --rounds or the lengths") from None

    def infinite_tokens(self) -> int:
        n = self.workload.max_tokens() + self.workload.requests * self.page_size
        return -(-n // self.page_size) * self.page_size  # in ints: a float would round a huge workload

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
    except ImportError:
        raise MissingExtra("--model llama", "transformers", "llama") from None
    return LlamaModel(options.model_layers, options.model_query_heads, options.model_heads, options.model_head_dim,
                      vocab=w.vocab, seed=w.seed, dtype=torch.float64, device=device)


__all__ = ["DEVICE", "DEVICE_HOST", "FULL", "INFINITE", "MAX_MODEL_HEADS", "MODELS", "NEVER", "STORAGE_OPTIONS",
           "Options", "Tier", "build_model", "check_pool_options", "device_only", "storage_available"]
