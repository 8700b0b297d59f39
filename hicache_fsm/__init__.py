"""hicache_fsm: a hierarchical KV cache whose every protocol is an explicit state machine.

``TokenIds`` and ``pack_token_ids`` (from ``hicache_fsm.tokens``) are the
engine's form of a request's ids: packed once, taken as they are by every
cache call. They load on first use, so importing the package imports no torch.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["TokenIds", "pack_token_ids"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from hicache_fsm import tokens

        return getattr(tokens, name)
    raise AttributeError(f"module 'hicache_fsm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
