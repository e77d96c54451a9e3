"""Connection settings shared by every Kafka client the worker and the CLI make,
and the start-up check that those settings let a client in."""

from __future__ import annotations

import asyncio
import ssl

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.conn import create_conn
from aiokafka.errors import (
    IllegalSaslStateError,
    KafkaConnectionError,
    KafkaError,
    SaslAuthenticationFailed,
    UnsupportedSaslMechanismError,
)
from aiokafka.helpers import create_ssl_context
from aiokafka.protocol.metadata import MetadataRequest


class KafkaAccessError(RuntimeError):
    """No configured broker let this client in: credentials refused, TLS not trusted, a
    listener of another security protocol, or nobody answering. Never contains the password."""


def client_kwargs(kafka_cfg, client_id: str | None = None) -> dict:
    """aiokafka keyword arguments for bootstrap servers, timeouts and security."""
    kwargs: dict = {
        "bootstrap_servers": kafka_cfg.bootstrap_servers,
        "request_timeout_ms": kafka_cfg.request_timeout_ms,
        "security_protocol": kafka_cfg.security_protocol,
    }
    if client_id:
        kwargs["client_id"] = client_id
    if kafka_cfg.security_protocol in ("SSL", "SASL_SSL"):
        kwargs["ssl_context"] = create_ssl_context(cafile=kafka_cfg.ssl_cafile)
    if kafka_cfg.security_protocol.startswith("SASL"):
        kwargs["sasl_mechanism"] = kafka_cfg.sasl_mechanism
        kwargs["sasl_plain_username"] = kafka_cfg.sasl_username
        kwargs["sasl_plain_password"] = kafka_cfg.sasl_password.get() if kafka_cfg.sasl_password else None
    return kwargs


def producer_kwargs(kafka_cfg, client_id: str | None = None) -> dict:
    """client_kwargs plus the producers' own settings: retry_backoff_ms, and max_message_bytes as the
    largest record (worker.record_size cuts every output to fit it)."""
    return {**client_kwargs(kafka_cfg, client_id), "retry_backoff_ms": kafka_cfg.producer_retry_backoff_ms,
            "max_request_size": kafka_cfg.max_message_bytes}


def consumer_kwargs(kafka_cfg, client_id: str | None = None) -> dict:
    """The worker's request consumer: one group, manual commits, read_committed, fetch sizes from max_message_bytes."""
    return {
        **client_kwargs(kafka_cfg, client_id),
        "group_id": kafka_cfg.group_id,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "isolation_level": "read_committed",
        "max_poll_interval_ms": kafka_cfg.max_poll_interval_ms,
        "session_timeout_ms": kafka_cfg.session_timeout_ms,
        "heartbeat_interval_ms": kafka_cfg.heartbeat_interval_ms,
        "max_partition_fetch_bytes": max(kafka_cfg.max_message_bytes * 2, 1 << 20),
        "fetch_max_bytes": max(kafka_cfg.max_message_bytes * 4, 50 << 20),
    }


