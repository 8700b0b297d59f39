"""Adopt a serving engine's own KV buffers as the device (L1) pool, without copying them.

An engine allocates its KV memory in its own layout before the cache exists;
these functions check that layout and wrap it, so the cache moves pages in and
out of the engine's tensors directly (``DeviceKVPool.adopt``: the pool's views
share the engine's storage, whatever their strides). The cache then owns slot
allocation: token slot ``t`` is row ``t`` of SGLang's buffers, or offset
``t % block_size`` of block ``t // block_size`` in vLLM's (a page is a block).
Rows the engine keeps for itself (SGLang's padding slots at the front) stay
out of the cache by adopting views that leave them out (``k[page_size:]``);
slot ``t`` is then row ``t + page_size``.

* SGLang MHA (``MHATokenToKVPool.k_buffer`` / ``v_buffer``): per layer one K and
  one V tensor of shape (tokens, kv_heads, head_dim).
* SGLang MLA (``MLATokenToKVPool.kv_buffer``): per layer one latent tensor of
  shape (tokens, 1, kv_lora_rank + qk_rope_head_dim). Every TP rank holds the
  same copy; give the storage tier ``StorageOptions(is_mla=True, tp_rank=...)``
  so that only rank 0 writes it to storage and every rank reads the one copy.
* vLLM paged attention (``kv_caches``): per layer one tensor of shape
  (2, num_blocks, block_size, kv_heads, head_dim), K then V.

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
                     *, allocator: PageAllocator | None = None) -> DeviceKVPool:
    """SGLang MHA: per-layer K and V buffers, each (tokens, kv_heads, head_dim)."""
    ks = _tensors(k_buffers, "k_buffers", 3)
    vs = _tensors(v_buffers, "v_buffers", 3)
    if len(ks) != len(vs) or ks[0].shape != vs[0].shape or ks[0].dtype != vs[0].dtype or ks[0].device != vs[0].device:
        raise ConfigError(f"k_buffers and v_buffers must match: {len(ks)} x {tuple(ks[0].shape)} {ks[0].dtype} vs "
                          f"{len(vs)} x {tuple(vs[0].shape)} {vs[0].dtype}")
    pages = [(_token_pages(k, page_size, "k_buffers"), _token_pages(v, page_size, "v_buffers")) for k, v in zip(ks, vs)]
    return DeviceKVPool.adopt(pages, buffers=(*ks, *vs), allocator=allocator)


def adopt_sglang_mla(kv_buffers: Sequence[torch.Tensor], page_size: int,
                     *, allocator: PageAllocator | None = None) -> DeviceKVPool:
    """SGLang MLA: per-layer latent buffers, each (tokens, 1, kv_lora_rank + qk_rope_head_dim)."""
    latents = _tensors(kv_buffers, "kv_buffers", 3)
    if latents[0].shape[1] != 1:
        raise ConfigError(f"kv_buffers: an MLA latent buffer is (tokens, 1, dim), got {tuple(latents[0].shape)}")
    pages = [(_token_pages(t, page_size, "kv_buffers"),) for t in latents]
    return DeviceKVPool.adopt(pages, mla=True, buffers=tuple(latents), allocator=allocator)


def adopt_vllm(kv_caches: Sequence[torch.Tensor], *, allocator: PageAllocator | None = None) -> DeviceKVPool:
    """vLLM paged attention: per-layer (2, num_blocks, block_size, kv_heads, head_dim); page size = block size."""
    caches = _tensors(kv_caches, "kv_caches", 5)
    if caches[0].shape[0] != 2:
        raise ConfigError(f"kv_caches: expected (2, num_blocks, block_size, kv_heads, head_dim), "
                          f"got {tuple(caches[0].shape)}")
    pages = [(t[0], t[1]) for t in caches]  # (num_blocks, block_size, heads, dim) views, strides as vLLM made them
    return DeviceKVPool.adopt(pages, buffers=tuple(caches), allocator=allocator)


__all__ = ["adopt_sglang_mha", "adopt_sglang_mla", "adopt_vllm"]
