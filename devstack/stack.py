"""The local stack: one Kafka broker (KRaft, broker and controller in one JVM)
and one redis-server on this machine, with all data and logs in one folder.

The CLI (`infinilm stack ...`), the integration tests and CI start and stop the
stack through these functions only, so there is a single code path to keep
working. Kafka runs from jars that Maven fetches once into a cache
(ops/local/kafka/pom.xml picks the version); Redis is the system redis-server.

By default nothing is authenticated. A StackConfig with SASL users (and
optionally a TLS port and a Redis password) starts a secured stack instead;
devstack/security.py describes its listeners. Run a secured stack in its
own state folder and on its own ports.
"""

from __future__ import annotations

import logging

from devstack.config import ServiceStatus, StackConfig, StackStatus
from devstack.kafka import kafka_version, start_kafka
from devstack.kafka_admin import describe_topics, ensure_topics, kafka_answers, run_sync
from devstack.processes import Progress, read_pid, state_lock, stop_process, wait_for
from devstack.redis_server import redis_ping, start_redis
from devstack.security import SASL_MECHANISM

log = logging.getLogger(__name__)


def stack_up(cfg: StackConfig | None = None, *, progress: Progress | None = None) -> StackStatus:
    """Start Redis and Kafka unless they already answer, wait until both do, then create the topics.

    Idempotent: a service that already answers on its port is reused, whoever started it.
    Raises StackError (pointing at the log file) when a service does not come up in time.
    """
    cfg = cfg or StackConfig()
    say = progress or log.info
    with state_lock(cfg.state_dir, cfg.fetch_timeout_s + cfg.start_timeout_s):
        cfg.logs_dir.mkdir(parents=True, exist_ok=True)
        if redis_ping(cfg):
            say(f"Redis already answers on {cfg.redis_host}:{cfg.redis_port}; reusing it")
        else:
            start_redis(cfg, say)
            # Redis answers within milliseconds; a short wait also covers a failed bind, after
            # which a daemonized redis-server leaves no pid to watch.
            wait_for(lambda: redis_ping(cfg), "Redis", [cfg.redis_log], min(15.0, cfg.start_timeout_s), None)

        if kafka_answers(cfg):
            say(f"Kafka already answers on {cfg.bootstrap_servers}; reusing it")
        else:
            pid = read_pid(cfg.kafka_pid_file, "kafka.Kafka")
            if pid is None:
                pid = start_kafka(cfg, say)
            say(f"Waiting for Kafka on {cfg.bootstrap_servers} (pid {pid})")
            # WARN and ERROR only, so its tail names the cause; server.log has the full story.
            logs = [cfg.kafka_console_log, cfg.kafka_log]
            wait_for(lambda: kafka_answers(cfg), "Kafka", logs, cfg.start_timeout_s, pid)

        ensure_topics(cfg, cfg.topics, cfg.partitions)
    return stack_status(cfg)


def stack_down(cfg: StackConfig | None = None, *, progress: Progress | None = None) -> None:
    """Stop the Kafka and Redis processes this stack started (SIGTERM, then SIGKILL after a timeout).

    Services that answer but were not started by this stack (no live pid file) are left alone.
    """
    cfg = cfg or StackConfig()
    say = progress or log.info
    with state_lock(cfg.state_dir, cfg.fetch_timeout_s + cfg.start_timeout_s):
        stop_process(cfg.kafka_pid_file, "Kafka", "kafka.Kafka", cfg.stop_timeout_s, say)
        stop_process(cfg.redis_pid_file, "Redis", "redis-server", cfg.stop_timeout_s, say)


def stack_status(cfg: StackConfig | None = None) -> StackStatus:
    """Probe both services without starting or stopping anything."""
    cfg = cfg or StackConfig()
    kafka_pid = read_pid(cfg.kafka_pid_file, "kafka.Kafka")
    kafka_up = kafka_answers(cfg)
    topics: dict[str, int] = {}
    kafka_detail = _ownership(kafka_up, kafka_pid, f"Kafka {kafka_version()}" if kafka_pid else "Kafka")
    if cfg.sasl_users:
        tls = f", SASL_SSL on {cfg.tls_bootstrap_servers}" if cfg.kafka_tls_port is not None else ""
        kafka_detail += f"; SASL_PLAINTEXT ({SASL_MECHANISM}){tls}"
    if kafka_up:
        try:
            topics = run_sync(describe_topics(cfg, cfg.topics, timeout_s=5.0))
        except Exception as exc:  # status reports a sick broker instead of crashing on it
            kafka_detail = f"metadata failed: {type(exc).__name__}: {exc}"
    redis_pid = read_pid(cfg.redis_pid_file, "redis-server")
    redis_up = redis_ping(cfg)
    return StackStatus(
        kafka=ServiceStatus(
            name="kafka",
            address=cfg.bootstrap_servers,
            up=kafka_up,
            pid=kafka_pid,
            log_path=cfg.kafka_log,
            detail=kafka_detail,
        ),
        redis=ServiceStatus(
            name="redis",
            address=f"{cfg.redis_host}:{cfg.redis_port}",
            up=redis_up,
            pid=redis_pid,
            log_path=cfg.redis_log,
            detail=_ownership(redis_up, redis_pid, "redis-server") + ("; AUTH" if cfg.redis_password else ""),
        ),
        topics=topics,
    )


def _ownership(up: bool, pid: int | None, what: str) -> str:
    if pid is not None:
        return f"{what}, started by this stack"
    return f"{what}, not started by this stack (left alone by `down`)" if up else ""