async def check_kafka_access(kafka_cfg, client_id: str = "infinilm-check") -> None:
    """Log in to a bootstrap broker the way the worker's clients will, and read metadata.

    NOTE: aiokafka's own clients swallow why a bootstrap failed (they log it and raise
    "Unable to bootstrap"), and once started they retry a refused login for ever. This
    check opens one connection by hand so that a wrong password or an untrusted
    certificate ends start-up at once with the cause. Each broker gets at most
    request_timeout_ms; the first that lets us in ends the check.
    Raises KafkaAccessError.
    """
    kwargs = client_kwargs(kafka_cfg, client_id)
    password = kwargs.get("sasl_plain_password")
    servers = [s.strip() for s in kafka_cfg.bootstrap_servers.split(",")]
    protocol = kafka_cfg.security_protocol
    who = (
        f"user {kafka_cfg.sasl_username!r} ({kafka_cfg.sasl_mechanism})"
        if protocol.startswith("SASL")
        else ""
    )
    failures = []
    for server in servers:
        host, port = server.rsplit(":", 1)
        conn = None
        try:
            async with asyncio.timeout(kafka_cfg.request_timeout_ms / 1000):
                conn = await create_conn(
                    host,
                    int(port),
                    client_id=client_id,
                    request_timeout_ms=kafka_cfg.request_timeout_ms,
                    ssl_context=kwargs.get("ssl_context"),
                    security_protocol=protocol,
                    sasl_mechanism=kwargs.get("sasl_mechanism"),
                    sasl_plain_username=kwargs.get("sasl_plain_username"),
                    sasl_plain_password=kwargs.get("sasl_plain_password"),
                )
                await conn.send(MetadataRequest([]))
            return
        except SaslAuthenticationFailed as exc:
            raise KafkaAccessError(
                _scrub(
                    f"Kafka at {server} rejected the credentials of {who}: {_reason(exc)}. "
                    "Check kafka.sasl_username and kafka.sasl_password.",
                    password,
                )
            ) from None
        except (UnsupportedSaslMechanismError, IllegalSaslStateError) as exc:
            raise KafkaAccessError(
                _scrub(
                    f"Kafka at {server} does not accept {who} over {protocol}: {_reason(exc)}. "
                    "Check kafka.security_protocol and kafka.sasl_mechanism.",
                    password,
                )
            ) from None
        except ssl.SSLCertVerificationError as exc:
            raise KafkaAccessError(
                f"the TLS certificate of Kafka at {server} is not trusted ({exc.verify_message}). "
                "Check kafka.ssl_cafile."
            ) from None
        except ssl.SSLError as exc:
            failures.append(f"{server}: TLS handshake failed ({exc.reason}); is this a TLS listener?")
        except KafkaConnectionError:
            # A listener of another protocol hangs up mid-handshake rather than answering.
            failures.append(f"{server}: closed the connection; does this listener use {protocol}?")
        except (OSError, TimeoutError, KafkaError) as exc:
            failures.append(f"{server}: {type(exc).__name__}: {_reason(exc) or 'no answer'}")
        finally:
            if conn is not None:
                conn.close()
    raise KafkaAccessError(
        _scrub(f"no Kafka broker let this client in over {protocol}: " + "; ".join(failures), password)
    )


def _reason(exc: BaseException) -> str:
    # aiokafka errors print as "[Error 58] SaslAuthenticationFailed: <broker's message>"; an OSError's
    # first argument is its errno, so it reads by its strerror ("Connection refused").
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = str(exc.args[0]) if exc.args else str(exc)
    return text.strip().rstrip(".")


def _scrub(text: str, secret: str | None) -> str:
    # The broker's messages carry no password today; this keeps it so if one ever echoes it.
    return text.replace(secret, "***") if secret else text


async def topic_record_limits(kafka_cfg, topics, client_id: str = "infinilm-check") -> tuple[dict[str, int], list[str]]:
    """Each topic's max.message.bytes as the broker describes it, and the topics it would not describe
    (missing, or not authorized: DescribeConfigs is a permission of its own)."""
    admin = AIOKafkaAdminClient(**client_kwargs(kafka_cfg, client_id))
    try:
        async with asyncio.timeout(kafka_cfg.request_timeout_ms / 1000):
            await admin.start()
            responses = await admin.describe_configs(
                [ConfigResource(ConfigResourceType.TOPIC, topic, configs={"max.message.bytes": None})
                 for topic in topics])
    finally:
        await admin.close()
    limits: dict[str, int] = {}
    for response in responses:
        for error_code, _message, _type, name, entries in response.resources:
            for key, value, *_ in entries if not error_code else ():
                if key == "max.message.bytes":
                    limits[name] = int(value)
    return limits, [t for t in topics if t not in limits]
