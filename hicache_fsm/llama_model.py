"""A Hugging Face ``transformers`` Llama, run the way an engine runs it over a paged KV cache.

``LlamaModel`` builds ``LlamaForCausalLM`` from a small ``LlamaConfig`` with
grouped-query attention (fewer KV heads than query heads) and rotary
positions, and fills every weight from a seeded ``torch.Generator``: no
download, ever, and the same weights for the same arguments whatever
transformers initialises by default. It offers the same interface as
:class:`~hicache_fsm.model.TinyModel` (:class:`~hicache_fsm.model.KVModel`):
``prefill`` takes the KV of the cached prefix as tensors read from the device
pool, hands it to the model as its past (a ``DynamicCache`` at positions
``0..n_past-1``) and returns the KV the model computed for the new tokens, for
the engine to write into the slots the cache allocated.

Needs the ``llama`` extra (``transformers``); importing this module without it
raises ``ImportError``.
"""

from __future__ import annotations

import inspect
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here downloads; make sure nothing tries
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from hicache_fsm.errors import BadIndices, ConfigError
from hicache_fsm.model import check_past, check_tokens, decoder_flops, generation_past, intra_op_threads
from hicache_fsm.pools import KVShape, check_device


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value


class LlamaModel:
    """``LlamaForCausalLM`` with seeded random weights, grouped-query attention and RoPE.

    ``heads`` query heads share ``kv_heads`` KV heads (``heads`` a multiple of
    ``kv_heads``); the KV cache holds ``kv_heads`` heads per layer, which is
    what ``kv_shape`` reports. ``threads`` as in ``TinyModel``.
    """

    def __init__(self, layers: int = 4, heads: int = 4, kv_heads: int = 2, head_dim: int = 16, vocab: int = 256,
                 seed: int = 0, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 rope_base: float = 10000.0, threads: int | None = 1) -> None:
        for name, value in (("layers", layers), ("heads", heads), ("kv_heads", kv_heads), ("head_dim", head_dim),
                            ("vocab", vocab)):
            _positive(name, value)
        if heads % kv_heads:
            raise ConfigError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
        if head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {head_dim}")
        if threads is not None:
            _positive("threads", threads)
        if dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise ConfigError(f"dtype must be a floating dtype, got {dtype!r}")
        self.layers, self.heads, self.kv_heads, self.head_dim, self.vocab = layers, heads, kv_heads, head_dim, vocab
        self.seed, self.dtype, self.threads = seed, dtype, threads
        self.device = check_device(device) if device is not None else torch.device("cpu")
        hidden = heads * head_dim
        self.config = LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
            max_position_embeddings=1 << 20, rope_theta=rope_base, tie_word_embeddings=False,
            attn_implementation="sdpa")
        with torch.random.fork_rng(devices=[]):  # transformers' own init draws from the global generator
            model = LlamaForCausalLM(self.config)
        self._seed_weights(model, seed)
        self.hf = model.to(device=self.device, dtype=dtype).eval()
        forward = inspect.signature(self.hf.forward).parameters
        # transformers 5 names the past `cache`; earlier releases `past_key_values`
        self._cache_arg = "cache" if "cache" in forward else "past_key_values"
        self._last_logits_only = {"logits_to_keep": 1} if "logits_to_keep" in forward else {}

    @staticmethod
    def _seed_weights(model: LlamaForCausalLM, seed: int) -> None:
        """Every parameter from one seeded generator, in module order: norms 1, matrices ~ N(0, 1/fan_in).

        The embedding has unit variance and the LM head a larger scale than a
        trained model's init, so greedy answers have clear winners.
        """
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 1:
                    p.fill_(1.0)
                    continue
                std = 1.0 if name.endswith("embed_tokens.weight") else 1.0 / math.sqrt(p.shape[1])
                if name.endswith("lm_head.weight"):
                    std *= 2.0
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * std)

    @property
    def name(self) -> str:
        """Names the KV this model produces (storage keys are namespaced by it)."""
        dtype = str(self.dtype).removeprefix("torch.")
        return (f"llama-{self.layers}L-{self.heads}q{self.kv_heads}kv-d{self.head_dim}-v{self.vocab}-{dtype}"
                f"-s{self.seed}")

    @property
    def kv_shape(self) -> KVShape:
        return KVShape(self.layers, self.kv_heads, self.head_dim, self.dtype)

    def prefill_flops(self, n_new: int, n_past: int) -> int:
        """Counted work of ``prefill``: q/k/v/o projections, gated MLP, attention, LM head (last token)."""
        c = self.config
        hidden, kv = c.hidden_size, self.kv_heads * self.head_dim
        per_layer = hidden * hidden * 2 + hidden * kv * 2 + 3 * hidden * c.intermediate_size
        return decoder_flops(n_new, n_past, self.layers * per_layer, self.layers * self.heads * self.head_dim,
                             hidden * self.vocab)

    # ------------------------------------------------------------------ forward

    def _past(self, past_k: torch.Tensor | None, past_v: torch.Tensor | None) -> DynamicCache:
        """The pool's (layers, n, kv_heads, dim) KV as the model's past: per layer (1, kv_heads, n, dim)."""
        cache = DynamicCache()
        if past_k is not None:
            for layer in range(self.layers):
                k = past_k[layer].to(self.device, self.dtype).transpose(0, 1)[None]
                v = past_v[layer].to(self.device, self.dtype).transpose(0, 1)[None]
                cache.update(k, v, layer)
        return cache

    def _forward(self, ids: list[int], cache: DynamicCache, n_past: int) -> torch.Tensor:
        """Run ``ids`` at positions ``n_past..`` after ``cache`` (extended in place); logits of the last one."""
        n = len(ids)
        input_ids = torch.tensor([ids], dtype=torch.int64, device=self.device)
        positions = torch.arange(n_past, n_past + n, device=self.device)[None]
        out = self.hf(input_ids=input_ids, position_ids=positions, use_cache=True,
                      **{self._cache_arg: cache}, **self._last_logits_only)
        return out.logits[0, -1]

    def _new_kv(self, cache: DynamicCache, n_past: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The KV the last forward added to ``cache``, as (layers, n_new, kv_heads, dim)."""
        ks = [layer.keys[0, :, n_past:].transpose(0, 1) for layer in cache.layers]
        vs = [layer.values[0, :, n_past:].transpose(0, 1) for layer in cache.layers]
        return torch.stack(ks), torch.stack(vs)

    def prefill(self, tokens, past_k: torch.Tensor | None = None, past_v: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run ``tokens`` after ``past`` KV; returns (logits of the last token, k, v).

        ``past_k``/``past_v`` are (layers, n_past, kv_heads, head_dim) for the
        tokens before ``tokens``; the returned ``k``/``v`` have the same layout
        for the new tokens only (keys after rotary, as the model caches them).
        """
        ids = check_tokens(tokens, self.vocab)
        if not ids:
            raise BadIndices("prefill needs at least one new token")
        n_past = check_past(self.kv_shape, past_k, past_v)
        with intra_op_threads(self.threads), torch.inference_mode():
            cache = self._past(past_k, past_v)
            logits = self._forward(ids, cache, n_past)
            k, v = self._new_kv(cache, n_past)
        return logits, k, v

    def generate(self, tokens, max_new: int, past_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[int]:
        """Greedy continuation of ``tokens`` (``max_new`` new ids), one cache across the decode steps.

        ``past_kv`` = (k, v) of the first n_past tokens of ``tokens``; only the
        rest are computed. If it covers every token, the last one is recomputed
        to get its logits.
        """
        tokens = check_tokens(tokens, self.vocab)
        past_k, past_v = generation_past(self.kv_shape, tokens, max_new, past_kv)
        n_past = past_k.shape[1] if past_k is not None else 0
        out: list[int] = []
        with intra_op_threads(self.threads), torch.inference_mode():
            cache = self._past(past_k, past_v)
            new = tokens[n_past:]
            for _ in range(max_new):
                logits = self._forward(new, cache, n_past)
                n_past += len(new)
                out.append(int(torch.argmax(logits)))
                new = [out[-1]]
        return out


__all__ = ["LlamaModel"]
