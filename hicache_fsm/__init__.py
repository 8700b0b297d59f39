"""hicache_fsm: a hierarchical KV cache whose every protocol is an explicit state machine."""

__version__ = "0.1.0"
