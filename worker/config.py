"""The worker's one typed, frozen configuration.

It is read once at start-up from a YAML file, overridden by environment
variables (`INFINILM__SECTION__KEY=value`), validated, and then passed whole.
Nothing mutates it: values found at runtime (the worker id, how many KV blocks
fit) live in their own objects.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import socket
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from types import MappingProxyType, NoneType, UnionType
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints
from urllib.parse import urlsplit

import jinja2
import jinja2.meta
import msgspec
import yaml

if TYPE_CHECKING:
    from engine.config import EngineConfig

ENV_PREFIX = "INFINILM__"
MASKED = "***"


class ConfigError(ValueError):
    """The configuration is invalid. The message names where the value came from
    (file or environment variable), its dotted key, and what was expected."""


class Secret:
    """A credential that prints as `***` and is read only through `get()`.

    Built from a literal string, or from a file (read on every `get()`, so a
    rotated mounted secret is picked up). `{env: VAR}` in YAML is resolved at
    load time into a literal.
    """

    __slots__ = ("_file", "_value")

    def __init__(self, value: str | None = None, *, file: str | Path | None = None) -> None:
        if (value is None) == (file is None):
            raise ValueError("a Secret takes exactly one of a value or a file")
        self._value = value
        self._file = None if file is None else Path(file).expanduser()

    def get(self) -> str:
        """The secret's value; raises ConfigError (naming the file, never the value) if it cannot be read."""
        if self._file is None:
            return self._value  # type: ignore[return-value]
        try:
            value = self._file.read_text(encoding="utf-8").rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read secret file {self._file}: {exc.__class__.__name__}") from None
        if not value:
            raise ConfigError(f"secret file {self._file} is empty")
        return value

    def __repr__(self) -> str:
        return MASKED

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and (self._value, self._file) == (other._value, other._file)

    def __hash__(self) -> int:
        return hash((Secret, self._file))


# Units are parsed before msgspec sees the data, so the fields hold plain floats
# and ints; the Meta `extra` tag is how the parser finds them.
Seconds = Annotated[float, msgspec.Meta(gt=0, extra={"parse": "duration"})]
Bytes = Annotated[int, msgspec.Meta(ge=1, extra={"parse": "bytes"})]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1)]
# Kafka's legal topic names.
TopicName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9._-]{1,249}$")]

DEFAULT_RULES_TEMPLATE = "{% for rule in rules %}##必须遵守: {{ rule }}\n{% endfor %}"
DEFAULT_RISK_INSTRUCTION = (
    "Assess the risk of the transaction text below. Answer with exactly one of the labels, and nothing else."
)


def _require(ok: bool, key: str, message: str) -> None:
    # The "key: " prefix lets load_config turn it into a full dotted path.
    if not ok:
        raise ConfigError(f"{key}: {message}")


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class ModelConfig(_Section):
    """Which model to serve. `max_seq_len` becomes the engine's `max_model_len` (None: the model's own)."""

    name: NonEmptyStr = "smollm2"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "auto"
    max_seq_len: Annotated[int, msgspec.Meta(ge=2)] | None = None

    def __post_init__(self) -> None:
        _require(bool(re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device)), "device",
                 f"expected 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")


class ExecutionConfig(_Section):
    """Batching. `batch_timeout` (seconds) is the longest a dynamic batch waits to fill."""

    batch_timeout: Seconds = 0.05
    max_batch_size: PositiveInt = 16
    max_num_seqs: PositiveInt = 64
    max_num_batched_tokens: PositiveInt = 2048
    batcher: Literal["dynamic_bucket", "fifo"] = "dynamic_bucket"
    # Buckets are max_seq_len / 2^i; past 16 halvings they would be empty.
    num_buckets: Annotated[int, msgspec.Meta(ge=1, le=16)] = 5
    deterministic: bool = False
    num_threads: PositiveInt | None = None
    # CPU, 2+ threads: rows per thread from which a decode step gives each thread its own group of rows (each
    # thread then streams the whole weight for its rows); "auto": measured at engine start (engine/models/
    # decode_split.py).
    cpu_decode_split_rows: PositiveInt | Literal["auto"] = "auto"
    # GPU only: decode steps replayed from CUDA graphs per batch-size bucket.
    cuda_graphs: bool = True
    # Pipelined scheduling (build step N+1 while the device runs step N); null: on for CUDA, off on the CPU.
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        _require(self.max_batch_size <= self.max_num_seqs, "max_batch_size",
                 f"must be <= max_num_seqs ({self.max_num_seqs}), got {self.max_batch_size}")


