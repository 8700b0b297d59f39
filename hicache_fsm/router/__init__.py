"""A KV-aware router: a global prefix index built from KV events alone, and placement policies.

``PrefixIndex`` (``index``) holds, per instance and per tier, the block
hashes its events announced; ``Router`` (``policies``) places a request on
an instance by ``round_robin``, ``prefix_aware`` or ``prefix_aware_capped``.
The policy names (``names``) import without the ``events`` extra; the rest
needs msgspec, and is imported on first use.
"""

from __future__ import annotations

import importlib

from hicache_fsm.router.names import DEFAULT_LOAD_CAP, POLICIES

_LAZY = {"PrefixIndex": "hicache_fsm.router.index", "Router": "hicache_fsm.router.policies"}

__all__ = ["DEFAULT_LOAD_CAP", "POLICIES", "PrefixIndex", "Router"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hicache_fsm.router' has no attribute {name!r}")
