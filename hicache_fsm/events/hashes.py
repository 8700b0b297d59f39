"""Page keys of tree nodes as int64 block hashes, memoised per node.

A node's pages are keyed by the same chained SHA-256 the storage tier uses
(:func:`hicache_fsm.storage.keys.page_keys`, seeded per namespace by
:func:`hicache_fsm.storage.tier.namespace_seed`), so one prefix has one hash in
every instance and in L3. Events carry each key's first 64 bits as a signed
int64, SGLang's ``hash_str_to_int64``. A router computes the same hashes from
a request's tokens with :func:`request_hashes`.
"""

from __future__ import annotations

from typing import Hashable, Sequence

from hicache_fsm.radix import TreeNode
from hicache_fsm.storage.keys import page_keys
from hicache_fsm.storage.tier import namespace_seed


def int64_hash(hex_key: str) -> int:
    """SGLang's event form of a page key: its first 16 hex digits as a signed 64-bit integer."""
    value = int(hex_key[:16], 16)
    return value - (1 << 64) if value >= 1 << 63 else value


def request_hashes(tokens: Sequence[int], page_size: int, namespace: Hashable = None) -> list[int]:
    """The int64 block hashes of every full page of ``tokens`` from the start of a sequence."""
    return [int64_hash(k) for k in page_keys(tokens, page_size, namespace_seed(namespace))]


class NodeKeys:
    """Hex page keys per live node id; a split slices them, a removal forgets them."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._keys: dict[int, tuple[str, ...]] = {}

    def hex_keys(self, node: TreeNode) -> tuple[str, ...]:
        keys = self._keys.get(node.id)
        if keys is not None:
            return keys
        parent = node.parent
        prior = namespace_seed(node.namespace) if parent is None or parent.is_root else self.hex_keys(parent)[-1]
        keys = tuple(page_keys(node.key, self.page_size, prior))
        self._keys[node.id] = keys
        return keys

    def int_keys(self, node: TreeNode) -> list[int]:
        return [int64_hash(k) for k in self.hex_keys(node)]

    def parent_hash(self, node: TreeNode) -> int | None:
        parent = node.parent
        return None if parent is None or parent.is_root else int64_hash(self.hex_keys(parent)[-1])

    def split(self, node: TreeNode, upper: TreeNode) -> None:
        keys = self._keys.pop(node.id, None)
        if keys is not None:
            pages = upper.num_tokens // self.page_size
            self._keys[upper.id], self._keys[node.id] = keys[:pages], keys[pages:]

    def forget(self, node: TreeNode) -> None:
        self._keys.pop(node.id, None)

    def clear(self) -> None:
        self._keys.clear()