class MemoryConfig(_Section):
    """The KV cache: `kv_cache_bytes` when set, else `max_cache_ratio` of device memory (on the CPU,
    of `cpu_memory_bytes` when set, else of host RAM capped at 2 GiB). Prefix-cache blocks no
    request holds are evicted least recently used first (`kv_cache_policy: lru`)."""

    kv_cache_policy: Literal["lru"] = "lru"
    max_cache_ratio: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.4
    kv_cache_bytes: Bytes | None = None
    cpu_memory_bytes: Bytes | None = None
    block_size: PositiveInt = 16
    enable_prefix_caching: bool = True
    embedding_offload: bool = False
    # Prefills longer than this many tokens run the MLP in chunks through a preallocated workspace.
    activation_chunk_rows: NonNegativeInt = 2048
    # fp32 on the CPU: a packed copy of each linear weight (panel kernel or oneDNN), for faster decode batches;
    # "auto": only where the copy is compact (below), a fraction of the weights' bytes; true: every weight.
    cpu_prepack_weights: bool | Literal["auto"] = "auto"
    # With cpu_prepack_weights: weights that are exactly codes times fp16 scales (GGUF Q4_0/Q4_1/Q8_0
    # imports) packed as those codes; the same values bit for bit, a sixth to a quarter of the bytes.
    cpu_compact_weights: bool = True
    # With compact panels: free the fp32 weights they hold (larger batches rebuild them per call).
    cpu_free_plain_weights: bool = False
    # CPU: transparent huge pages (madvise) for what a decode step streams. "auto": the weights, with a bounded
    # cost at engine start (faster single streams: bench.single_stream); true: the weights, unbounded, and the
    # KV cache (a much slower engine start for little gain on the dev VM: bench.huge_pages); false: neither.
    huge_pages: bool | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        _require(self.block_size & (self.block_size - 1) == 0, "block_size",
                 f"must be a power of two, got {self.block_size}")


class QuantizationConfig(_Section):
    """Weight and KV-cache precision; `calibration_file` holds per-layer calibration data for
    weights quantized at load time; `kv_fp_window` keeps each sequence's most recent KV rows at
    full precision when `cache_bits` is 8."""

    weight_bits: Literal[16, 8, 4] = 16
    weight_group_size: Annotated[int, msgspec.Meta(ge=32, multiple_of=32)] = 128
    cache_bits: Literal[16, 8] = 16
    kv_fp_window: Annotated[int, msgspec.Meta(ge=0)] = 0
    calibration_file: NonEmptyStr | None = None

    def __post_init__(self) -> None:
        if self.calibration_file is not None:
            _require(Path(self.calibration_file).expanduser().is_file(), "calibration_file",
                     f"file {self.calibration_file} does not exist")
        _require(self.kv_fp_window == 0 or self.cache_bits == 8, "kv_fp_window",
                 "keeps recent rows of an int8 KV cache at full precision; it needs cache_bits: 8")


