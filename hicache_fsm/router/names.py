"""Router policy names and defaults (no msgspec needed: the command line lists them)."""

POLICIES = ("round_robin", "prefix_aware", "prefix_aware_capped")
DEFAULT_LOAD_CAP = 1.5
