"""SGLang's own ``RadixCache`` as a same-run peer of ``bench scale`` (optional: needs ``sglang`` importable).

The baselines of ``bench.baselines`` re-implement SGLang's loop; this peer runs
the real one, so "ours / SGLang" is measured in the same run instead of
modelled. It is built the way SGLang's unit tests build it
(``RadixCache.create_simulated`` with a mock allocator): CPU, no memory pools,
LRU eviction (SGLang's default), KV events and metrics off. Each call does
what SGLang's scheduler does around it: the request's ids are held as an
``array('q')`` (``engine_form``, untimed; or a list, ``PEER_FORMS``, where
ours is timed on Python ids) and wrapped in a ``RadixKey`` per call; a match
also reads the prefix's device slots with ``path_device_indices`` (our
``match_prefix`` hands them back; ``match_length`` skips them); eviction
frees each victim's slots through the allocator.

SGLang's package imports torchvision through model configs that
``RadixCache`` never uses. Where torchvision cannot be imported (its wheels
follow torch releases), an empty placeholder stands in during that import
only and is removed afterwards.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
from array import array
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Callable, Iterator, Sequence

import torch

NAME = "sglang_peer"
# How the peer is handed a request's ids (untimed), and how ``bench scale`` names that form.
PEER_FORMS: dict[str, tuple[Callable[[Sequence[int]], Any], str]] = {
    "array": (lambda ids: array("q", ids), "an array('q'), as SGLang's scheduler holds ids"),
    "list": (list, "a list (SGLang's RadixKey takes lists, as its unit tests hand them; it keeps no tuples)"),
}


def peer_form(ours: str) -> str:
    """The ``PEER_FORMS`` entry matching the form ours is handed: the same array, or Python ids as a list."""
    return "array" if ours == "array" else "list"


_TORCHVISION = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")


class PeerUnavailable(ImportError):
    """SGLang's ``RadixCache`` cannot be imported here; the message says why in one line."""


@dataclass(frozen=True)
class SGLangRadix:
    """The SGLang names the peer uses, imported once by ``load``."""

    version: str
    radix_cache: Any
    radix_key: Any
    match_params: Any
    insert_params: Any
    evict_params: Any


def _torchvision_importable() -> bool:
    try:
        importlib.import_module("torchvision")
        return True
    except Exception:  # a wheel built for another torch fails with RuntimeError, not ImportError
        for name in [n for n in sys.modules if n.split(".")[0] == "torchvision"]:
            del sys.modules[name]
        return False


@contextmanager
def _torchvision_placeholder() -> Iterator[None]:
    """Empty ``torchvision`` modules while SGLang imports, when the real one cannot be imported."""
    if _torchvision_importable():
        yield
        return
    try:  # transformers caches whether torchvision exists: let it see the truth before the placeholder exists
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()
    except ImportError:
        pass
    placeholders = {name: types.ModuleType(name) for name in _TORCHVISION}
    for name, module in placeholders.items():
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    interpolation = type("InterpolationMode", (), {"BICUBIC": "bicubic", "BILINEAR": "bilinear"})
    placeholders["torchvision"].transforms = placeholders["torchvision.transforms"]
    placeholders["torchvision.transforms"].functional = placeholders["torchvision.transforms.functional"]
    placeholders["torchvision.transforms"].InterpolationMode = interpolation
    placeholders["torchvision.transforms.functional"].InterpolationMode = interpolation
    sys.modules.update(placeholders)
    try:
        yield
    finally:
        for name, module in placeholders.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]


def load() -> SGLangRadix:
    """Import SGLang's ``RadixCache`` and its parameter types, or raise ``PeerUnavailable``."""
    try:
        importlib.import_module("sglang")
        with _torchvision_placeholder():
            radix = importlib.import_module("sglang.srt.mem_cache.radix_cache")
            base = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
    except Exception as exc:  # any failure of a third-party import means "no peer", said in one line
        detail = " ".join(str(exc).split()) or type(exc).__name__
        raise PeerUnavailable(f"SGLang's RadixCache cannot be imported ({type(exc).__name__}: {detail})") from None
    try:
        version = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return SGLangRadix(version, radix.RadixCache, radix.RadixKey, base.MatchPrefixParams, base.InsertParams,
                       base.EvictParams)


class _CountingAllocator:
    """The mock token-to-KV allocator SGLang's tests hand ``create_simulated``: counts the slots it is given back."""

    device = "cpu"

    def __init__(self) -> None:
        self.freed = 0

    def free_segment(self, indices: torch.Tensor, start_pos: int = 0) -> None:
        self.freed += len(indices)


class SGLangRadixPeer:
    """SGLang's ``RadixCache`` behind ``RadixLikeSGLang``'s interface (match / insert / lock refs / evict)."""

    def __init__(self, sgl: SGLangRadix, page_size: int, ids: str = "array") -> None:
        self._sgl = sgl
        self.allocator = _CountingAllocator()
        self.cache = sgl.radix_cache.create_simulated(mock_allocator=self.allocator, page_size=page_size)
        self._form = PEER_FORMS[ids][0]

    def engine_form(self, tokens: Sequence[int]) -> Sequence[int]:
        """What the engine holds for a request's ids: an ``array('q')`` (SGLang's scheduler) or a list (``ids``)."""
        return self._form(tokens)

    def match_prefix(self, key: Sequence[int]) -> tuple[torch.Tensor, Any]:
        """The cached prefix's device slots and its last node, as the scheduler reads them."""
        sgl = self._sgl
        node = self.cache.match_prefix(sgl.match_params(key=sgl.radix_key(key))).last_device_node
        return self.cache.path_device_indices(node), node

    def match_length(self, key: Sequence[int]) -> int:
        """``match_prefix`` alone: the cached prefix's length, no slots read."""
        sgl = self._sgl
        return self.cache.match_prefix(sgl.match_params(key=sgl.radix_key(key))).device_prefix_len

    def insert(self, key: Sequence[int], value: torch.Tensor) -> int:
        """Insert ``key`` with its slots; the length that was already cached."""
        sgl = self._sgl
        return self.cache.insert(sgl.insert_params(key=sgl.radix_key(key), value=value)).prefix_len

    def inc_lock_ref(self, node: Any) -> None:
        self.cache.inc_lock_ref(node)

    def dec_lock_ref(self, node: Any) -> None:
        self.cache.dec_lock_ref(node)

    def evict(self, num_tokens: int) -> int:
        """Evict at least ``num_tokens`` (whole leaves); the tokens freed."""
        return self.cache.evict(self._sgl.evict_params(num_tokens=num_tokens)).num_tokens_evicted
