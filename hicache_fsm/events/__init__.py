"""KV cache events for routers: what each residency transition makes readable or unreadable, per tier.

``names`` holds the spec vocabulary (importable without the ``events``
extra); the schema, the hook on a cache, the ZMQ publisher and subscriber
need ``msgspec`` and ``pyzmq`` (``pip install hicache_fsm[events]``) and are
imported on first use: ``from hicache_fsm.events import enable_kv_events``.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "enable_kv_events": "hicache_fsm.events.hook",
    "disable_kv_events": "hicache_fsm.events.hook",
    "reset_with_events": "hicache_fsm.events.hook",
    "KVEventHook": "hicache_fsm.events.hook",
    "ZmqEventPublisher": "hicache_fsm.events.publisher",
    "ZmqEventSubscriber": "hicache_fsm.events.subscriber",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hicache_fsm.events' has no attribute {name!r}")
