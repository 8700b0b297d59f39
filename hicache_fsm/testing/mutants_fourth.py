"""The fourth set of planted controller bugs: tree namespaces that leak into each other, and host layouts
copied at the wrong place.

A namespace (a LoRA id, a tenant) keeps two requests with the same tokens apart (their KV differs): in the
tree, in storage keys and in what a prefetch inserts. Each namespace bug here lets one namespace see the
other's pages; the fuzzers meet them through ``HiCacheAdapter(namespaces=2)`` (``testing.namespaces``),
where prompts starting with 1 and 2 are the same tokens in two namespaces. The page_first and
page_first_direct host layouts index pages and layers each its own way; their bugs show only in a pool of
that layout with pages of more than one token. Registered into ``testing.mutants.MUTANTS`` as the second
and third sets are.
"""

from __future__ import annotations

from typing import Any

import torch

from hicache_fsm.testing.mutants_more import Planted, hicache_class, planter

__all__ = ["FOURTH"]

FOURTH: list[Planted] = []
_fourth = planter(FOURTH)


@_fourth("match_ignores_namespace", "a lookup that walks the default namespace whatever the request's "
                                    "(another tenant's prefix matches)")
def _match_ignores_namespace(p: Any) -> None:
    from hicache_fsm.request_ids import RequestIds

    orig = RequestIds.match_walk
    p.setattr(RequestIds, "match_walk", lambda self, tokens, namespace: orig(self, tokens, None))


@_fourth("insert_ignores_namespace", "an insert that files every prefix under the default namespace")
def _insert_ignores_namespace(p: Any) -> None:
    HiCache = hicache_class()
    orig = HiCache.insert

    def insert(self, tokens, device_indices, namespace=None, priority=0):
        return orig(self, tokens, device_indices, None, priority)

    p.setattr(HiCache, "insert", insert)


@_fourth("split_forgets_namespace", "a node split whose new upper half is filed in the default namespace")
def _split_forgets_namespace(p: Any) -> None:
    from hicache_fsm.radix import RadixTree

    orig = RadixTree.split

    def split(self, node, at):
        upper = orig(self, node, at)
        upper.namespace = None
        return upper

    p.setattr(RadixTree, "split", split)


@_fourth("storage_keys_ignore_namespace", "storage keys chained from no namespace seed (two tenants' equal "
                                          "prompts share their pages in storage)", storage=True)
def _storage_keys_ignore_namespace(p: Any) -> None:
    from hicache_fsm.storage import tier

    p.setattr(tier, "namespace_seed", lambda namespace: None)


@_fourth("prefetch_lands_in_default_namespace", "a prefetch whose fetched pages are inserted under the default "
                                                "namespace, not the request's", storage=True)
def _prefetch_lands_in_default_namespace(p: Any) -> None:
    from hicache_fsm.storage.prefetch import PrefetchOp

    orig = PrefetchOp.__init__

    def init(self, request_id, tokens, keys, anchor, anchor_pin, namespace, *rest, **kw):
        orig(self, request_id, tokens, keys, anchor, anchor_pin, None, *rest, **kw)

    p.setattr(PrefetchOp, "__init__", init)


# =========================================================================== host layouts


def _wrap_cpu_pairs(p: Any, layout: str, pairs: Any) -> None:
    """Patch the CPU copy's view pairs of whole-model copies for one host ``layout``: ``pairs(dev, host, runs)``."""
    from hicache_fsm import copy

    orig = copy._cpu_pairs

    def cpu_pairs(dev, host, runs, layer):
        if layer is None and host.layout == layout:
            return pairs(dev, host, runs)
        return orig(dev, host, runs, layer)

    p.setattr(copy, "_cpu_pairs", cpu_pairs)


@_fourth("page_first_host_run_at_device_slot", "a page_first host copy written and read at the device run's "
                                               "slot, not the host run's", host_layout="page_first")
def _page_first_host_run_at_device_slot(p: Any) -> None:
    def pairs(dev, host, runs):
        dt = dev.kv.transpose(1, 2)
        return [(dt.narrow(1, d, n), host.kv.narrow(1, d, n)) for d, h, n in runs]

    _wrap_cpu_pairs(p, "page_first", pairs)


@_fourth("page_first_direct_page_in_tokens", "a page_first_direct host run found at its slot number taken for "
                                             "a page number (right only for the first page)",
         host_layout="page_first_direct")
def _page_first_direct_page_in_tokens(p: Any) -> None:
    def pairs(dev, host, runs):
        P, L, H, D = dev.shape.parts, dev.shape.layers, dev.shape.heads, dev.shape.head_dim
        ps = dev.page_size
        hkv = host.kv  # (parts, pages, layers, page_size, heads, head_dim)
        return [(dev.kv.narrow(2, d, n).view(P, L, n // ps, ps, H, D).transpose(1, 2),
                 hkv.narrow(1, h, n // ps)) for d, h, n in runs]

    _wrap_cpu_pairs(p, "page_first_direct", pairs)


@_fourth("page_first_storage_page_at_slot", "a page_first host page stored and fetched at its page number taken "
                                            "for a slot number", storage=True, host_layout="page_first")
def _page_first_storage_page_at_slot(p: Any) -> None:
    from hicache_fsm.pools import HostKVPool

    orig = HostKVPool.page_views

    def page_views(self, page_id):
        if self.layout != "page_first":
            return orig(self, page_id)
        ps = self.page_size
        halves = (self.k,) if self.v is None else (self.k, self.v)
        return [half[page_id: page_id + ps].reshape(-1).view(torch.uint8) for half in halves]

    p.setattr(HostKVPool, "page_views", page_views)
