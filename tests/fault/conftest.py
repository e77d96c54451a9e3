"""Fixtures for the fault suite: the shared stack of the integration tests, and a Site on it."""

from __future__ import annotations

import pytest

from tests.fault.fleet import Site

# The integration suite's stack fixtures (start or reuse the shared Kafka and Redis, once per session).
from tests.integration.conftest import kafka_bootstrap, local_stack, redis_url, stack_config  # noqa: F401


@pytest.fixture
def site(stack_config, local_stack, redis_url, tiny_llama, tmp_path) -> Site:  # noqa: F811
    return Site(stack_config, redis_url, str(tiny_llama), tmp_path)
