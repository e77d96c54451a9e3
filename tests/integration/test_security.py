"""Authenticated Kafka and Redis: a private secured stack, real workers, real refusals.

One broker for the module, started through devstack like every other stack,
in its own state folder and on its own ports (the shared stack on 9092/6379 is
never touched): SASL_PLAINTEXT and SASL_SSL listeners, both SCRAM-SHA-512, with
users written at storage format time, and a redis-server with requirepass.
Passwords reach the workers only through files and the environment; every test
that runs a worker checks that no secret shows up in its log or in any process's
command line.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import socket
import ssl
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaConnectionError
from redis.backoff import NoBackoff
from redis.retry import Retry

from devstack import StackConfig, StackError, ensure_topics, stack_down, stack_up
from tests.integration.redis_server import free_port
from tests.integration.worker_harness import Topics, WorkerProcess, chat, write_config
from worker.client import RequestProducer, TopicReader, collect_results
from worker.config_sections import KafkaConfig
from worker.config_types import Secret
from worker.kafka_clients import KafkaAccessError, check_kafka_access

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STACK_USER, WORKER_USER, CLIENT_USER = "infinilm-stack", "worker", "client"
EXIT_NO_ACCESS = 3


def _password() -> str:
    return f"pw-{secrets.token_urlsafe(18)}"


@pytest.fixture(scope="module")
def secure_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackConfig]:
    cfg = StackConfig(
        state_dir=tmp_path_factory.mktemp("secure stack"),  # a space, as some home folders have
        kafka_port=free_port(), controller_port=free_port(), kafka_tls_port=free_port(), redis_port=free_port(),
        sasl_users={STACK_USER: _password(), WORKER_USER: _password(), CLIENT_USER: _password()},
        redis_password=_password(), topics=(), partitions=1, kafka_heap="256m",
    )  # fmt: skip
    try:
        status = stack_up(cfg)
        assert status.up, status
        asyncio.run(_create_transaction_log(cfg))
        yield cfg
    finally:
        stack_down(cfg)


async def _create_transaction_log(cfg: StackConfig) -> None:
    # A fresh broker creates its transaction log on the first InitProducerId, which takes
    # seconds; a long-lived broker (the shared stack) has it. Pay that here, once, so workers
    # start the way they do in production.
    producer = AIOKafkaProducer(
        bootstrap_servers=cfg.bootstrap_servers,
        transactional_id="test.security.warm-up",
        **cfg.kafka_client_kwargs(),
    )
    await producer.start()
    await producer.stop()


def _wait_partitions_assigned(worker: WorkerProcess, timeout: float = 60) -> None:
    # /readyz counts partitions as soon as the consumer has them; the worker's transactional
    # producers for them are ready once it logs the assignment.
    deadline = time.monotonic() + timeout
    while not any(e.get("event") == "partitions assigned" for e in worker.log_events()):
        assert time.monotonic() < deadline, worker.logs()[-3000:]
        time.sleep(0.2)


def _secrets(cfg: StackConfig) -> list[str]:
    return [password for _, password in cfg.sasl_users] + [cfg.redis_password]


def _users(cfg: StackConfig) -> dict[str, str]:
    return dict(cfg.sasl_users)


def _command_lines() -> list[str]:
    """What `ps -eo args` shows for every process, readable or not."""
    lines = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            lines.append(cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace"))
    return lines


def _assert_no_secret_in(text: str, cfg: StackConfig, where: str) -> None:
    leaked = [i for i, secret in enumerate(_secrets(cfg)) if secret in text]
    assert not leaked, f"secret number(s) {leaked} found in {where}"


def _topics(cfg: StackConfig) -> Topics:
    suffix = uuid.uuid4().hex[:8]
    topics = Topics(
        **{
            role: f"test.security.{role}.{suffix}"
            for role in ("chat", "asr", "risk", "results", "deltas", "dlq")
        }
    )
    ensure_topics(cfg, list(topics.as_dict().values()), 1)
    return topics


def _kafka_section(cfg: StackConfig, *, tls: bool, password: dict | None) -> dict:
    section = {
        "bootstrap_servers": cfg.tls_bootstrap_servers if tls else cfg.bootstrap_servers,
        "security_protocol": "SASL_SSL" if tls else "SASL_PLAINTEXT",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_username": WORKER_USER,
    }
    if password is not None:
        section["sasl_password"] = password
    if tls:
        section["ssl_cafile"] = str(cfg.tls_cafile)
    return section


def _secret_file(path: Path, value: str) -> str:
    path.write_text(value + "\n")
    path.chmod(0o600)
    return str(path)


def _start_worker(
    tmp_path: Path,
    cfg: StackConfig,
    model: Path,
    name: str,
    *,
    kafka: dict,
    redis_section: dict | None = None,
    env: dict[str, str] | None = None,
) -> tuple[WorkerProcess, Topics]:
    topics = _topics(cfg)
    group = f"test.security.{name}.{uuid.uuid4().hex[:8]}"
    config = write_config(
        tmp_path / f"{name}.yaml",
        model=str(model),
        topics=topics,
        group=group,
        bootstrap=kafka["bootstrap_servers"],
        redis_url=cfg.redis_url,
        kafka=kafka,
        redis=redis_section or {},
    )
    worker = WorkerProcess(config, name, tmp_path / f"{name}.log", env=env or {})
    return worker.start(), topics


# ----------------------------------------------------------------- the broker and Redis


def test_broker_and_redis_refuse_clients_without_the_right_credentials(secure_stack: StackConfig) -> None:
    cfg, users = secure_stack, _users(secure_stack)

    def kafka_cfg(**overrides) -> KafkaConfig:
        fields = {
            "bootstrap_servers": cfg.bootstrap_servers,
            "security_protocol": "SASL_PLAINTEXT",
            "sasl_mechanism": "SCRAM-SHA-512",
            "sasl_username": CLIENT_USER,
            "sasl_password": Secret(users[CLIENT_USER]),
            "request_timeout_ms": 10_000,
            **overrides,
        }
        return KafkaConfig(**fields)

    async def kafka_checks() -> None:
        # No credentials at all: the SASL listener hangs up before serving any metadata.
        producer = AIOKafkaProducer(bootstrap_servers=cfg.bootstrap_servers, request_timeout_ms=10_000)
        with pytest.raises(KafkaConnectionError):
            await producer.start()
        await producer.stop()

        wrong = "wrong-" + users[CLIENT_USER]
        with pytest.raises(KafkaAccessError) as refused:
            await check_kafka_access(kafka_cfg(sasl_password=Secret(wrong)))
        message = str(refused.value)
        assert "rejected the credentials" in message and repr(CLIENT_USER) in message
        assert wrong not in message and users[CLIENT_USER] not in message

        tls = {"bootstrap_servers": cfg.tls_bootstrap_servers, "security_protocol": "SASL_SSL"}
        with pytest.raises(KafkaAccessError, match="not trusted"):  # the system CAs do not know ours
            await check_kafka_access(kafka_cfg(**tls))
        with pytest.raises(KafkaAccessError, match=r"closed the connection|TLS handshake"):
            await check_kafka_access(kafka_cfg(bootstrap_servers=cfg.tls_bootstrap_servers))

        await check_kafka_access(kafka_cfg())
        await check_kafka_access(kafka_cfg(**tls, ssl_cafile=str(cfg.tls_cafile)))

    asyncio.run(kafka_checks())

    def ping(password: str | None) -> bool:
        client = redis.Redis(
            host=cfg.redis_host, port=cfg.redis_port, password=password, socket_timeout=5,
            retry=Retry(NoBackoff(), 0),  # a refused login is final; redis-py would retry it
        )
        try:
            return bool(client.ping())
        finally:
            client.close()

    with pytest.raises(redis.AuthenticationError):
        ping(None)
    with pytest.raises(redis.AuthenticationError):
        ping("wrong-" + cfg.redis_password)
    assert ping(cfg.redis_password)

    # The broker, its storage format and redis-server got their secrets from files, not argv.
    for line in _command_lines():
        _assert_no_secret_in(line, cfg, "a process command line")
    assert not (cfg.state_dir / "kafka" / "format.args").exists()
    for private in (cfg.kafka_properties, cfg.redis_dir / "auth.conf", cfg.tls_dir / "ca.key"):
        assert private.stat().st_mode & 0o077 == 0, f"{private} is readable by others"


# ----------------------------------------------------------------- workers


@pytest.mark.parametrize("tls", [False, True], ids=["sasl_plaintext", "sasl_ssl"])
def test_worker_with_credentials_serves_chat_and_never_shows_a_secret(
    secure_stack: StackConfig, tiny_llama: Path, tmp_path: Path, tls: bool
) -> None:
    cfg, users = secure_stack, _users(secure_stack)
    if tls:
        # Kafka's password as a plain environment variable; Redis's named by {env: ...} in the YAML.
        kafka = _kafka_section(cfg, tls=True, password=None)
        redis_section = {"password": {"env": "TEST_REDIS_PASSWORD"}}
        env = {
            "INFINILM__KAFKA__SASL_PASSWORD": users[WORKER_USER],
            "TEST_REDIS_PASSWORD": cfg.redis_password,
        }
    else:
        # Kafka's password from a file named in the YAML; Redis's from a file named by a variable.
        kafka = _kafka_section(
            cfg, tls=False, password={"file": _secret_file(tmp_path / "kafka.password", users[WORKER_USER])}
        )
        redis_section = {}
        env = {
            "INFINILM__REDIS__PASSWORD_FILE": _secret_file(tmp_path / "redis.password", cfg.redis_password)
        }
    worker, topics = _start_worker(
        tmp_path, cfg, tiny_llama, "secure", kafka=kafka, redis_section=redis_section, env=env
    )
    try:
        state = worker.wait_ready(timeout=180)
        _wait_partitions_assigned(worker)
        assert state["redis"] == "ok", state  # logged in to Redis, not running degraded
        for line in _command_lines():
            _assert_no_secret_in(line, cfg, "a process command line")

        client = cfg.kafka_client_kwargs(CLIENT_USER, tls=tls)
        bootstrap = kafka["bootstrap_servers"]

        async def round_trip() -> dict:
            async with TopicReader(bootstrap, topics.results, **client) as reader:
                async with RequestProducer(bootstrap, **client) as producer:
                    await producer.send(topics.chat, chat("secure-1", "a secret-free question"))
                return await collect_results(reader, ["secure-1"], timeout_s=120)

        got = asyncio.run(round_trip())
        assert [r.status for r in got.get("secure-1", [])] == ["ok"], got
        assert got["secure-1"][0].usage.completion_tokens > 0
        # Request content and ids stay out of metric labels.
        metrics = worker.metrics()
        assert "secure-1" not in metrics and "secret-free" not in metrics
    finally:
        worker.stop()
    assert worker.proc.returncode == 0, worker.logs()[-3000:]
    _assert_no_secret_in(worker.logs(), cfg, "the worker's log")
    assert "a secret-free question" not in worker.logs()  # request text is not logged by default
    _assert_no_secret_in(worker.config.read_text(), cfg, "the worker's config file")


@pytest.mark.parametrize("fault", ["kafka_password", "redis_password", "untrusted_ca"])
def test_worker_refused_at_start_exits_fast_with_the_cause(
    secure_stack: StackConfig, tiny_llama: Path, tmp_path: Path, fault: str
) -> None:
    cfg, users = secure_stack, _users(secure_stack)
    wrong = _password()
    kafka_password = wrong if fault == "kafka_password" else users[WORKER_USER]
    redis_password = wrong if fault == "redis_password" else cfg.redis_password
    kafka = _kafka_section(
        cfg,
        tls=fault == "untrusted_ca",
        password={"file": _secret_file(tmp_path / "kafka.password", kafka_password)},
    )
    if fault == "untrusted_ca":
        del kafka["ssl_cafile"]  # the system CAs, which never signed the stack's certificate
    env = {"INFINILM__REDIS__PASSWORD": redis_password}

    started = time.monotonic()
    worker, _ = _start_worker(tmp_path, cfg, tiny_llama, f"refused-{fault}", kafka=kafka, env=env)
    try:
        code = worker.wait(timeout=60)
    finally:
        worker.stop()
    elapsed = time.monotonic() - started
    logs = worker.logs()
    assert code == EXIT_NO_ACCESS, logs[-3000:]
    assert elapsed < 60
    [event] = [e for e in worker.log_events() if e.get("event") == "cannot start"]
    expected = {
        "kafka_password": f"rejected the credentials of user {WORKER_USER!r} (SCRAM-SHA-512)",
        "redis_password": f"Redis at {cfg.redis_host}:{cfg.redis_port}/0 rejected the credentials",
        "untrusted_ca": "is not trusted",
    }[fault]
    assert expected in event["reason"], event
    assert event["level"] == "error"
    # It stopped before loading the model, and it did not retry.
    assert "worker started" not in logs
    assert wrong not in logs
    _assert_no_secret_in(logs, cfg, "the refused worker's log")


def test_tls_listener_presents_a_certificate_for_the_advertised_host(secure_stack: StackConfig) -> None:
    context = ssl.create_default_context(cafile=str(secure_stack.tls_cafile))
    address = (secure_stack.kafka_host, secure_stack.kafka_tls_port)
    with (
        socket.create_connection(address, timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=secure_stack.kafka_host) as tls,
    ):
        assert tls.version() in ("TLSv1.2", "TLSv1.3")


@pytest.mark.slow
def test_restart_keeps_users_and_ca_and_refuses_other_users(secure_stack: StackConfig) -> None:
    cfg = secure_stack
    ca_before = cfg.tls_cafile.read_bytes()
    stack_down(cfg)
    try:
        # Users are fixed at format time: a restart with other users is refused before anything starts.
        others = dataclasses.replace(cfg, sasl_users={STACK_USER: _password()})
        with pytest.raises(StackError, match="formatted with other SASL users") as refused:
            stack_up(others)
        _assert_no_secret_in(str(refused.value), cfg, "the refusal")
    finally:
        status = stack_up(cfg)
    assert status.up, status
    assert cfg.tls_cafile.read_bytes() == ca_before  # clients keep trusting the same CA

    async def log_in_again() -> None:
        client = KafkaConfig(
            bootstrap_servers=cfg.tls_bootstrap_servers, security_protocol="SASL_SSL",
            sasl_mechanism="SCRAM-SHA-512", sasl_username=CLIENT_USER,
            sasl_password=Secret(_users(cfg)[CLIENT_USER]), ssl_cafile=str(cfg.tls_cafile),
        )  # fmt: skip
        await check_kafka_access(client)

    asyncio.run(log_in_again())
