"""A Kafka broker of our own, for the one fault the shared broker must never see: being stopped.

It is a second stack (devstack) with its own free ports and state folder,
sharing only the jar cache (no second Maven fetch). Its Redis port is the
shared Redis, which `stack_up` reuses and `stack_down` leaves alone, since this
state folder holds no Redis pid file: stopping this stack stops only its broker.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from devstack import StackConfig, delete_topics, ensure_topics, stack_down, stack_status, stack_up
from tests.integration.redis_server import free_port


class PrivateKafka:
    def __init__(self, state_dir: Path, shared: StackConfig, partitions: int = 3) -> None:
        self.config = StackConfig(
            state_dir=state_dir, cache_dir=shared.cache_dir, kafka_port=free_port(), controller_port=free_port(),
            redis_host=shared.redis_host, redis_port=shared.redis_port, partitions=partitions, topics=(),
            kafka_heap="384m",
        )

    @property
    def bootstrap(self) -> str:
        return self.config.bootstrap_servers

    @property
    def pid(self) -> int | None:
        return stack_status(self.config).kafka.pid

    def start(self) -> None:
        # The data folder survives a stop, so a restart keeps topics, offsets and transactions.
        status = stack_up(self.config)
        assert status.kafka.up and status.kafka.pid, status

    def stop(self, *, hard: bool = False) -> None:
        """SIGTERM (a controlled shutdown, through stack_down) or SIGKILL (a crash)."""
        if not hard:
            stack_down(self.config)
            return
        pid = self.pid
        if pid is None:
            return
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while stack_status(self.config).kafka.pid is not None and time.monotonic() < deadline:
            time.sleep(0.2)

    def create_topics(self, names: list[str], partitions: int) -> None:
        ensure_topics(self.config, names, partitions)

    def delete_topics(self, names: list[str]) -> None:
        delete_topics(self.config, names)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            stack_down(self.config)
