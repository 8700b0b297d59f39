"""Engine-owned KV buffers: adopted without a copy, moved bit for bit through every tier.

Each engine layout (SGLang MHA, SGLang MLA, vLLM paged; contiguous and with
strides an engine may use) runs through the real ``HiCache`` for each host
layout and dtype: the engine writes KV into its own buffers, the cache backs it
up to host and storage, evicts it from the device (then from the host), and
loads it back from the host (then prefetches it from storage); the engine's
buffers must then hold the very same bits.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable

import attrs
import pytest
import torch
from storage_util import evict_all, path_nodes, ready, settle, wait_until

from hicache_fsm.cache import HiCache
from hicache_fsm.config import CacheConfig
from hicache_fsm.engine_kv import adopt_sglang_mha, adopt_sglang_mla, adopt_vllm
from hicache_fsm.errors import ConfigError, HiCacheError
from hicache_fsm.pools import LAYOUTS, DeviceKVPool, HostKVPool, KVShape

LAYERS, HEADS, HEAD_DIM, PAGE, PAGES = 3, 2, 4, 4, 16
MLA_DIM = 6  # kv_lora_rank + qk_rope_head_dim, tiny
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}
STORAGE = {"prefetch_threshold": PAGE, "stop_policy": "wait_complete", "retry_interval": 0.01,
           "probe_interval": 0.02, "join_timeout": 5.0}


@attrs.frozen
class Engine:
    """An engine's KV memory: the tensors it allocated and how it reads a slot's KV."""

    name: str
    tensors: tuple[torch.Tensor, ...]
    adopt: Callable[[], DeviceKVPool]
    slot_kv: Callable[[torch.Tensor], torch.Tensor]  # token slots -> (layers, parts, n, heads, dim)


def _alloc(shape: tuple[int, ...], dtype, device, strided: bool) -> torch.Tensor:
    """A zeroed buffer; ``strided``: a non-contiguous view of a larger one (padding in the last dim)."""
    if not strided:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.zeros((*shape[:-1], shape[-1] + 3), dtype=dtype, device=device)[..., : shape[-1]]


def sglang_mha(dtype, device="cpu", strided=False) -> Engine:
    tokens = PAGES * PAGE
    k = [_alloc((tokens, HEADS, HEAD_DIM), dtype, device, strided) for _ in range(LAYERS)]
    v = [_alloc((tokens, HEADS, HEAD_DIM), dtype, device, strided) for _ in range(LAYERS)]
    return Engine("sglang_mha", (*k, *v), lambda: adopt_sglang_mha(k, v, PAGE),
                  lambda idx: torch.stack([torch.stack([k[i][idx], v[i][idx]]) for i in range(LAYERS)]))


def sglang_mla(dtype, device="cpu", strided=False) -> Engine:
    tokens = PAGES * PAGE
    latent = [_alloc((tokens, 1, MLA_DIM), dtype, device, strided) for _ in range(LAYERS)]
    return Engine("sglang_mla", tuple(latent), lambda: adopt_sglang_mla(latent, PAGE),
                  lambda idx: torch.stack([latent[i][idx][None] for i in range(LAYERS)]))


def vllm(dtype, device="cpu", strided=False) -> Engine:
    if strided:  # FlashInfer's HND order: physical (blocks, 2, heads, block, dim), logical (2, blocks, block, heads, dim)
        caches = [torch.zeros((PAGES, 2, HEADS, PAGE, HEAD_DIM), dtype=dtype, device=device).permute(1, 0, 3, 2, 4)
                  for _ in range(LAYERS)]
    else:
        caches = [torch.zeros((2, PAGES, PAGE, HEADS, HEAD_DIM), dtype=dtype, device=device) for _ in range(LAYERS)]
    return Engine("vllm", tuple(caches), lambda: adopt_vllm(caches),
                  lambda idx: torch.stack([c[:, idx // PAGE, idx % PAGE] for c in caches]))


def owned_mla(dtype, device="cpu", strided=False) -> Engine:
    """Not an engine: an MLA pool that allocates its own (1, layers, tokens, 1, dim) buffer (the fast copy path)."""
    pool = DeviceKVPool(KVShape(LAYERS, 1, MLA_DIM, dtype, mla=True), PAGES * PAGE, PAGE, device)
    return Engine("owned_mla", (pool.kv,), lambda: pool, lambda idx: pool.kv[:, :, idx].transpose(0, 1))


ENGINES = {"sglang_mha": sglang_mha, "sglang_mla": sglang_mla, "vllm": vllm}


def _fill(engine: Engine, pool: DeviceKVPool, slots: torch.Tensor, seed: int) -> None:
    """The engine's forward pass: random bits (every pattern, NaNs included) into its own buffers at ``slots``."""
    gen = torch.Generator().manual_seed(seed)
    ps = pool.page_size
    for layer in range(pool.layers):
        for view in pool.layer_pages(layer):  # the engine's memory, in its own strides
            want = view[slots // ps, slots % ps]
            bits = torch.randint(-(2**31), 2**31, want.shape, generator=gen, dtype=torch.int64)
            view[slots // ps, slots % ps] = bits.to(BITS[want.dtype]).view(want.dtype).to(view.device)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().contiguous().view(BITS[t.dtype])


def _settled(cache: HiCache, tokens) -> None:
    wait_until(cache, lambda: all(n.state.endswith("stored") for n in path_nodes(cache, tokens)[0]),
               what="backup to storage")


def _load_back(cache: HiCache, tokens) -> torch.Tensor:
    """match, load the host part back to the device, wait every layer: the device slots of ``tokens``."""
    m = cache.match_prefix(tokens)
    assert m.device_hit_length == 0 and m.host_hit_length == len(tokens)
    lb = cache.load_back(m.last_host_node)
    for layer in range(cache.device_pool.layers):
        lb.wait(layer)
    cache.poll()
    return lb.device_indices


def round_trip(engine: Engine, layout: str, storage_url: str) -> None:
    """device -> host -> storage, evict; host -> device; evict again; storage -> host -> device: same bits."""
    pool = engine.adopt()
    host = HostKVPool.matching(pool, 2 * pool.size_tokens, layout, pin_memory=pool.device.type == "cuda")
    cache = HiCache(pool, host, CacheConfig(write_policy="write_through"))
    try:
        cache.attach_storage(storage_url, model=engine.name, is_mla=pool.shape.mla, **STORAGE)
        tokens = tuple(range(1000, 1000 + 6 * PAGE))
        slots = cache.alloc_device(len(tokens))
        order = torch.randperm(slots.numel() // PAGE, generator=torch.Generator().manual_seed(0))
        slots = slots[order.repeat_interleave(PAGE) * PAGE + torch.arange(slots.numel()) % PAGE]  # several runs
        _fill(engine, pool, slots.to(pool.device), seed=len(layout))
        written = _bits(engine.slot_kv(slots.to(pool.device)))
        cache.insert(tokens, slots)  # write_through: device -> host -> storage
        _settled(cache, tokens)

        (node,) = path_nodes(cache, tokens)[0]
        cache.evict_node(node)  # off the device; the engine's slots are free again
        for t in engine.tensors:
            t.zero_()  # nothing stale can pass for loaded data
        from_host = _load_back(cache, tokens)
        assert torch.equal(_bits(engine.slot_kv(from_host.to(pool.device))), written)

        evict_all(cache, tokens)  # off the device and off the host: storage alone holds it
        assert len(cache.tree) == 0
        for t in engine.tensors:
            t.zero_()
        m = cache.match_prefix(tokens)
        assert cache.prefetch("r", tokens, m)
        ready(cache, "r")
        assert cache.stats()["storage"]["prefetch_inserted_tokens"] == len(tokens)
        from_storage = _load_back(cache, tokens)
        assert torch.equal(_bits(engine.slot_kv(from_storage.to(pool.device))), written)
        settle(cache)
        cache.check_invariants()
    finally:
        cache.close()


CASES = list(itertools.product(ENGINES, (False, True), LAYOUTS, DTYPES))
OWNED_MLA_CASES = list(itertools.product(LAYOUTS, DTYPES))


def _id(case) -> str:
    name, strided, layout, dtype = case
    return f"{name}-{'strided' if strided else 'contiguous'}-{layout}-{str(dtype).removeprefix('torch.')}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_round_trip_through_every_tier_is_bit_exact(case, tmp_path):
    name, strided, layout, dtype = case
    round_trip(ENGINES[name](dtype, "cpu", strided), layout, f"file://{tmp_path}/l3")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_round_trip_on_cuda_is_bit_exact(case, tmp_path):
    name, strided, layout, dtype = case
    round_trip(ENGINES[name](dtype, "cuda", strided), layout, f"file://{tmp_path}/l3")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("layout, dtype", OWNED_MLA_CASES, ids=lambda x: str(x).removeprefix("torch."))
def test_an_owned_mla_pool_round_trips_too(layout, dtype, device, tmp_path):
    round_trip(owned_mla(dtype, device), layout, f"file://{tmp_path}/l3")


@pytest.mark.parametrize("name", ENGINES)
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_adoption_shares_the_engines_memory(name, strided):
    engine = ENGINES[name](torch.float32, "cpu", strided)
    pool = engine.adopt()
    ptrs = {t.untyped_storage().data_ptr() for t in engine.tensors}
    assert {t.untyped_storage().data_ptr() for t in pool.buffers} == ptrs
    for layer in range(pool.layers):
        assert {v.untyped_storage().data_ptr() for v in pool.layer_pages(layer)} <= ptrs
    assert pool.adopted and pool.kv is None
    slots = torch.arange(PAGE, 3 * PAGE)
    _fill(engine, pool, slots, seed=1)  # through the pool's views ...
    parts = pool.read(slots)  # ... visible in the engine's tensors, and back
    assert torch.equal(_bits(torch.stack(parts, 1)), _bits(engine.slot_kv(slots)))


def test_adopted_shapes():
    mha = sglang_mha(torch.float16).adopt()
    assert (mha.shape.layers, mha.shape.heads, mha.shape.head_dim, mha.shape.dtype, mha.shape.mla) == \
        (LAYERS, HEADS, HEAD_DIM, torch.float16, False)
    assert mha.size_tokens == PAGES * PAGE and mha.page_size == PAGE and mha.allocator.total_pages == PAGES
    mla = sglang_mla(torch.bfloat16).adopt()
    assert mla.shape.mla and mla.shape.parts == 1 and mla.shape.heads == 1 and mla.shape.head_dim == MLA_DIM
    assert mla.shape.token_bytes == LAYERS * MLA_DIM * 2
    paged = vllm(torch.float32, strided=True).adopt()
    assert paged.page_size == PAGE and paged.size_tokens == PAGES * PAGE  # a block is a page
    for layout in LAYOUTS:
        host = HostKVPool.matching(mla, 8 * PAGE, layout, pin_memory=False)
        assert host.shape == mla.shape and host.kv.shape[0] == 1 and host.page_nbytes == PAGE * mla.shape.token_bytes


def test_bad_engine_buffers_are_refused():
    k = [torch.zeros(PAGES * PAGE, HEADS, HEAD_DIM) for _ in range(2)]
    with pytest.raises(ConfigError, match="differs from layer 0"):
        adopt_sglang_mha(k, [torch.zeros(PAGES * PAGE, HEADS, HEAD_DIM), torch.zeros(8, HEADS, HEAD_DIM)], PAGE)
    with pytest.raises(ConfigError, match="must match"):
        adopt_sglang_mha(k, [torch.zeros(PAGES * PAGE, HEADS, HEAD_DIM, dtype=torch.float16)] * 2, PAGE)
    with pytest.raises(ConfigError, match="multiple of page_size"):
        adopt_sglang_mha(k, k, 5)
    with pytest.raises(ConfigError, match="non-empty list"):
        adopt_sglang_mha([], [], PAGE)
    with pytest.raises(ConfigError, match="non-empty list"):
        adopt_sglang_mla(torch.zeros(3, PAGE, 1, MLA_DIM), PAGE)  # a stacked tensor, not one per layer
    with pytest.raises(ConfigError, match=r"\(tokens, 1, dim\)"):
        adopt_sglang_mla([torch.zeros(PAGES * PAGE, 2, MLA_DIM)], PAGE)
    with pytest.raises(ConfigError, match="floating-point"):
        adopt_sglang_mla([torch.zeros(PAGES * PAGE, 1, MLA_DIM, dtype=torch.int32)], PAGE)
    with pytest.raises(ConfigError, match="5-D"):
        adopt_vllm([torch.zeros(PAGES, PAGE, HEADS, HEAD_DIM)])
    with pytest.raises(ConfigError, match=r"\(2, num_blocks"):
        adopt_vllm([torch.zeros(3, PAGES, PAGE, HEADS, HEAD_DIM)])


def test_mla_ranks_share_one_stored_copy():
    """Every TP rank adopts its own replica of the latent; rank 0 alone writes it, rank 1 reads that copy."""
    url = f"memory://mla-{id(object())}"
    tokens = tuple(range(2000, 2000 + 4 * PAGE))
    engines = [sglang_mla(torch.bfloat16) for _ in range(2)]
    caches = []
    try:
        for rank, engine in enumerate(engines):
            pool = engine.adopt()
            host = HostKVPool.matching(pool, 2 * pool.size_tokens, "page_first", pin_memory=False)
            cache = HiCache(pool, host, CacheConfig(write_policy="write_through"))
            cache.attach_storage(url, model="mla", is_mla=True, tp_rank=rank, tp_size=2, **STORAGE)
            caches.append(cache)
        slots = caches[0].alloc_device(len(tokens))
        _fill(engines[0], caches[0].device_pool, slots, seed=3)
        written = _bits(engines[0].slot_kv(slots))
        caches[0].insert(tokens, slots)
        _settled(caches[0], tokens)
        assert caches[0].stats()["storage"]["backend_stats"]["sets"] > 0
        reader = caches[1]
        assert reader.prefetch("r", tokens, reader.match_prefix(tokens))
        ready(reader, "r")
        assert torch.equal(_bits(engines[1].slot_kv(_load_back(reader, tokens))), written)
        other = tuple(range(3000, 3000 + 2 * PAGE))
        slots = reader.alloc_device(len(other))
        _fill(engines[1], reader.device_pool, slots, seed=4)
        reader.insert(other, slots)
        wait_until(reader, lambda: reader.stats()["storage"]["backups_skipped_mla"] >= 1, what="rank 1's backup")
        assert reader.stats()["storage"]["backend_stats"]["sets"] == 0  # rank 1 never writes the shared copy
    finally:
        for cache in caches:
            cache.close()


@pytest.mark.parametrize("engine", ["sglang_mha", "vllm"])
def test_copy_bench_runs_on_adopted_buffers(engine, capsys):
    from hicache_fsm.cli import main

    argv = ["bench", "copy", "--engine", engine, "--layout", "page_first_direct", "--tokens", "128", "--page-size",
            "16", "--layers", "2", "--heads", "2", "--head-dim", "8", "--repeats", "1", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["engine"] == engine and result["d2h_gbps"] > 0 and result["h2d_gbps"] > 0


def test_a_buffer_in_another_layout_is_refused_with_the_layout_expected():
    """A (heads, tokens, dim) view read as 2 token slots; the message now says which dim is tokens, and its shape."""
    from hicache_fsm.engine_kv import adopt_sglang_mha

    k = [torch.zeros(64 * 4, 2, 8).transpose(0, 1) for _ in range(2)]
    with pytest.raises(ConfigError, match=r"dim 0 of a \(tokens, heads, head_dim\) buffer, here \(2, 256, 8\)"):
        adopt_sglang_mha(k, k, 64)


def test_sglangs_padding_page_is_never_handed_out():
    # SGLang writes its CUDA graphs' padding into page 0 (its own allocators start at page 1): the cache
    # handed that page out first, and KV cached there was overwritten without an error.
    pool = sglang_mha(torch.float16).adopt()
    host = HostKVPool.matching(pool, 2 * pool.size_tokens, "layer_first", pin_memory=False)
    cache = HiCache(pool, host, CacheConfig(write_policy="write_through"))
    assert pool.allocator.used_pages == 0
    for _ in range(2):  # and again after a reset
        slots = cache.alloc_device(pool.allocator.available_tokens)
        assert slots.numel() == (PAGES - 1) * PAGE and int(slots.min()) >= PAGE
        assert cache.alloc_device(PAGE) is None
        cache.reset()
    with pytest.raises(HiCacheError):
        cache.free_device(torch.arange(PAGE))  # page 0 is the engine's, not the cache's to free
    cache.close()


def vllm_kv_second(dtype, device="cpu") -> Engine:
    """FlashInfer's vLLM layout: (num_blocks, 2, block_size, heads, dim), named by kv_dim=1."""
    caches = [torch.zeros((PAGES, 2, PAGE, HEADS, HEAD_DIM), dtype=dtype, device=device) for _ in range(LAYERS)]
    return Engine("vllm_kv_second", tuple(caches), lambda: adopt_vllm(caches, kv_dim=1),
                  lambda idx: torch.stack([c[idx // PAGE, :, idx % PAGE] for c in caches]))


def test_a_vllm_cache_with_k_and_v_in_the_second_dim_round_trips(tmp_path):
    round_trip(vllm_kv_second(torch.bfloat16), "page_first", f"file://{tmp_path}/l3")


def test_a_vllm_layout_is_named_not_guessed_from_the_shape():
    # With two blocks, (num_blocks, 2, ...) has the shape of (2, num_blocks, ...): read as the latter,
    # K was block 0 and V block 1, every K/V pair scrambled without an error.
    caches = [torch.randn(2, 2, PAGE, HEADS, HEAD_DIM) for _ in range(LAYERS)]
    pool = adopt_vllm(caches, kv_dim=1)
    for layer in range(LAYERS):
        k, v = pool.layer_pages(layer)
        assert k.data_ptr() == caches[layer][:, 0].data_ptr() and torch.equal(k, caches[layer][:, 0])
        assert torch.equal(v, caches[layer][:, 1])
    for bad in (2, True, "1", 1.0):
        with pytest.raises(ConfigError, match="kv_dim"):
            adopt_vllm(caches, kv_dim=bad)
    with pytest.raises(ConfigError, match=r"\(num_blocks, 2, block_size"):
        adopt_vllm([torch.zeros(2, PAGES, PAGE, HEADS, HEAD_DIM)], kv_dim=1)
