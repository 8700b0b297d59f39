"""Shared test set-up: the real redis-server fixture and hypothesis profiles.

The default profile drops hypothesis' per-example deadline: CI machines are
shared and noisy, and speed is measured by the benchmarks, not by tests.
"""

import os

from hypothesis import HealthCheck, settings

pytest_plugins = ["redis_fixture"]

settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
