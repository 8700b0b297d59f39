"""The fourth set of planted controller bugs: tree namespaces (LoRA ids, tenants) that leak into each other.

A namespace keeps two requests with the same tokens apart (their KV differs): in the tree, in storage keys
and in what a prefetch inserts. Each bug here lets one namespace see the other's pages; the fuzzers meet
them through ``HiCacheAdapter(namespaces=2)`` (``testing.namespaces``), where prompts starting with 1 and
2 are the same tokens in two namespaces. Registered into ``testing.mutants.MUTANTS`` as the second and
third sets are.
"""

from __future__ import annotations

from typing import Any

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
