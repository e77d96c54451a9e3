"""The local stack's settings (StackConfig) and what `stack_status` reports about it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from devstack.security import SaslUsers, check_redis_password, client_security_kwargs, normalize_sasl_users

DEFAULT_TOPICS: tuple[str, ...] = (
    "infinilm.requests.chat",
    "infinilm.requests.asr",
    "infinilm.requests.risk",
    "infinilm.results",
    "infinilm.deltas",
    "infinilm.dlq",
)


def default_cache_dir() -> Path:
    return Path(os.environ.get("INFINILM_CACHE_DIR") or "~/.cache/infinilm").expanduser()


def default_state_dir() -> Path:
    env = os.environ.get("INFINILM_STATE_DIR")
    return Path(env).expanduser() if env else default_cache_dir() / "stack"


@dataclass(frozen=True)
class StackConfig:
    """Where the local stack lives and how it listens. Defaults match config.yaml's defaults."""

    state_dir: Path = field(default_factory=default_state_dir)
    cache_dir: Path = field(default_factory=default_cache_dir)
    kafka_host: str = "127.0.0.1"
    kafka_port: int = 9092
    controller_port: int = 9093
    redis_host: str = "127.0.0.1"
    redis_port: int = 6379
    partitions: int = 3
    topics: tuple[str, ...] = DEFAULT_TOPICS
    kafka_heap: str = "512m"
    message_max_bytes: int = 2 * 1024 * 1024
    start_timeout_s: float = 120.0
    stop_timeout_s: float = 30.0
    fetch_timeout_s: float = 900.0
    # Security, all off by default. (name, password) pairs, or a mapping: the broker then takes
    # only SASL/SCRAM-SHA-512 logins. The first user is the stack's own (the broker logs in to
    # itself with it, and the stack creates topics with it). Users are fixed when the storage
    # is formatted: a state folder keeps the users it was first started with.
    sasl_users: SaslUsers = field(default=(), repr=False)
    # A second client listener, SASL_SSL, with a certificate from a CA made in state_dir/tls.
    kafka_tls_port: int | None = None
    redis_password: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # Accept str paths from callers; normalising at construction is not mutation of a live config.
        object.__setattr__(self, "state_dir", Path(self.state_dir).expanduser())
        object.__setattr__(self, "cache_dir", Path(self.cache_dir).expanduser())
        object.__setattr__(self, "topics", tuple(self.topics))
        object.__setattr__(self, "sasl_users", normalize_sasl_users(self.sasl_users))
        if self.partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {self.partitions}")
        ports = ["kafka_port", "controller_port", "redis_port"]
        if self.kafka_tls_port is not None:
            ports.append("kafka_tls_port")
            if not self.sasl_users:
                raise ValueError("kafka_tls_port needs sasl_users: the TLS listener is SASL_SSL")
        for name in ports:
            port = getattr(self, name)
            if not 0 < port < 65536:
                raise ValueError(f"{name} must be a TCP port, got {port}")
        kafka_ports = [getattr(self, name) for name in ports if name != "redis_port"]
        if len(set(kafka_ports)) != len(kafka_ports):
            raise ValueError("kafka_port, controller_port and kafka_tls_port must differ")
        if self.redis_password is not None:
            check_redis_password(self.redis_password)

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.kafka_host}:{self.kafka_port}"

    @property
    def tls_bootstrap_servers(self) -> str | None:
        return None if self.kafka_tls_port is None else f"{self.kafka_host}:{self.kafka_tls_port}"

    @property
    def tls_dir(self) -> Path:
        return self.state_dir / "tls"

    @property
    def tls_cafile(self) -> Path:
        """The CA that signed the broker's certificate; clients of the TLS listener trust it."""
        return self.tls_dir / "ca.pem"

    def kafka_client_kwargs(self, user: str | None = None, *, tls: bool = False) -> dict:
        """aiokafka security keyword arguments for one of this stack's users ({} when unsecured).

        `tls` picks the SASL_SSL listener: pair it with `bootstrap_servers=tls_bootstrap_servers`.
        """
        if not self.sasl_users:
            return {}
        if tls and self.kafka_tls_port is None:
            raise ValueError("this stack has no TLS listener (kafka_tls_port is None)")
        return client_security_kwargs(self.sasl_users, self.tls_cafile if tls else None, user=user)

    @property
    def redis_url(self) -> str:
        return f"redis://{self.redis_host}:{self.redis_port}/0"

    @property
    def logs_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def kafka_data_dir(self) -> Path:
        return self.state_dir / "kafka" / "data"

    @property
    def kafka_properties(self) -> Path:
        return self.state_dir / "kafka" / "server.properties"

    @property
    def kafka_pid_file(self) -> Path:
        return self.state_dir / "kafka.pid"

    @property
    def kafka_log(self) -> Path:
        return self.logs_dir / "server.log"

    @property
    def kafka_console_log(self) -> Path:
        return self.logs_dir / "kafka-console.log"

    @property
    def kafka_users_marker(self) -> Path:
        return self.state_dir / "kafka" / "sasl-users.fingerprint"

    @property
    def redis_dir(self) -> Path:
        return self.state_dir / "redis"

    @property
    def redis_pid_file(self) -> Path:
        return self.state_dir / "redis.pid"

    @property
    def redis_log(self) -> Path:
        return self.logs_dir / "redis.log"


@dataclass(frozen=True)
class ServiceStatus:
    name: str
    address: str
    up: bool
    pid: int | None  # a live process from our pid file; None when not ours or not running
    log_path: Path
    detail: str = ""


@dataclass(frozen=True)
class StackStatus:
    kafka: ServiceStatus
    redis: ServiceStatus
    topics: Mapping[str, int]  # configured topics that exist -> partition count

    @property
    def up(self) -> bool:
        return self.kafka.up and self.redis.up