class KafkaConfig(_Section):
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
            _require(bool(re.fullmatch(r"\s*[^\s:]+:\d{1,5}\s*", server)), "bootstrap_servers",
                     f"expected comma-separated host:port entries, got {self.bootstrap_servers!r}")
        # Kafka's own guidance: a missed heartbeat or two must not end the session.
        _require(self.heartbeat_interval_ms * 3 < self.session_timeout_ms, "heartbeat_interval_ms",
                 f"must be below session_timeout_ms / 3 ({self.session_timeout_ms / 3:.0f}), "
                 f"got {self.heartbeat_interval_ms}")
        _require(self.flush_interval_ms < self.transaction_timeout_ms, "flush_interval_ms",
                 f"must be below transaction_timeout_ms ({self.transaction_timeout_ms}), "
                 f"got {self.flush_interval_ms}")
        if self.delivery == "exactly_once":
            _require(bool(self.transactional_id_prefix), "transactional_id_prefix",
                     "must not be empty when delivery is exactly_once")
        sasl = self.security_protocol.startswith("SASL_")
        for key in ("sasl_mechanism", "sasl_username", "sasl_password"):
            if sasl:
                _require(getattr(self, key) is not None, key,
                         f"is required when security_protocol is {self.security_protocol}")
            else:
                _require(getattr(self, key) is None, key,
                         f"is set but security_protocol {self.security_protocol} does not use SASL")
        if self.ssl_cafile is not None:
            _require(self.security_protocol in ("SSL", "SASL_SSL"), "ssl_cafile",
                     f"is set but security_protocol {self.security_protocol} does not use TLS")
            _require(Path(self.ssl_cafile).expanduser().is_file(), "ssl_cafile",
                     f"file {self.ssl_cafile} does not exist")


class TopicsConfig(_Section):
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
            _require(topic not in seen, key, f"topic {topic!r} is already used by {seen.get(topic)}")
            seen[topic] = key

    @property
    def request_topics(self) -> dict[str, str]:
        """Request kind -> topic; a new dict each call."""
        return {"chat": self.chat, "asr": self.asr, "risk": self.risk}


class RedisConfig(_Section):
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
        _require(parts is not None and parts.scheme in ("redis", "rediss", "unix"), "url",
                 "expected a redis://, rediss:// or unix:// url")
        _require(not has_password, "url", "must not contain a password; set redis.password instead")
        _require(self.heartbeat_interval_s < self.index_ttl_s, "heartbeat_interval_s",
                 f"must be below index_ttl_s ({self.index_ttl_s}), or entries expire between refreshes")


class MetricsConfig(_Section):
    """The Prometheus endpoint (/metrics and /healthz). Port 0 picks a free port."""

    host: NonEmptyStr = "0.0.0.0"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 9400
    enabled: bool = True


class LoggingConfig(_Section):
    """structlog output. `log_prompts` puts prompt and answer text into logs; keep it off in production."""

    level: Literal["debug", "info", "warning", "error", "critical"] = "info"
    format: Literal["json", "console"] = "json"
    log_prompts: bool = False


class WorkerConfig(_Section):
    """This process. `id` None means derive one at runtime; see `resolved_id()`."""

    id: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9._:-]{1,200}$")] | None = None
    shutdown_timeout_s: Seconds = 30.0
    max_inflight: PositiveInt = 256
    deadline_check: bool = True

    def resolved_id(self) -> str:
        """The configured id, or hostname-pid; computed on each call, never stored in the config."""
        return self.id or f"{socket.gethostname()}-{os.getpid()}"


class ChatConfig(_Section):
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

    def __post_init__(self) -> None:
        for key in ("tenant_rules", "topic_rules"):
            rules = getattr(self, key)
            for owner, lines in rules.items():
                for rule in lines:
                    # A newline would let one rule smuggle in lines the template never framed.
                    _require(bool(rule.strip()) and "\n" not in rule, key,
                             f"each rule for {owner!r} must be one non-empty line")
            msgspec.structs.force_setattr(self, key, MappingProxyType(dict(rules)))
        try:
            names = jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(self.rules_template))
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError(f"rules_template: not a valid Jinja2 template (line {exc.lineno}: {exc.message})") from None
        _require("rules" in names, "rules_template", "must use the `rules` variable, or rules would be dropped")


