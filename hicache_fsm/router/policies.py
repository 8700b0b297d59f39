"""Placement policies over the prefix index.

- ``round_robin``: instance ``r mod N`` for the r-th request; ignores the index.
- ``prefix_aware``: the instance holding the longest prefix of the request
  (device or host pages, device-resident pages breaking ties), then the
  least recently loaded, then the lowest number.
- ``prefix_aware_capped``: ``prefix_aware`` among the instances whose share of
  the last ``window`` placements is under ``load_cap`` times a fair share;
  with every instance over the cap, the least loaded one.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

from hicache_fsm.errors import ConfigError
from hicache_fsm.router.index import PrefixIndex, check_hashes
from hicache_fsm.router.names import DEFAULT_LOAD_CAP, MAX_INSTANCES, POLICIES

WINDOW_PER_INSTANCE = 8  # recent placements remembered per instance for the load cap


def check_load_cap(load_cap: object) -> float:
    """``load_cap`` as a float, or ``ConfigError`` unless it is a number >= 1 (inf: no cap)."""
    if not isinstance(load_cap, (int, float)) or isinstance(load_cap, bool) or not load_cap >= 1.0:
        raise ConfigError(f"load cap must be a number >= 1, got {load_cap!r:.40}")
    try:
        return float(load_cap)
    except OverflowError:  # an int past any float: no cap, as inf is
        return float("inf")


class Router:
    """Places requests on ``instances`` (numbered 0..N-1) with one of :data:`POLICIES`."""

    def __init__(self, instances: int, policy: str, index: PrefixIndex, load_cap: float = DEFAULT_LOAD_CAP) -> None:
        if isinstance(instances, bool) or not isinstance(instances, int) or not 1 <= instances <= MAX_INSTANCES:
            raise ConfigError(f"instances must be an int from 1 to {MAX_INSTANCES}, got {instances!r}")
        if policy not in POLICIES:
            raise ConfigError(f"router policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if not isinstance(index, PrefixIndex):
            raise ConfigError(f"index must be a PrefixIndex, got {type(index).__name__}")
        self.instances = instances
        self.policy = policy
        self.index = index
        self.load_cap = check_load_cap(load_cap)
        self.window = WINDOW_PER_INSTANCE * instances
        self._recent: deque[int] = deque(maxlen=self.window)
        self._load = [0] * instances  # placements per instance within the window
        self._count = 0

    def place(self, hashes: Sequence[int]) -> int:
        """The instance for a request whose page hashes are ``hashes``; records the placement."""
        hashes = check_hashes(hashes)  # under every policy: round robin reads no hash, but a caller's mistake is one
        n = self.instances
        if self.policy == "round_robin":
            choice = self._count % n
        else:
            candidates = list(range(n))
            if self.policy == "prefix_aware_capped" and len(self._recent) >= n:
                limit = self.load_cap * len(self._recent) / n
                under = [i for i in candidates if self._load[i] < limit]
                candidates = under or [min(candidates, key=lambda i: (self._load[i], i))]
            index = self.index
            choice = max(candidates, key=lambda i: (index.prefix_pages(i, hashes),
                                                     index.prefix_pages(i, hashes, ("device",)),
                                                     -self._load[i], -i))
        self._record(choice)
        return choice

    def _record(self, choice: int) -> None:
        self._count += 1
        if len(self._recent) == self.window:
            self._load[self._recent[0]] -= 1
        self._recent.append(choice)
        self._load[choice] += 1
