"""A tiny deterministic transformer, for end-to-end checks of cached KV reuse.

Random weights come from a seeded ``torch.Generator`` (no download), so two
models built with the same arguments are identical. Positions use rotary
embeddings by absolute position, so the K/V of a token depend only on the
tokens up to it: KV computed once, stored in the cache and loaded back gives
the same continuation as recomputing from scratch.
"""

from __future__ import annotations

import contextlib
import math
import operator
from typing import Protocol

import torch
import torch.nn.functional as F

from hicache_fsm.errors import BadIndices, ConfigError
from hicache_fsm.pools import KVShape, check_device


class KVModel(Protocol):
    """What the simulator and the end-to-end checks need from a model.

    KV tensors are (layers, tokens, kv_heads, head_dim), the layout of the
    device pool's per-layer buffers, so the KV of a cached prefix goes from the
    pool to the model and the KV of new tokens from the model to the pool as is.
    """

    vocab: int

    @property
    def name(self) -> str:
        """Names the KV the model produces (storage keys are namespaced by it)."""

    @property
    def kv_shape(self) -> KVShape:
        """Per-token KV geometry and dtype: what the pools are built for."""

    def prefill(self, tokens, past_k: torch.Tensor | None = None, past_v: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits of the last token, k, v of the new tokens), after ``past`` KV."""

    def generate(self, tokens, max_new: int, past_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[int]:
        """Greedy continuation of ``tokens``; ``past_kv`` covers a prefix of them."""

    def prefill_flops(self, n_new: int, n_past: int) -> int:
        """Floating-point operations of ``prefill`` of ``n_new`` tokens after ``n_past`` (counted, not timed)."""


def decoder_flops(n_new: int, n_past: int, macs_per_token: int, attention_width: int, head_macs: int) -> int:
    """FLOPs (2 per multiply-add) of a causal decoder pass over ``n_new`` tokens after ``n_past``.

    ``macs_per_token``: the weight matrices every new token goes through (all
    layers); ``attention_width``: query heads x head_dim x layers, the
    multiply-adds of one query against one key (scores) plus one value (mix)
    being twice that; ``head_macs``: the LM head, run for the last token only.
    Each new token attends to the past and to the new tokens up to itself.
    """
    pairs = n_new * n_past + n_new * (n_new + 1) // 2
    return 2 * (n_new * macs_per_token + 2 * pairs * attention_width + head_macs)


def check_tokens(tokens, vocab: int) -> list[int]:
    """``tokens`` as a list of ints, each in [0, vocab); a float (``1.5`` was read as 1) or a str is refused."""
    if isinstance(tokens, (str, bytes)):
        raise BadIndices(f"token ids must be integers, got {type(tokens).__name__}")
    try:
        ids = [operator.index(t) for t in tokens]
    except TypeError:
        raise BadIndices("token ids must be integers (int, numpy or torch integer scalars)") from None
    if ids and (min(ids) < 0 or max(ids) >= vocab):
        raise BadIndices(f"token ids must be in [0, {vocab})")
    return ids


def generation_past(shape: KVShape, tokens: list, max_new: object,
                    past_kv: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Check ``generate``'s arguments; the part of ``past_kv`` to reuse (None, None: none).

    The past may cover every prompt token; the last one is then dropped from it,
    so that recomputing that token gives the logits of the first new one.
    """
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 0:
        raise BadIndices(f"max_new must be a non-negative int, got {max_new!r}")
    if not tokens:
        raise BadIndices("generate needs at least one prompt token")
    past_k, past_v = past_kv if past_kv is not None else (None, None)
    n_past = check_past(shape, past_k, past_v)
    if n_past > len(tokens):
        raise BadIndices(f"past_kv covers {n_past} tokens but the prompt has {len(tokens)}")
    n_past = min(n_past, len(tokens) - 1)
    if n_past == 0:
        return None, None
    return past_k[:, :n_past], past_v[:, :n_past]