class AsrConfig(_Section):
    """Streaming ASR post-correction."""

    gap_timeout_s: Seconds = 5.0
    # causal is the default everywhere; chunk_bidirectional lets a chunk's tokens see each other.
    mask_policy: Literal["causal", "chunk_bidirectional", "prefix_bidirectional", "packed_segments"] = "causal"


class SpeculativeConfig(_Section):
    """Speculative decoding. `method` prompt_lookup drafts up to `k` tokens a step from the request's own
    tokens, matching its last `n` down to `n_min` tokens. ASR requests use it when it is on (their output
    mostly copies the chunk); chat requests only with `chat: true`. It needs synchronous scheduling."""

    method: Literal["prompt_lookup"] | None = None
    k: PositiveInt = 4
    n: PositiveInt = 4
    n_min: PositiveInt = 2
    chat: bool = False

    def __post_init__(self) -> None:
        _require(self.n_min <= self.n, "n_min", f"must be <= n ({self.n}), got {self.n_min}")


class RiskConfig(_Section):
    """Batch risk analysis: the labels a request gets when it names none, and the instruction given to the model."""

    default_labels: tuple[NonEmptyStr, ...] = ("low", "medium", "high")
    instruction: NonEmptyStr = DEFAULT_RISK_INSTRUCTION

    def __post_init__(self) -> None:
        _require(bool(self.default_labels), "default_labels", "must name at least one label")
        _require(len(set(self.default_labels)) == len(self.default_labels), "default_labels",
                 "labels must be unique")


class ServiceConfig(_Section):
    """The whole worker configuration; build it with `load_config`."""

    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    execution: ExecutionConfig = msgspec.field(default_factory=ExecutionConfig)
    memory: MemoryConfig = msgspec.field(default_factory=MemoryConfig)
    quantization: QuantizationConfig = msgspec.field(default_factory=QuantizationConfig)
    kafka: KafkaConfig = msgspec.field(default_factory=KafkaConfig)
    topics: TopicsConfig = msgspec.field(default_factory=TopicsConfig)
    redis: RedisConfig = msgspec.field(default_factory=RedisConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)
    worker: WorkerConfig = msgspec.field(default_factory=WorkerConfig)
    chat: ChatConfig = msgspec.field(default_factory=ChatConfig)
    asr: AsrConfig = msgspec.field(default_factory=AsrConfig)
    risk: RiskConfig = msgspec.field(default_factory=RiskConfig)
    speculative: SpeculativeConfig = msgspec.field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        max_seq_len = self.model.max_seq_len
        if max_seq_len is not None:
            _require(self.chat.default_max_tokens < max_seq_len, "chat.default_max_tokens",
                     f"must be below model.max_seq_len ({max_seq_len}), leaving room for the prompt")
        # Fewer requests in flight than a batch holds means every batch waits out batch_timeout.
        _require(self.worker.max_inflight >= self.execution.max_batch_size, "worker.max_inflight",
                 f"must be >= execution.max_batch_size ({self.execution.max_batch_size})")

    def engine_config(self) -> EngineConfig:
        """The engine's config from the model, execution, memory and quantization sections."""
        # Deferred: the engine pulls in torch, which validating a config does not need.
        from engine.config import EngineConfig
        from engine.errors import RequestError

        model, execution, memory, quant = self.model, self.execution, self.memory, self.quantization
        try:
            return EngineConfig(
                model=model.name,
                dtype=model.dtype,
                device=model.device,
                max_model_len=model.max_seq_len,
                max_num_seqs=execution.max_num_seqs,
                max_num_batched_tokens=execution.max_num_batched_tokens,
                block_size=memory.block_size,
                enable_prefix_caching=memory.enable_prefix_caching,
                kv_cache_memory_bytes=memory.kv_cache_bytes,
                max_cache_ratio=memory.max_cache_ratio,
                cpu_memory_bytes=memory.cpu_memory_bytes,
                kv_cache_policy=memory.kv_cache_policy,
                embedding_offload=memory.embedding_offload,
                activation_chunk_rows=memory.activation_chunk_rows,
                cpu_prepack_weights=memory.cpu_prepack_weights,
                cpu_compact_weights=memory.cpu_compact_weights,
                cpu_free_plain_weights=memory.cpu_free_plain_weights,
                huge_pages=memory.huge_pages,
                weight_bits=quant.weight_bits,
                weight_group_size=quant.weight_group_size,
                calibration_file=(str(Path(quant.calibration_file).expanduser())
                                  if quant.calibration_file else None),
                cache_bits=quant.cache_bits,
                kv_fp_window=quant.kv_fp_window,
                num_threads=execution.num_threads,
                cpu_decode_split_rows=execution.cpu_decode_split_rows,
                cuda_graphs=execution.cuda_graphs,
                async_scheduling=execution.async_scheduling,
                speculative_method=self.speculative.method,
                num_speculative_tokens=self.speculative.k,
                prompt_lookup_max=self.speculative.n,
                prompt_lookup_min=self.speculative.n_min,
            )
        except RequestError as exc:
            raise ConfigError(f"the engine rejected the configuration: {exc}") from None

    def secrets(self) -> dict[str, Secret]:
        """Every secret that is set, by dotted key, so start-up can check each one is readable."""
        found = {"kafka.sasl_password": self.kafka.sasl_password, "redis.password": self.redis.password}
        return {key: secret for key, secret in found.items() if secret is not None}

    def redacted_dict(self) -> dict[str, Any]:
        """Plain dicts, tuples and scalars for logs and `infinilm config show`; secrets read `***`."""
        return msgspec.to_builtins(self, enc_hook=_encode_redacted)


