"""The local development stack: one Kafka broker (KRaft) and one redis-server, for dev, tests and CI.

Not part of the service: workers never import it. `infinilm stack ...`, the test fixtures
and the benchmarks use the names below; stack.py describes the stack.
"""

from devstack.config import DEFAULT_TOPICS, ServiceStatus, StackConfig, StackStatus
from devstack.kafka_admin import delete_topics, ensure_topics
from devstack.processes import StackError
from devstack.stack import stack_down, stack_status, stack_up

__all__ = [
    "DEFAULT_TOPICS",
    "ServiceStatus",
    "StackConfig",
    "StackError",
    "StackStatus",
    "delete_topics",
    "ensure_topics",
    "stack_down",
    "stack_status",
    "stack_up",
]
