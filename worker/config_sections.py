"""The worker's own config sections; the engine's (model, memory, quantization and the engine half of
execution) are declared in engine/settings.py."""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Literal
from urllib.parse import urlsplit

import jinja2
import jinja2.meta
import msgspec

from engine.settings import Bytes, ExecutionSettings, NonEmptyStr, PositiveInt, Settings, SpeculativeSettings
from worker.config_types import ConfigError, Seconds, Secret, TopicName, require

DEFAULT_RULES_TEMPLATE = "{% for rule in rules %}##必须遵守: {{ rule }}\n{% endfor %}"
DEFAULT_RISK_INSTRUCTION = (
    "Assess the risk of the transaction text below. Answer with exactly one of the labels, and nothing else."
)


class ExecutionConfig(ExecutionSettings):
    """Batching, on top of the engine's execution settings. `batch_timeout` (seconds) is the longest a
    dynamic batch waits to fill while the engine is full (with room, requests go to it at once)."""

    batch_timeout: Seconds = 0.05
    max_batch_size: PositiveInt = 16
    batcher: Literal["dynamic_bucket", "fifo", "direct"] = "dynamic_bucket"
    # Buckets are max_seq_len / 2^i; past 16 halvings they would be empty.
    num_buckets: Annotated[int, msgspec.Meta(ge=1, le=16)] = 5
    deterministic: bool = False

    def __post_init__(self) -> None:
        require(self.max_batch_size <= self.max_num_seqs, "max_batch_size",
                f"must be <= max_num_seqs ({self.max_num_seqs}), got {self.max_batch_size}")


class KafkaConfig(Settings):
    """Broker connection, consumer group and transactions. Times are in milliseconds, as Kafka names them."""

    bootstrap_servers: NonEmptyStr = "127.0.0.1:9092"
    group_id: NonEmptyStr = "infinilm-workers"
    transactional_id_prefix: str = "infinilm"
    delivery: Literal["exactly_once", "at_least_once"] = "exactly_once"
    max_poll_interval_ms: PositiveInt = 300_000
    session_timeout_ms: PositiveInt = 10_000
    heartbeat_interval_ms: PositiveInt = 3_000
    transaction_timeout_ms: PositiveInt = 60_000
    flush_interval_ms: PositiveInt = 100
    # Commit a finished result at once when the last flush of finished results started
    # flush_interval_ms ago or more, instead of on the next tick: a lightly loaded worker
    # answers without waiting out the interval. Such flushes still start at most once per interval.
    eager_flush: bool = True
    max_message_bytes: Bytes = 1_048_576
    request_timeout_ms: PositiveInt = 30_000
    # Wait before a producer retries a failed request. Kafka 4 often answers a transaction's first write
    # with a retriable NOT_ENOUGH_REPLICAS while the same producer's previous transaction is still
    # completing (KIP-890's check, see docs/operations.md); aiokafka's default of 100 ms would then
    # delay those results by 100 ms. bench.kafka_latency measures the difference.
    producer_retry_backoff_ms: PositiveInt = 20
    security_protocol: Literal["PLAINTEXT", "SASL_PLAINTEXT", "SASL_SSL", "SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN"] | None = None
    sasl_username: NonEmptyStr | None = None
    sasl_password: Secret | None = None
    ssl_cafile: NonEmptyStr | None = None

    def __post_init__(self) -> None:
        for server in self.bootstrap_servers.split(","):
            require(bool(re.fullmatch(r"\s*[^\s:]+:\d{1,5}\s*", server)), "bootstrap_servers",
                     f"expected comma-separated host:port entries, got {self.bootstrap_servers!r}")
        # Kafka's own guidance: a missed heartbeat or two must not end the session.
        require(self.heartbeat_interval_ms * 3 < self.session_timeout_ms, "heartbeat_interval_ms",
                 f"must be below session_timeout_ms / 3 ({self.session_timeout_ms / 3:.0f}), "
                 f"got {self.heartbeat_interval_ms}")
        # Room for an error result or a dead letter's envelope (worker.record_size).
        require(self.max_message_bytes >= 16 << 10, "max_message_bytes",
                f"must be at least 16KiB, got {self.max_message_bytes}")
        require(self.flush_interval_ms < self.transaction_timeout_ms, "flush_interval_ms",
                 f"must be below transaction_timeout_ms ({self.transaction_timeout_ms}), "
                 f"got {self.flush_interval_ms}")
        if self.delivery == "exactly_once":
            require(bool(self.transactional_id_prefix), "transactional_id_prefix",
                     "must not be empty when delivery is exactly_once")
        sasl = self.security_protocol.startswith("SASL_")
        for key in ("sasl_mechanism", "sasl_username", "sasl_password"):
            if sasl:
                require(getattr(self, key) is not None, key,
                         f"is required when security_protocol is {self.security_protocol}")
            else:
                require(getattr(self, key) is None, key,
                         f"is set but security_protocol {self.security_protocol} does not use SASL")
        if self.ssl_cafile is not None:
            require(self.security_protocol in ("SSL", "SASL_SSL"), "ssl_cafile",
                     f"is set but security_protocol {self.security_protocol} does not use TLS")
            require(Path(self.ssl_cafile).expanduser().is_file(), "ssl_cafile",
                     f"file {self.ssl_cafile} does not exist")


