"""Connection settings shared by every Kafka client the worker and the CLI make."""

from __future__ import annotations

from aiokafka.helpers import create_ssl_context


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
