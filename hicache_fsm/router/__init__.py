"""A KV-aware router: a global prefix index built from KV events alone, and placement policies.

``PrefixIndex`` (``index``) holds, per instance and per tier, the block
hashes its events announced; ``Router`` (``policies``) places a request on
an instance by ``round_robin``, ``prefix_aware`` or ``prefix_aware_capped``.
"""

from hicache_fsm.router.index import PrefixIndex
from hicache_fsm.router.policies import POLICIES, Router

__all__ = ["POLICIES", "PrefixIndex", "Router"]
