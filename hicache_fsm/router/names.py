"""Router policy names and defaults (no msgspec needed: the command line lists them)."""

POLICIES = ("round_robin", "prefix_aware", "prefix_aware_capped")
DEFAULT_LOAD_CAP = 1.5
MAX_INSTANCES = 1024  # instances one router places on: each is a cache of its own, and a placement scans them all