class TopicsConfig(Settings):
    """Topic names: three request topics, then results, deltas and the dead-letter queue."""

    chat: TopicName = "infinilm.requests.chat"
    asr: TopicName = "infinilm.requests.asr"
    risk: TopicName = "infinilm.requests.risk"
    results: TopicName = "infinilm.results"
    deltas: TopicName = "infinilm.deltas"
    dlq: TopicName = "infinilm.dlq"

    def __post_init__(self) -> None:
        seen: dict[str, str] = {}
        for key, topic in msgspec.structs.asdict(self).items():
            require(topic not in seen, key, f"topic {topic!r} is already used by {seen.get(topic)}")
            seen[topic] = key

    @property
    def request_topics(self) -> dict[str, str]:
        """Request kind -> topic; a new dict each call."""
        return {"chat": self.chat, "asr": self.asr, "risk": self.risk}


class RedisConfig(Settings):
    """Shared metadata store. TTLs and timeouts are in seconds."""

    url: NonEmptyStr = "redis://127.0.0.1:6379/0"
    key_prefix: NonEmptyStr = "infinilm"
    username: NonEmptyStr | None = None
    password: Secret | None = None
    index_ttl_s: Seconds = 300.0
    heartbeat_interval_s: Seconds = 5.0
    stream_state_ttl_s: Seconds = 3600.0
    socket_timeout_s: Seconds = 2.0
    event_buffer: PositiveInt = 10_000

    def __post_init__(self) -> None:
        # The url is logged and shown, so it must not carry the password; the message must not echo it either.
        try:
            parts = urlsplit(self.url)
            has_password = parts.password is not None
        except ValueError:
            parts, has_password = None, False
        require(parts is not None and parts.scheme in ("redis", "rediss", "unix"), "url",
                 "expected a redis://, rediss:// or unix:// url")
        require(not has_password, "url", "must not contain a password; set redis.password instead")
        require(self.heartbeat_interval_s < self.index_ttl_s, "heartbeat_interval_s",
                 f"must be below index_ttl_s ({self.index_ttl_s}), or entries expire between refreshes")


class MetricsConfig(Settings):
    """The Prometheus endpoint (/metrics and /healthz). Port 0 picks a free port."""

    host: NonEmptyStr = "0.0.0.0"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 9400
    enabled: bool = True


class LoggingConfig(Settings):
    """structlog output. `log_prompts` puts prompt and answer text into logs; keep it off in production."""

    level: Literal["debug", "info", "warning", "error", "critical"] = "info"
    format: Literal["json", "console"] = "json"
    log_prompts: bool = False