def _encode_redacted(obj: Any) -> Any:
    if isinstance(obj, Secret):
        return MASKED
    if isinstance(obj, MappingProxyType):
        return msgspec.to_builtins(dict(obj), enc_hook=_encode_redacted)
    raise NotImplementedError(type(obj).__name__)


# ---- loading -----------------------------------------------------------------------------------

_SECTIONS: dict[str, type[_Section]] = get_type_hints(ServiceConfig)


@cache
def _fields(cls: type[_Section]) -> dict[str, Any]:
    return get_type_hints(cls, include_extras=True)


def _base(hint: Any) -> tuple[Any, tuple[Any, ...], bool]:
    """(bare type, Annotated metadata, optional) for a field annotation."""
    optional = False
    if get_origin(hint) in (Union, UnionType):
        args = [a for a in get_args(hint) if a is not NoneType]
        optional = len(args) < len(get_args(hint))
        hint = args[0]
    if get_origin(hint) is Annotated:
        return get_args(hint)[0], hint.__metadata__, optional
    return hint, (), optional


def _choices(hint: Any) -> list[str]:
    """The values a field takes by name, as YAML spells them: its Literal's, and true and false where it
    also takes a bool (`bool | Literal["auto"]`)."""
    members = get_args(hint) if get_origin(hint) in (Union, UnionType) else (hint,)
    out: list[str] = []
    for member in members:
        member = get_args(member)[0] if get_origin(member) is Annotated else member
        if member is bool:
            out = ["true", "false", *out]
        elif get_origin(member) is Literal:
            out += [repr(a) for a in get_args(member)]
    return out


def _unit(hint: Any) -> str | None:
    for meta in _base(hint)[1]:
        if isinstance(meta, msgspec.Meta) and meta.extra:
            return meta.extra.get("parse")
    return None


def _is_text(hint: Any) -> bool:
    bare = _base(hint)[0]
    if get_origin(bare) is Literal:
        return all(isinstance(a, str) for a in get_args(bare))
    return bare in (str, Secret)


