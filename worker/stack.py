"""The local stack: one Kafka broker (KRaft, broker and controller in one JVM)
and one redis-server on this machine, with all data and logs in one folder.

The CLI (`infinilm stack ...`), the integration tests and CI start and stop the
stack through these functions only, so there is a single code path to keep
working. Kafka runs from jars that Maven fetches once into a cache
(ops/local/kafka/pom.xml picks the version); Redis is the system redis-server.

By default nothing is authenticated. A StackConfig with SASL users (and
optionally a TLS port and a Redis password) starts a secured stack instead;
worker/stack_security.py describes its listeners. Run a secured stack in its
own state folder and on its own ports.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import hashlib
import logging
import os
import secrets
import shutil
import subprocess
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import redis
from aiokafka.admin import AIOKafkaAdminClient, NewPartitions, NewTopic
from aiokafka.errors import TopicAlreadyExistsError, for_code
from redis.backoff import NoBackoff
from redis.retry import Retry

from worker.stack_processes import (
    Progress,
    StackError,
    port_open,
    read_pid,
    spawn_detached,
    state_lock,
    stop_process,
    tail,
    wait_for,
)
from worker.stack_security import (
    SASL_MECHANISM,
    SaslUsers,
    check_redis_password,
    client_security_kwargs,
    ensure_tls_material,
    normalize_sasl_users,
    server_security_properties,
    storage_format_argfile,
    users_fingerprint,
    write_private,
)

log = logging.getLogger(__name__)

DEFAULT_TOPICS: tuple[str, ...] = (
    "infinilm.requests.chat",
    "infinilm.requests.asr",
    "infinilm.requests.risk",
    "infinilm.results",
    "infinilm.deltas",
    "infinilm.dlq",
)

KAFKA_OPS_DIR = Path(__file__).resolve().parents[1] / "ops" / "local" / "kafka"

T = TypeVar("T")


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


# ---------------------------------------------------------------- public API


def stack_up(cfg: StackConfig | None = None, *, progress: Progress | None = None) -> StackStatus:
    """Start Redis and Kafka unless they already answer, wait until both do, then create the topics.

    Idempotent: a service that already answers on its port is reused, whoever started it.
    Raises StackError (pointing at the log file) when a service does not come up in time.
    """
    cfg = cfg or StackConfig()
    say = progress or log.info
    with state_lock(cfg.state_dir, cfg.fetch_timeout_s + cfg.start_timeout_s):
        cfg.logs_dir.mkdir(parents=True, exist_ok=True)
        if _redis_ping(cfg):
            say(f"Redis already answers on {cfg.redis_host}:{cfg.redis_port}; reusing it")
        else:
            _start_redis(cfg, say)
            # Redis answers within milliseconds; a short wait also covers a failed bind, after
            # which a daemonized redis-server leaves no pid to watch.
            wait_for(lambda: _redis_ping(cfg), "Redis", [cfg.redis_log], min(15.0, cfg.start_timeout_s), None)

        if _kafka_answers(cfg):
            say(f"Kafka already answers on {cfg.bootstrap_servers}; reusing it")
        else:
            pid = read_pid(cfg.kafka_pid_file, "kafka.Kafka")
            if pid is None:
                pid = _start_kafka(cfg, say)
            say(f"Waiting for Kafka on {cfg.bootstrap_servers} (pid {pid})")
            # WARN and ERROR only, so its tail names the cause; server.log has the full story.
            logs = [cfg.kafka_console_log, cfg.kafka_log]
            wait_for(lambda: _kafka_answers(cfg), "Kafka", logs, cfg.start_timeout_s, pid)

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
    kafka_up = _kafka_answers(cfg)
    topics: dict[str, int] = {}
    kafka_detail = _ownership(kafka_up, kafka_pid, f"Kafka {kafka_version()}" if kafka_pid else "Kafka")
    if cfg.sasl_users:
        tls = f", SASL_SSL on {cfg.tls_bootstrap_servers}" if cfg.kafka_tls_port is not None else ""
        kafka_detail += f"; SASL_PLAINTEXT ({SASL_MECHANISM}){tls}"
    if kafka_up:
        try:
            topics = _run(_describe_topics(cfg, cfg.topics, timeout_s=5.0))
        except Exception as exc:  # status reports a sick broker instead of crashing on it
            kafka_detail = f"metadata failed: {type(exc).__name__}: {exc}"
    redis_pid = read_pid(cfg.redis_pid_file, "redis-server")
    redis_up = _redis_ping(cfg)
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


def ensure_topics(
    cfg: StackConfig | None = None,
    topics: Sequence[str] | None = None,
    partitions: int | None = None,
) -> dict[str, int]:
    """Create missing topics (replication factor 1) and grow any with fewer partitions.

    Returns topic -> partition count once every partition has a leader, so producers and
    consumers can use the topics as soon as this returns.
    """
    cfg = cfg or StackConfig()
    names = list(cfg.topics if topics is None else topics)
    if not names:
        return {}
    return _run(_ensure_topics(cfg, names, partitions or cfg.partitions))


def delete_topics(cfg: StackConfig | None = None, topics: Sequence[str] = ()) -> None:
    """Best-effort delete, errors ignored: test cleanup that keeps the shared dev broker small."""
    cfg = cfg or StackConfig()
    if topics:
        _run(_with_admin(cfg, 30.0, lambda admin: admin.delete_topics(list(topics))))


def kafka_version(pom: Path = KAFKA_OPS_DIR / "pom.xml") -> str:
    """The broker version pinned in ops/local/kafka/pom.xml."""
    root = ET.parse(pom).getroot()
    element = root.find("m:properties/m:kafka.version", {"m": "http://maven.apache.org/POM/4.0.0"})
    if element is None or not (element.text or "").strip():
        raise StackError(f"{pom} has no <kafka.version> property")
    return element.text.strip()


def ensure_kafka_libs(cfg: StackConfig | None = None, *, progress: Progress | None = None) -> Path:
    """The folder of Kafka jars for kafka_version(), fetched with Maven on first use."""
    cfg = cfg or StackConfig()
    say = progress or log.info
    version = kafka_version()
    libs = cfg.cache_dir / "kafka" / version / "libs"
    # The marker names the pom it was fetched for: a jar added to the pom fetches the set again.
    marker = f"{version} {hashlib.sha1((KAFKA_OPS_DIR / 'pom.xml').read_bytes()).hexdigest()}\n"
    if _fetched(libs, marker):
        return libs
    mvn = shutil.which("mvn")
    if mvn is None:
        raise StackError("Maven (mvn) is needed once to fetch the Kafka jars: apt-get install maven")
    # Fetch into a private folder and rename it into place, so an interrupted or concurrent
    # fetch never leaves a half-filled libs/ that later runs would trust.
    partial = libs.with_name(f"libs.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    say(f"Fetching Kafka {version} jars with Maven into {libs} (first run only, a minute or two)")
    argv = [
        mvn, "-q", "-B", "-Dstyle.color=never", "-f", str(KAFKA_OPS_DIR / "pom.xml"),
        "dependency:copy-dependencies", "-DincludeScope=runtime", f"-DoutputDirectory={partial}",
    ]  # fmt: skip
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=cfg.fetch_timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise StackError(
            f"Maven did not finish fetching Kafka {version} in {cfg.fetch_timeout_s:.0f}s"
        ) from exc
    if done.returncode != 0 or not any(partial.glob("kafka_2.13-*.jar")):
        shutil.rmtree(partial, ignore_errors=True)
        raise StackError(f"Maven failed to fetch Kafka {version}:\n{tail(done.stdout + done.stderr)}")
    (partial / ".complete").write_text(marker)
    if _fetched(libs, marker):  # someone else finished first; theirs may be in use
        shutil.rmtree(partial, ignore_errors=True)
        return libs
    shutil.rmtree(libs, ignore_errors=True)  # a leftover without the marker is never trusted
    try:
        partial.rename(libs)
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)
        if not _fetched(libs, marker):
            raise
    return libs


def _fetched(libs: Path, marker: str) -> bool:
    try:
        return (libs / ".complete").read_text() == marker
    except OSError:
        return False


# -------------------------------------------------------------------- Kafka


def _server_properties(cfg: StackConfig, security: Mapping[str, str] | None = None) -> str:
    props = {
        "process.roles": "broker,controller",
        "node.id": "1",
        # A static quorum: one voter, known up front, so formatting needs no --standalone dance.
        "controller.quorum.voters": f"1@{cfg.kafka_host}:{cfg.controller_port}",
        "listeners": f"PLAINTEXT://{cfg.kafka_host}:{cfg.kafka_port},CONTROLLER://{cfg.kafka_host}:{cfg.controller_port}",
        "advertised.listeners": f"PLAINTEXT://{cfg.kafka_host}:{cfg.kafka_port}",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "inter.broker.listener.name": "PLAINTEXT",
        "controller.listener.names": "CONTROLLER",
        "log.dirs": str(cfg.kafka_data_dir),
        "num.partitions": str(cfg.partitions),
        # One broker, so every replication factor and min ISR must be 1 or writes are refused.
        "default.replication.factor": "1",
        "min.insync.replicas": "1",
        "offsets.topic.replication.factor": "1",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        # The default 50 partitions per internal topic make the first group or transaction
        # slow to start on a small CI machine; a dev broker needs far fewer.
        "offsets.topic.num.partitions": "8",
        "transaction.state.log.num.partitions": "8",
        "group.initial.rebalance.delay.ms": "0",
        "message.max.bytes": str(cfg.message_max_bytes),
        "replica.fetch.max.bytes": str(cfg.message_max_bytes),
        # Topics are created deliberately (ensure_topics), so a misspelt name fails loudly
        # instead of silently creating a new topic.
        "auto.create.topics.enable": "false",
        "log.retention.hours": "24",
        "log.segment.bytes": str(64 * 1024 * 1024),
        **(security or {}),
    }
    return "".join(f"{key}={value}\n" for key, value in props.items())


def _security_properties(cfg: StackConfig, say: Progress) -> dict[str, str]:
    keystore = None
    if cfg.kafka_tls_port is not None:
        say(f"Using the TLS CA in {cfg.tls_dir} (clients trust {cfg.tls_cafile})")
        _, keystore = ensure_tls_material(cfg.tls_dir, [cfg.kafka_host])
    return server_security_properties(
        cfg.kafka_host,
        cfg.kafka_port,
        cfg.controller_port,
        cfg.kafka_tls_port,
        cfg.sasl_users[0],
        # Checked only between this process's broker and controller halves: a new one each start.
        controller_password=secrets.token_urlsafe(24),
        tls_keystore=keystore,
    )


def _check_formatted_users(cfg: StackConfig) -> None:
    try:
        salt, fingerprint = cfg.kafka_users_marker.read_text().split()
    except (OSError, ValueError):
        salt, fingerprint = "", None
    if fingerprint != users_fingerprint(cfg.sasl_users, salt):
        raise StackError(
            f"the Kafka storage in {cfg.kafka_data_dir} was formatted with other SASL users (or none). "
            f"Users are fixed when the storage is formatted: use another state folder, or delete "
            f"{cfg.state_dir / 'kafka'} to start over"
        )


def _format_storage(cfg: StackConfig, java: list[str], say: Progress) -> None:
    say(f"Formatting Kafka storage in {cfg.kafka_data_dir}")
    # Kafka's cluster id is 16 random bytes in unpadded url-safe base64. One in 64 starts with
    # "-", which the tool's parser takes for an option; Kafka's own Uuid.randomUuid skips those too.
    cluster_id = "-"
    while cluster_id.startswith("-"):
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
    args = ["kafka.tools.StorageTool", "format", "--config", str(cfg.kafka_properties),
            "--cluster-id", cluster_id, "--ignore-formatted"]  # fmt: skip
    argfile = cfg.state_dir / "kafka" / "format.args"
    if cfg.sasl_users:
        args = [f"@{storage_format_argfile(argfile, args, cfg.sasl_users)}"]
    try:
        done = subprocess.run([*java, *args], capture_output=True, text=True, timeout=cfg.start_timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise StackError(f"Formatting Kafka storage timed out; see {cfg.kafka_log}") from exc
    finally:
        argfile.unlink(missing_ok=True)
    if done.returncode != 0:
        raise StackError(f"Formatting Kafka storage failed:\n{tail(done.stdout + done.stderr)}")
    if cfg.sasl_users:
        salt = secrets.token_hex(16)
        write_private(cfg.kafka_users_marker, f"{salt} {users_fingerprint(cfg.sasl_users, salt)}\n")


def _java_argv(cfg: StackConfig, libs: Path) -> list[str]:
    java_home = os.environ.get("JAVA_HOME")
    java = str(Path(java_home) / "bin" / "java") if java_home else shutil.which("java")
    if not java or not Path(java).exists():
        raise StackError("Java 17+ is needed to run Kafka: apt-get install openjdk-17-jre-headless")
    return [
        java,
        f"-Xms{cfg.kafka_heap}",
        f"-Xmx{cfg.kafka_heap}",
        "-XX:+UseG1GC",
        "-XX:MaxGCPauseMillis=20",
        "-XX:+ExitOnOutOfMemoryError",
        "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={KAFKA_OPS_DIR / 'log4j2.properties'}",
        f"-Dkafka.logs.dir={cfg.logs_dir}",
        "-cp",
        str(libs / "*"),  # java expands the wildcard itself
    ]


def _start_kafka(cfg: StackConfig, say: Progress) -> int:
    libs = ensure_kafka_libs(cfg, progress=say)
    java = _java_argv(cfg, libs)
    cfg.kafka_data_dir.mkdir(parents=True, exist_ok=True)
    cfg.logs_dir.mkdir(parents=True, exist_ok=True)
    formatted = (cfg.kafka_data_dir / "meta.properties").exists()
    if formatted and cfg.sasl_users:
        _check_formatted_users(cfg)
    if cfg.sasl_users:
        # It holds the stack user's password (the broker's own login).
        write_private(cfg.kafka_properties, _server_properties(cfg, _security_properties(cfg, say)))
    else:
        cfg.kafka_properties.write_text(_server_properties(cfg))
    if not formatted:
        _format_storage(cfg, java, say)
    say(f"Starting Kafka {kafka_version()} on {cfg.bootstrap_servers} (logs in {cfg.logs_dir})")
    pid = spawn_detached([*java, "kafka.Kafka", str(cfg.kafka_properties)], cfg.kafka_console_log)
    cfg.kafka_pid_file.write_text(f"{pid}\n")
    return pid


def _kafka_answers(cfg: StackConfig) -> bool:
    if not port_open(cfg.kafka_host, cfg.kafka_port):
        return False
    try:
        return _run(_kafka_has_broker(cfg))
    except Exception as exc:  # starting up, or not Kafka at all: either way it does not answer yet
        log.debug("Kafka not ready: %r", exc)
        return False


async def _with_admin(cfg: StackConfig, timeout_s: float, work: Callable[[AIOKafkaAdminClient], Any]) -> Any:
    admin = AIOKafkaAdminClient(
        bootstrap_servers=cfg.bootstrap_servers,
        client_id="infinilm-stack",
        request_timeout_ms=int(timeout_s * 1000),
        **cfg.kafka_client_kwargs(),
    )
    try:
        async with asyncio.timeout(timeout_s):
            await admin.start()
            return await work(admin)
    finally:
        await admin.close()


async def _kafka_has_broker(cfg: StackConfig) -> bool:
    async def work(admin: AIOKafkaAdminClient) -> bool:
        # The broker only serves metadata listing itself once it is unfenced and can take requests.
        return bool((await admin.describe_cluster()).get("brokers"))

    return await _with_admin(cfg, 5.0, work)


async def _describe_topics(cfg: StackConfig, names: Sequence[str], timeout_s: float) -> dict[str, int]:
    async def work(admin: AIOKafkaAdminClient) -> dict[str, int]:
        return {
            t["topic"]: len(t["partitions"])
            for t in await admin.describe_topics(list(names))
            if t["error_code"] == 0
        }

    return await _with_admin(cfg, timeout_s, work)


async def _ensure_topics(cfg: StackConfig, names: list[str], partitions: int) -> dict[str, int]:
    async def work(admin: AIOKafkaAdminClient) -> dict[str, int]:
        existing = {t["topic"]: t for t in await admin.describe_topics(names) if t["error_code"] == 0}
        missing = [n for n in names if n not in existing]
        if missing:
            response = await admin.create_topics(
                [NewTopic(name, num_partitions=partitions, replication_factor=1) for name in missing]
            )
            for topic, code, *message in response.topic_errors:
                error = for_code(code)
                if code and error is not TopicAlreadyExistsError:
                    raise StackError(f"creating topic {topic} failed: {error.__name__} {message}")
        # Never shrinks: Kafka cannot, and growing only happens when asked for more.
        grow = {
            n: NewPartitions(partitions) for n, t in existing.items() if len(t["partitions"]) < partitions
        }
        if grow:
            log.warning("Growing partitions to %d for %s", partitions, sorted(grow))
            await admin.create_partitions(grow)
        # Creation returns once the controller has committed it; wait until every partition
        # has a leader so callers can produce right away.
        while True:
            described = await admin.describe_topics(names)
            ready = {
                t["topic"]: len(t["partitions"])
                for t in described
                if t["error_code"] == 0 and t["partitions"] and all(p["leader"] >= 0 for p in t["partitions"])
            }
            if len(ready) == len(set(names)) and all(ready[n] >= partitions for n in names):
                return ready
            await asyncio.sleep(0.2)

    return await _with_admin(cfg, 60.0, work)


# -------------------------------------------------------------------- Redis


def _redis_ping(cfg: StackConfig) -> bool:
    # No client-side retries: a probe answers now, and redis-py counts a refused login as a
    # connection error that it would retry with backoff, for seconds.
    client = redis.Redis(
        host=cfg.redis_host,
        port=cfg.redis_port,
        password=cfg.redis_password,
        socket_timeout=2,
        socket_connect_timeout=2,
        retry=Retry(NoBackoff(), 0),
    )
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def _start_redis(cfg: StackConfig, say: Progress) -> None:
    server = shutil.which("redis-server") or _install_redis(say)
    cfg.redis_dir.mkdir(parents=True, exist_ok=True)
    cfg.logs_dir.mkdir(parents=True, exist_ok=True)
    say(f"Starting redis-server on {cfg.redis_host}:{cfg.redis_port} (log {cfg.redis_log})")
    # Daemonized redis writes its own pid file; persistence is off because the stack holds
    # only caches and state that workers rebuild.
    conf = []
    if cfg.redis_password is not None:
        # From a file, not argv, where `ps` would show it.
        conf_path = cfg.redis_dir / "auth.conf"
        write_private(conf_path, f'requirepass "{cfg.redis_password}"\n')
        conf = [str(conf_path)]
    argv = [
        server, *conf, "--bind", cfg.redis_host, "--port", str(cfg.redis_port), "--daemonize", "yes",
        "--dir", str(cfg.redis_dir), "--logfile", str(cfg.redis_log), "--pidfile", str(cfg.redis_pid_file),
        "--save", "", "--appendonly", "no",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise StackError(
            f"redis-server failed to start; see {cfg.redis_log}:\n{tail(done.stdout + done.stderr)}"
        )


def _install_redis(say: Progress) -> str:
    if shutil.which("apt-get") is None:
        raise StackError(
            "redis-server is not installed and apt-get is unavailable: install Redis 6+ yourself"
        )
    # sudo -n never prompts, so an unattended run fails fast instead of hanging on a password.
    prefix = [] if os.geteuid() == 0 else ["sudo", "-n"]
    say(f"redis-server not found: installing it with `{' '.join([*prefix, 'apt-get install redis-server'])}`")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for step in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "redis-server"],
    ):
        done = subprocess.run([*prefix, *step], capture_output=True, text=True, timeout=600, env=env)
        if done.returncode != 0:
            raise StackError(
                f"`{' '.join(step)}` failed; install redis-server yourself:\n{tail(done.stdout + done.stderr)}"
            )
    server = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not Path(server).exists():
        raise StackError("apt-get installed redis-server but it is not on PATH")
    return server


def _ownership(up: bool, pid: int | None, what: str) -> str:
    if pid is not None:
        return f"{what}, started by this stack"
    return f"{what}, not started by this stack (left alone by `down`)" if up else ""


def _run(coro: Coroutine[Any, Any, T]) -> T:
    # Callers are sync (CLI, pytest fixtures) or already inside an event loop (a worker);
    # asyncio.run refuses to nest, so the second kind gets a loop on a helper thread.
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()