class WorkerConfig(Settings):
    """This process. `id` None means derive one at runtime; see `resolved_id()`."""

    id: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9._:-]{1,200}$")] | None = None
    shutdown_timeout_s: Seconds = 30.0
    max_inflight: PositiveInt = 256
    deadline_check: bool = True
    # A partition with work waiting that has not moved for this long is set up again (worker.partitions).
    stall_resync_s: Seconds = 60.0
    # A request key that no field reads: "report" serves the request and names the key in the result's
    # `ignored_fields`; "reject" answers it invalid_request.
    unknown_fields: Literal["report", "reject"] = "report"

    def __post_init__(self) -> None:
        require(self.stall_resync_s >= 5.0, "stall_resync_s",
                f"must be at least 5 s (the watchdog looks every few seconds), got {self.stall_resync_s}")

    def resolved_id(self) -> str:
        """The configured id, or hostname-pid; computed on each call, never stored in the config."""
        return self.id or f"{socket.gethostname()}-{os.getpid()}"


class ChatConfig(Settings):
    """The chat rule engine.

    `rules_template` is a Jinja2 template rendered with `rules` (a list of
    strings: the tenant's and then the topic's); its output goes before the
    conversation, one `##必须遵守:` line per rule in the default.
    """

    rules_template: NonEmptyStr = DEFAULT_RULES_TEMPLATE
    tenant_rules: Mapping[str, tuple[str, ...]] = msgspec.field(default_factory=dict)
    topic_rules: Mapping[str, tuple[str, ...]] = msgspec.field(default_factory=dict)
    repair_policy: Literal["regenerate", "flag"] = "regenerate"
    forbidden_phrases: tuple[NonEmptyStr, ...] = ()
    default_max_tokens: PositiveInt = 256
    # Images in one chat request (vision models), and the bounds on each: its encoded bytes, and its
    # width x height, checked from the header before any pixel is decoded.
    max_images: PositiveInt = 8
    max_image_bytes: Bytes = 8_388_608
    max_image_pixels: PositiveInt = 16_777_216

    def __post_init__(self) -> None:
        for key in ("tenant_rules", "topic_rules"):
            rules = getattr(self, key)
            for owner, lines in rules.items():
                for rule in lines:
                    # A newline would let one rule smuggle in lines the template never framed.
                    require(bool(rule.strip()) and "\n" not in rule, key,
                             f"each rule for {owner!r} must be one non-empty line")
            msgspec.structs.force_setattr(self, key, MappingProxyType(dict(rules)))
        try:
            names = jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(self.rules_template))
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError(f"rules_template: not a valid Jinja2 template (line {exc.lineno}: {exc.message})") from None
        require("rules" in names, "rules_template", "must use the `rules` variable, or rules would be dropped")


class AsrConfig(Settings):
    """Streaming ASR post-correction."""

    # Covers a predecessor still queued or running here, or redelivered after a rebalance
    # (kafka.session_timeout_ms and more): a real gap waits this long without blocking other work.
    gap_timeout_s: Seconds = 30.0
    # causal is the default everywhere; chunk_bidirectional lets a chunk's tokens see each other.
    mask_policy: Literal["causal", "chunk_bidirectional", "prefix_bidirectional", "packed_segments"] = "causal"


class RiskConfig(Settings):
    """Batch risk analysis: the labels a request gets when it names none, and the instruction given to the model."""

    default_labels: tuple[NonEmptyStr, ...] = ("low", "medium", "high")
    instruction: NonEmptyStr = DEFAULT_RISK_INSTRUCTION

    def __post_init__(self) -> None:
        require(bool(self.default_labels), "default_labels", "must name at least one label")
        require(len(set(self.default_labels)) == len(self.default_labels), "default_labels",
                 "labels must be unique")


class SpeculativeConfig(SpeculativeSettings):
    """The engine's speculative decoding, and which requests use it: ASR requests whenever it is on (their
    output mostly copies the chunk), chat requests only with `chat: true`."""

    chat: bool = False
