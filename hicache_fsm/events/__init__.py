"""KV cache events for routers: what each residency transition makes readable or unreadable, per tier.

``names`` holds the spec vocabulary (importable without the ``events``
extra); the schema, the hook on a cache, the ZMQ publisher and subscriber
need ``msgspec`` and ``pyzmq`` (``pip install hicache-fsm[events]``).
"""
