"""Bindings of spec names to Python, one module per machine."""
