"""Adopt a serving engine's own KV buffers as the device (L1) pool, without copying them.

An engine allocates its KV memory in its own layout before the cache exists;
these functions check that layout and wrap it, so the cache moves pages in and
out of the engine's tensors directly (``DeviceKVPool.adopt``: the pool's views
share the engine's storage, whatever their strides). The cache then owns slot
allocation: token slot ``t`` is row ``t`` of SGLang's buffers, or offset
``t % block_size`` of block ``t // block_size`` in vLLM's (a page is a block).
Pages the engine keeps for itself at the front are reserved: the cache never
hands them out (``reserved_pages``). SGLang's buffers have one, page 0, which
absorbs the writes of its CUDA graphs' padding (its own allocators start at
page 1), so the SGLang functions reserve it by default.

* SGLang MHA (``MHATokenToKVPool.k_buffer`` / ``v_buffer``): per layer one K and
  one V tensor of shape (tokens, kv_heads, head_dim).
* SGLang MLA (``MLATokenToKVPool.kv_buffer``): per layer one latent tensor of
  shape (tokens, 1, kv_lora_rank + qk_rope_head_dim). Every TP rank holds the
  same copy; give the storage tier ``StorageOptions(is_mla=True, tp_rank=...)``
  so that only rank 0 writes it to storage and every rank reads the one copy.
* vLLM paged attention (``kv_caches``): per layer one tensor of shape
  (2, num_blocks, block_size, kv_heads, head_dim), K then V (FlashAttention's
  layout, ``kv_dim=0``), or (num_blocks, 2, block_size, kv_heads, head_dim)
  (FlashInfer's, ``kv_dim=1``): the layout is named, not guessed from the
  shape, which cannot tell the two apart when there are two blocks.

Host pools for an adopted pool: ``HostKVPool.matching(pool, tokens, layout)``,
in any host layout.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hicache_fsm.adoption import check_kv_tensor
from hicache_fsm.errors import ConfigError
from hicache_fsm.pools import DeviceKVPool, PageAllocator


def _tensors(buffers, what: str, ndim: int) -> list[torch.Tensor]:
    """The engine's per-layer tensors, checked alike: same shape, dtype and device, ``ndim`` dims."""
    if isinstance(buffers, torch.Tensor) or not isinstance(buffers, Sequence) or not buffers:
        raise ConfigError(f"{what}: expected a non-empty list with one tensor per layer")
    first = check_kv_tensor(buffers[0], f"{what}[0]")
    for layer, t in enumerate(buffers):
        check_kv_tensor(t, f"{what}[{layer}]")
        if t.dim() != ndim:
            raise ConfigError(f"{what}[{layer}]: expected a {ndim}-D tensor, got {tuple(t.shape)}")
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise ConfigError(f"{what}[{layer}]: {tuple(t.shape)} {t.dtype} on {t.device} differs from layer 0's "
                              f"{tuple(first.shape)} {first.dtype} on {first.device}")
    return list(buffers)


def _token_pages(t: torch.Tensor, page_size: int, what: str) -> torch.Tensor:
    """A (tokens, heads, dim) buffer as a (pages, page_size, heads, dim) view of the same memory."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
        raise ConfigError(f"page_size must be a positive int, got {page_size!r}")
    if t.shape[0] == 0 or t.shape[0] % page_size:
        raise ConfigError(f"{what}: {t.shape[0]} token slots (dim 0 of a (tokens, heads, head_dim) buffer, here "
                          f"{tuple(t.shape)}) is not a positive multiple of page_size {page_size}")
    return t.unflatten(0, (t.shape[0] // page_size, page_size))


def adopt_sglang_mha(k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor], page_size: int,
                     *, allocator: PageAllocator | None = None, reserved_pages: int = 1) -> DeviceKVPool:
    """SGLang MHA: per-layer K and V buffers, each (tokens, kv_heads, head_dim); page 0 stays SGLang's."""
    ks = _tensors(k_buffers, "k_buffers", 3)
    vs = _tensors(v_buffers, "v_buffers", 3)
    if len(ks) != len(vs) or ks[0].shape != vs[0].shape or ks[0].dtype != vs[0].dtype or ks[0].device != vs[0].device:
        raise ConfigError(f"k_buffers and v_buffers must match: {len(ks)} x {tuple(ks[0].shape)} {ks[0].dtype} vs "
                          f"{len(vs)} x {tuple(vs[0].shape)} {vs[0].dtype}")
    pages = [(_token_pages(k, page_size, "k_buffers"), _token_pages(v, page_size, "v_buffers")) for k, v in zip(ks, vs)]
    return DeviceKVPool.adopt(pages, buffers=(*ks, *vs), allocator=allocator, reserved_pages=reserved_pages)


def adopt_sglang_mla(kv_buffers: Sequence[torch.Tensor], page_size: int,
                     *, allocator: PageAllocator | None = None, reserved_pages: int = 1) -> DeviceKVPool:
    """SGLang MLA: per-layer latent buffers, each (tokens, 1, kv_lora_rank + qk_rope_head_dim); page 0 stays
    SGLang's."""
    latents = _tensors(kv_buffers, "kv_buffers", 3)
    if latents[0].shape[1] != 1:
        raise ConfigError(f"kv_buffers: an MLA latent buffer is (tokens, 1, dim), got {tuple(latents[0].shape)}")
    pages = [(_token_pages(t, page_size, "kv_buffers"),) for t in latents]
    return DeviceKVPool.adopt(pages, mla=True, buffers=tuple(latents), allocator=allocator,
                              reserved_pages=reserved_pages)


def adopt_vllm(kv_caches: Sequence[torch.Tensor], *, kv_dim: int = 0, allocator: PageAllocator | None = None,
               reserved_pages: int = 0) -> DeviceKVPool:
    """vLLM paged attention: per-layer caches with K and V along ``kv_dim`` (0: (2, num_blocks, block_size,
    kv_heads, head_dim); 1: (num_blocks, 2, ...)); page size = block size."""
    caches = _tensors(kv_caches, "kv_caches", 5)
    if type(kv_dim) is not int or kv_dim not in (0, 1):  # 1.0 or True would pass ``in (0, 1)``
        raise ConfigError(f"kv_dim must be 0 (2, num_blocks, ...) or 1 (num_blocks, 2, ...), got {kv_dim!r}")
    if caches[0].shape[kv_dim] != 2:
        want = "(2, num_blocks, block_size, kv_heads, head_dim)" if kv_dim == 0 else \
            "(num_blocks, 2, block_size, kv_heads, head_dim)"
        raise ConfigError(f"kv_caches: expected {want} (kv_dim={kv_dim}), got {tuple(caches[0].shape)}")
    # (num_blocks, block_size, heads, dim) views, strides as vLLM made them
    pages = [(t.select(kv_dim, 0), t.select(kv_dim, 1)) for t in caches]
    return DeviceKVPool.adopt(pages, buffers=tuple(caches), allocator=allocator, reserved_pages=reserved_pages)


__all__ = ["adopt_sglang_mha", "adopt_sglang_mla", "adopt_vllm"]