_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h)", re.IGNORECASE)
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_BYTES = re.compile(r"(\d+(?:\.\d*)?)\s*([KMGT]i?B|B)?", re.IGNORECASE)


def parse_duration(text: str) -> float:
    """'50ms', '2s', '1.5m', '1h' or a bare number -> seconds."""
    match = _DURATION.fullmatch(text.strip())
    if match is not None:
        return float(match[1]) * _DURATION_UNITS[match[2].lower()]
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds):
        raise ValueError(f"expected a duration such as '50ms', '2s', '1.5s' or a number of seconds, got {text!r}")
    return seconds


def parse_bytes(text: str) -> int:
    """'512MiB', '2GiB', '1.5GB', '4096B' or a bare integer -> bytes (KiB = 1024, KB = 1000)."""
    match = _BYTES.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"expected a byte size such as '512MiB', '2GiB' or a number of bytes, got {text!r}")
    unit = (match[2] or "B").upper()
    power = " KMGT".index(unit[0]) if unit != "B" else 0
    size = float(match[1]) * ((1024 if "I" in unit else 1000) ** power)
    if size != int(size):
        raise ValueError(f"expected a whole number of bytes, got {text!r}")
    return int(size)


class _Sources:
    """Names where each key's value came from, for error messages."""

    def __init__(self, label: str, env_keys: dict[tuple[str, str], str]) -> None:
        self.label = label
        self.env_keys = env_keys

    def of(self, keys: list[str]) -> str:
        var = self.env_keys.get(tuple(keys[:2]))  # type: ignore[arg-type]
        if var:
            return f"environment variable {var}"
        # A cross-field error may blame a key that an override elsewhere in the section made wrong.
        nearby = [v for (section, _), v in self.env_keys.items() if keys and section == keys[0]]
        return f"{self.label} (with {', '.join(nearby)})" if nearby else self.label


def _suggest(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown key; {hint}known keys: {', '.join(known)}"


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file ({exc.strerror or exc})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        # Report position and problem only: the snippet PyYAML prints could hold a literal secret.
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{where}: {getattr(exc, 'problem', None) or 'parse error'}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level, got {type(data).__name__}")
    return data


def _apply_env(raw: dict[str, Any], env: Mapping[str, str]) -> dict[tuple[str, str], str]:
    """Merge INFINILM__SECTION__KEY variables into `raw`; returns which variable set which key."""
    used: dict[tuple[str, str], str] = {}
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX):
            continue
        parts = var[len(ENV_PREFIX):].lower().split("__")
        if len(parts) != 2 or not all(parts):
            raise ConfigError(f"environment variable {var}: expected the form {ENV_PREFIX}<SECTION>__<KEY>")
        section, key = parts
        if section not in _SECTIONS:
            raise ConfigError(f"environment variable {var}: {section}: {_suggest(section, list(_SECTIONS))}")
        fields = _fields(_SECTIONS[section])
        value: Any = env[var]
        if key not in fields:
            # FOO_FILE / FOO_ENV point a secret field FOO at a file or at another variable.
            stem, _, kind = key.rpartition("_")
            if kind not in ("file", "env") or _base(fields.get(stem))[0] is not Secret:
                raise ConfigError(f"environment variable {var}: {section}.{key}: {_suggest(key, list(fields))}")
            key, value = stem, {kind: value}
        elif not _is_text(fields[key]):
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError:
                raise ConfigError(f"environment variable {var}: {section}.{key}: not a valid YAML value") from None
        elif value == "" and _base(fields[key])[2]:
            value = None
        if (section, key) in used:
            raise ConfigError(f"environment variables {used[(section, key)]} and {var} both set {section}.{key}")
        used[(section, key)] = var
        target = raw.setdefault(section, {})
        if isinstance(target, dict):  # otherwise msgspec reports the file's bad section
            target[key] = value
    return used


