"""Suite-wide pytest setup: the ``redis_server`` fixture (tests/redis_fixture.py) for every test module."""

pytest_plugins = ["redis_fixture"]
