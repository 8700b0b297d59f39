"""Subcommands of the hicache-fsm command line."""
