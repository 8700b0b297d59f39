"""KV contents the fuzzers write and read back: a token's KV is a fingerprint of its prefix.

``insert`` writes, for token ``i`` of a prompt, a value derived from the prefix
``tokens[:i+1]`` into every layer (K positive, V its negation), exactly as a
transformer's KV depends only on the tokens up to it; read-back decodes a slot
to that fingerprint or to ``CORRUPT``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

__all__ = ["CORRUPT", "FP_LIMIT", "MAX_LAYERS", "decode_kv_lists", "encode_kv", "encoded", "fingerprints",
           "kv_fingerprint", "prefix_fingerprints"]

FP_LIMIT = 1 << 17  # fingerprint * 64 + layer stays exact in float32
MAX_LAYERS = 64
CORRUPT = -1  # what ``decode`` returns for a token whose layers / K / V disagree


def kv_fingerprint(prefix: Sequence[int]) -> int:
    """The value ``insert`` writes for the last token of ``prefix`` (deterministic across runs)."""
    return hash(tuple(prefix)) % (FP_LIMIT - 1) + 1


def fingerprints(tokens: Sequence[int]) -> list[int]:
    from hicache_fsm.testing.statekey import remember_prefix

    tokens = tuple(tokens)
    out = [kv_fingerprint(tokens[: i + 1]) for i in range(len(tokens))]
    for i, fp in enumerate(out):
        remember_prefix(fp, tokens[: i + 1])
    return out


def encode_kv(tokens: Sequence[int], layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V, each ``(layers, len(tokens), 1, 1)`` float32, carrying each token's fingerprint."""
    if not 0 < layers <= MAX_LAYERS:
        raise ValueError(f"layers must be in [1, {MAX_LAYERS}]")
    fp = torch.tensor(fingerprints(tokens), dtype=torch.float32)
    k = fp[None, :] * MAX_LAYERS + torch.arange(layers, dtype=torch.float32)[:, None]
    k = k[:, :, None, None]
    return k, -k


@functools.lru_cache(maxsize=4096)
def encoded(tokens: tuple[int, ...], layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    return encode_kv(tokens, layers)


@functools.lru_cache(maxsize=1 << 16)
def prefix_fingerprints(tokens: tuple[int, ...]) -> list[int]:
    return fingerprints(tokens)


def decode_kv_lists(k: list, v: list, slot: int) -> int:
    """Fingerprint stored at ``slot`` of K / V given as nested lists ``[layer][slot][0][0]``."""
    first = k[0][slot][0][0]
    fp = int(first) // MAX_LAYERS
    if fp <= 0:
        return CORRUPT
    for layer in range(len(k)):
        want = float(fp * MAX_LAYERS + layer)
        if k[layer][slot][0][0] != want or v[layer][slot][0][0] != -want:
            return CORRUPT
    return fp