def check_past(shape: KVShape, past_k: torch.Tensor | None, past_v: torch.Tensor | None) -> int:
    """Tokens covered by a past (k, v) of ``shape`` (0 without one); a malformed past raises BadIndices."""
    if past_k is None and past_v is None:
        return 0
    if past_k is None or past_v is None:
        raise BadIndices("give both past_k and past_v, or neither")
    want = (shape.layers, shape.heads, shape.head_dim)
    for t, name in ((past_k, "past_k"), (past_v, "past_v")):
        if t.dim() != 4 or (t.shape[0], t.shape[2], t.shape[3]) != want:
            raise BadIndices(f"{name} must be (layers={shape.layers}, n, heads={shape.heads}, "
                             f"head_dim={shape.head_dim}), got {tuple(t.shape)}")
    if past_k.shape[1] != past_v.shape[1]:
        raise BadIndices("past_k and past_v cover different numbers of tokens")
    return int(past_k.shape[1])


@contextlib.contextmanager
def intra_op_threads(n: int | None):
    """Run with ``n`` intra-op threads on this thread, then restore the setting."""
    before = torch.get_num_threads()
    if n is None or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class TinyModel:
    """Pre-norm decoder: RMSNorm, multi-head attention with RoPE, GELU MLP.

    ``threads`` is the number of intra-op threads a forward pass uses (None:
    torch's current setting). The default 1 suits a model this small: with
    more, every tiny op pays a thread barrier, which on a busy machine makes a
    forward pass ten times slower.
    """

    def __init__(self, layers: int = 4, heads: int = 2, head_dim: int = 16, vocab: int = 256, seed: int = 0,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 rope_base: float = 10000.0, threads: int | None = 1) -> None:
        for name, value in (("layers", layers), ("heads", heads), ("head_dim", head_dim), ("vocab", vocab)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {head_dim}")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads <= 0):
            raise ConfigError(f"threads must be a positive int or None, got {threads!r}")
        self.layers, self.heads, self.head_dim, self.vocab = layers, heads, head_dim, vocab
        self.threads = threads
        self.seed = seed
        self.dtype = dtype
        self.device = check_device(device) if device is not None else torch.device("cpu")
        d = heads * head_dim
        self.d_model = d
        g = torch.Generator().manual_seed(seed)

        def init(*shape: int, std: float) -> torch.Tensor:
            w = torch.randn(*shape, generator=g, dtype=torch.float64) * std
            return w.to(self.device, dtype)

        self.embed = init(vocab, d, std=1.0)
        self.blocks = []
        for _ in range(layers):
            self.blocks.append({
                "norm1": torch.ones(d, dtype=dtype, device=self.device),
                "wqkv": init(d, 3 * d, std=1.0 / math.sqrt(d)),
                "wo": init(d, d, std=1.0 / math.sqrt(d)),
                "norm2": torch.ones(d, dtype=dtype, device=self.device),
                "w1": init(d, 4 * d, std=1.0 / math.sqrt(d)),
                "w2": init(4 * d, d, std=1.0 / math.sqrt(4 * d)),
            })
        self.final_norm = torch.ones(d, dtype=dtype, device=self.device)
        self.lm_head = init(d, vocab, std=2.0 / math.sqrt(d))
        half = head_dim // 2
        self._inv_freq = rope_base ** (-torch.arange(half, dtype=torch.float64) * 2.0 / head_dim)

    @property
    def kv_shape(self) -> KVShape:
        return KVShape(self.layers, self.heads, self.head_dim, self.dtype)

    def prefill_flops(self, n_new: int, n_past: int) -> int:
        """Counted work of ``prefill`` (qkv, output, 4x MLP per layer; attention; LM head)."""
        d = self.d_model
        return decoder_flops(n_new, n_past, self.layers * 12 * d * d, self.layers * d, d * self.vocab)

    def _rope(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, start + n, dtype=torch.float64)
        angles = pos[:, None] * self._inv_freq[None, :]
        cos = angles.cos().to(self.device, self.dtype)[:, None, :]
        sin = angles.sin().to(self.device, self.dtype)[:, None, :]
        return cos, sin

    @staticmethod
    def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    @property
    def name(self) -> str:
        """Names the KV this model produces (storage keys are namespaced by it)."""
        return f"tinymodel-{self.layers}x{self.heads}x{self.head_dim}-s{self.seed}"

    def prefill(self, tokens, past_k: torch.Tensor | None = None, past_v: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run ``tokens`` after ``past`` KV; returns (logits of the last token, k, v).

        ``past_k``/``past_v`` are (layers, n_past, heads, head_dim) for the
        tokens before ``tokens``; the returned ``k``/``v`` are (layers, n_new,
        heads, head_dim) for the new tokens only.
        """
        with intra_op_threads(self.threads), torch.inference_mode():
            return self._prefill(tokens, past_k, past_v)

    def _prefill(self, tokens, past_k, past_v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids = torch.as_tensor(check_tokens(tokens, self.vocab), dtype=torch.int64)
        n = ids.numel()
        if n == 0:
            raise BadIndices("prefill needs at least one new token")
        n_past = check_past(self.kv_shape, past_k, past_v)
        H, D = self.heads, self.head_dim
        x = self.embed[ids.to(self.device)]
        cos, sin = self._rope(n_past, n)
        mask = None
        if n_past:
            q_pos = torch.arange(n_past, n_past + n, device=self.device)
            allowed = torch.arange(n_past + n, device=self.device)[None, :] <= q_pos[:, None]
            # an additive float mask, built once, spares SDPA a bool->float conversion per layer
            mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device).masked_fill_(~allowed, float("-inf"))
        ks, vs = [], []
        for li, blk in enumerate(self.blocks):
            h = _rms_norm(x, blk["norm1"])
            q, k, v = (h @ blk["wqkv"]).view(n, 3, H, D).unbind(1)
            q = self._apply_rope(q, cos, sin)
            k = self._apply_rope(k, cos, sin)
            ks.append(k)
            vs.append(v)
            if n_past:
                k_all = torch.cat([past_k[li].to(self.device, self.dtype), k], 0)
                v_all = torch.cat([past_v[li].to(self.device, self.dtype), v], 0)
            else:
                k_all, v_all = k, v
            # 4-D (batch, heads, seq, dim) inputs take the fused CPU kernel, not the math path
            attn = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k_all.transpose(0, 1)[None], v_all.transpose(0, 1)[None],
                attn_mask=mask, is_causal=mask is None)[0]
            x = x + attn.transpose(0, 1).reshape(n, H * D) @ blk["wo"]
            x = x + F.gelu(_rms_norm(x, blk["norm2"]) @ blk["w1"]) @ blk["w2"]
        logits = _rms_norm(x[-1], self.final_norm) @ self.lm_head
        return logits, torch.stack(ks), torch.stack(vs)

    def generate(self, tokens, max_new: int, past_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[int]:
        """Greedy continuation of ``tokens`` (``max_new`` new ids).

        ``past_kv`` = (k, v) of the first n_past tokens of ``tokens`` (e.g.
        loaded from the cache); only the rest are computed. If it covers every
        token, the last one is recomputed to get its logits.
        """
        tokens = list(tokens)
        past_k, past_v = generation_past(self.kv_shape, tokens, max_new, past_kv)
        out: list[int] = []
        new = tokens[past_k.shape[1] if past_k is not None else 0:]
        with intra_op_threads(self.threads), torch.inference_mode():
            for _ in range(max_new):
                logits, k, v = self._prefill(new, past_k, past_v)
                past_k = k if past_k is None else torch.cat([past_k.to(k.device, k.dtype), k], 1)
                past_v = v if past_v is None else torch.cat([past_v.to(v.device, v.dtype), v], 1)
                out.append(int(torch.argmax(logits)))
                new = [out[-1]]
        return out


__all__ = ["KVModel", "TinyModel", "check_past", "check_tokens", "decoder_flops", "generation_past", "intra_op_threads"]
