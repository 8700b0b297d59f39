"""Shared test set-up: the real redis-server fixture, hypothesis profiles, quiet cache logs.

The default profile drops hypothesis' per-example deadline: CI machines are
shared and noisy, and speed is measured by the benchmarks, not by tests.
"""

import os

import pytest
from hypothesis import HealthCheck, settings

from hicache_fsm.testing.explorer import quiet_cache_logs

pytest_plugins = ["redis_fixture", "mooncake_fixture"]

settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def quiet_logs():
    """Silence the cache's warnings about failures a test injects on purpose."""
    with quiet_cache_logs():
        yield