def _parse_units(raw: dict[str, Any], sources: _Sources) -> None:
    for section, values in raw.items():
        if section not in _SECTIONS or not isinstance(values, dict):
            continue
        fields = _fields(_SECTIONS[section])
        for key, value in values.items():
            unit = _unit(fields.get(key)) if key in fields else None
            if unit is None or not isinstance(value, str):
                continue
            try:
                values[key] = parse_duration(value) if unit == "duration" else parse_bytes(value)
            except ValueError as exc:
                raise ConfigError(f"{sources.of([section, key])}: {section}.{key}: {exc}") from None


def _secret_hook(env: Mapping[str, str]):
    def decode(cls: type, obj: Any) -> Any:
        if cls is not Secret:
            raise NotImplementedError(cls)
        if isinstance(obj, str) and obj:
            return Secret(obj)
        if isinstance(obj, dict) and len(obj) == 1:
            ((kind, ref),) = obj.items()
            if kind == "env" and isinstance(ref, str) and ref:
                if not env.get(ref):
                    raise ValueError(f"environment variable {ref} (named by {{env: {ref}}}) is not set or empty")
                return Secret(env[ref])
            if kind == "file" and isinstance(ref, str) and ref:
                path = Path(ref).expanduser()
                if not path.is_file():
                    raise ValueError(f"secret file {path} does not exist")
                return Secret(file=path)
        # Never echo the value: it may be the secret itself.
        raise ValueError("expected {env: VAR_NAME}, {file: /path} or a non-empty string")

    return decode


_MSGSPEC_ERROR = re.compile(r"(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?", re.DOTALL)


def _describe(message: str, sources: _Sources) -> str:
    """Rewrite a msgspec error as 'source: dotted.key: what was expected'."""
    match = _MSGSPEC_ERROR.fullmatch(message)
    what, path = match["what"], (match["path"] or "").lstrip(".")  # type: ignore[index]
    keys = re.findall(r"^\w+|(?<=\.)\w+", path)[:2]
    if unknown := re.fullmatch(r"Object contains unknown field `(.*)`", what):
        cls = _SECTIONS.get(keys[0]) if keys else ServiceConfig
        path = f"{path}.{unknown[1]}" if path else unknown[1]
        what = _suggest(unknown[1], list(_fields(cls) if cls else ()))
    elif own := re.fullmatch(r"([a-z_][a-z0-9_.]*): (.*)", what, re.DOTALL):
        path = f"{path}.{own[1]}" if path else own[1]
        keys = path.split(".")[:2]
        what = own[2]
    elif what.startswith("Invalid enum value") and len(keys) == 2:
        choices = _choices(_fields(_SECTIONS[keys[0]]).get(keys[1]))
        what = f"expected one of {', '.join(choices)}; got {what.removeprefix('Invalid enum value ')}"
    else:
        what = what[:1].lower() + what[1:]
    return f"{sources.of(keys)}: {path or '(top level)'}: {what}"


def load_config(path: str | Path | None, env: Mapping[str, str] = os.environ) -> ServiceConfig:
    """Read `path` (None: defaults only), apply INFINILM__SECTION__KEY overrides from `env`, validate.

    Override keys are case-insensitive; values are parsed as YAML (`8`, `true`,
    `[a, b]`) except for text fields, which keep the string as given (empty
    means None where None is allowed). A secret field FOO can also be set with
    FOO_FILE=/path or FOO_ENV=VAR. Raises ConfigError on any problem.
    """
    raw = _read_yaml(Path(path)) if path is not None else {}
    # An emptied section (all keys commented out) reads as null; treat it as "all defaults".
    raw = {key: {} if value is None else value for key, value in raw.items()}
    sources = _Sources(str(path) if path is not None else "(defaults)", _apply_env(raw, env))
    _parse_units(raw, sources)
    try:
        return msgspec.convert(raw, ServiceConfig, dec_hook=_secret_hook(env))
    except msgspec.ValidationError as exc:
        raise ConfigError(_describe(str(exc), sources)) from None
