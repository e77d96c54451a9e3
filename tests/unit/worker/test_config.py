"""The worker config: defaults, the example file, env overrides, clear errors, secrets, the engine mapping."""

from __future__ import annotations

import os
from pathlib import Path
from typing import get_args, get_type_hints

import jinja2
import msgspec
import pytest
import typer
import yaml
from typer.testing import CliRunner

from cli.config import register
from engine.settings import ModelSettings
from worker.config import ServiceConfig, load_config, parse_bytes, parse_duration
from worker.config_sections import DEFAULT_RULES_TEMPLATE, AsrConfig
from worker.config_types import ConfigError, Secret

EXAMPLE = Path(__file__).resolve().parents[3] / "config.yaml"
PASSWORD = "s3cr3t-Hunter2"
SASL = {
    "INFINILM__KAFKA__SECURITY_PROTOCOL": "SASL_SSL",
    "INFINILM__KAFKA__SASL_MECHANISM": "SCRAM-SHA-512",
    "INFINILM__KAFKA__SASL_USERNAME": "worker",
}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def error_of(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), env=env or {})
    return str(info.value)


# ---- defaults and the example file ---------------------------------------------------------------


def test_defaults_are_the_seed_values():
    config = load_config(None, env={})
    assert config == ServiceConfig()
    assert config.execution.batch_timeout == 0.05
    assert config.execution.max_batch_size == 16
    assert config.memory.kv_cache_policy == "lru"
    assert config.memory.max_cache_ratio == 0.4
    assert (config.quantization.weight_bits, config.quantization.cache_bits) == (16, 16)
    assert config.topics.request_topics == {
        "chat": "infinilm.requests.chat",
        "asr": "infinilm.requests.asr",
        "risk": "infinilm.requests.risk",
    }


def test_example_file_loads_and_matches_the_defaults():
    assert load_config(EXAMPLE, env={}) == ServiceConfig()


def test_example_file_documents_every_key():
    raw = yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))
    sections = msgspec.structs.asdict(ServiceConfig())
    assert list(raw) == list(sections)
    for name, section in sections.items():
        assert list(raw[name]) == list(msgspec.structs.asdict(section)), name


def test_empty_file_and_empty_sections_mean_defaults(tmp_path):
    assert load_config(write(tmp_path, "# nothing yet\n"), env={}) == ServiceConfig()
    assert load_config(write(tmp_path, "kafka:\nredis:\n"), env={}) == ServiceConfig()


def test_literal_choices_match_the_engine():
    from engine.config import DTYPES, MASK_POLICIES

    assert get_args(get_type_hints(ModelSettings)["dtype"]) == ("auto", *DTYPES)
    assert get_args(get_type_hints(AsrConfig)["mask_policy"]) == MASK_POLICIES


# ---- env overrides ---------------------------------------------------------------------------------


def test_env_overrides_are_nested_typed_and_case_insensitive(tmp_path):
    env = {
        "INFINILM__EXECUTION__MAX_BATCH_SIZE": "32",
        "infinilm__Execution__Batch_Timeout": "2s",  # prefix must be upper case: ignored
        "INFINILM__execution__deterministic": "true",
        "INFINILM__Memory__Max_Cache_Ratio": "0.25",
        "INFINILM__RISK__DEFAULT_LABELS": "[ok, fraud]",
        "INFINILM__CHAT__TENANT_RULES": "{acme: [Be polite.]}",
        "INFINILM__KAFKA__GROUP_ID": "007",  # text fields keep the string as given
        "INFINILM__MODEL__MAX_SEQ_LEN": "4096",
        "INFINILM_CACHE_DIR": "/elsewhere",  # one underscore: not a config override
        "PATH": os.environ.get("PATH", ""),
    }
    config = load_config(write(tmp_path, "execution:\n  max_batch_size: 8\n"), env=env)
    assert config.execution.max_batch_size == 32
    assert config.execution.batch_timeout == 0.05
    assert config.execution.deterministic is True
    assert config.memory.max_cache_ratio == 0.25
    assert config.risk.default_labels == ("ok", "fraud")
    assert dict(config.chat.tenant_rules) == {"acme": ("Be polite.",)}
    assert config.kafka.group_id == "007"
    assert config.model.max_seq_len == 4096


def test_empty_env_value_unsets_an_optional_text_field(tmp_path):
    path = write(tmp_path, "worker:\n  id: worker-a\n")
    assert load_config(path, env={}).worker.id == "worker-a"
    assert load_config(path, env={"INFINILM__WORKER__ID": ""}).worker.id is None


@pytest.mark.parametrize(
    ("var", "fragment"),
    [
        ("INFINILM__EXECUTION__MAX_BATCH_SIZ", "execution.max_batch_siz: unknown key; did you mean 'max_batch_size'"),
        ("INFINILM__EXECUTON__MAX_BATCH_SIZE", "executon: unknown key; did you mean 'execution'"),
        ("INFINILM__KAFKA", "expected the form INFINILM__<SECTION>__<KEY>"),
        ("INFINILM__KAFKA__SASL__PASSWORD", "expected the form"),
        ("INFINILM__KAFKA__GROUP_ID_FILE", "kafka.group_id_file: unknown key"),
    ],
)
def test_unknown_env_keys_are_errors(var, fragment):
    with pytest.raises(ConfigError, match=f"environment variable {var}") as info:
        load_config(None, env={var: "1"})
    assert fragment in str(info.value)


def test_bad_env_value_names_the_variable():
    with pytest.raises(ConfigError) as info:
        load_config(None, env={"INFINILM__EXECUTION__MAX_BATCH_SIZE": "many"})
    assert str(info.value) == (
        "environment variable INFINILM__EXECUTION__MAX_BATCH_SIZE: execution.max_batch_size: "
        "expected `int`, got `str`"
    )


def test_two_variables_for_one_key_conflict():
    env = {"INFINILM__KAFKA__GROUP_ID": "a", "INFINILM__kafka__group_id": "b"}
    with pytest.raises(ConfigError, match=r"both set kafka\.group_id"):
        load_config(None, env=env)


# ---- errors in the file ----------------------------------------------------------------------------


def test_unknown_key_in_file_names_file_path_and_suggestion(tmp_path):
    message = error_of(tmp_path, "execution:\n  max_batch_sise: 8\n")
    assert message.startswith(f"{tmp_path / 'config.yaml'}: execution.max_batch_sise: unknown key; ")
    assert "did you mean 'max_batch_size'?" in message


def test_unknown_section_in_file(tmp_path):
    message = error_of(tmp_path, "exection:\n  max_batch_size: 8\n")
    assert ": exection: unknown key; did you mean 'execution'?" in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("execution:\n  max_batch_size: '16'\n", "execution.max_batch_size: expected `int`, got `str`"),
        ("execution:\n  max_batch_size: 0\n", "execution.max_batch_size: expected `int` >= 1"),
        ("execution:\n  max_batch_size: 128\n", "execution.max_batch_size: must be <= max_num_seqs (64)"),
        ("execution:\n  batch_timeout: 0\n", "execution.batch_timeout: expected `float` > 0.0"),
        ("execution:\n  batcher: lifo\n", "execution.batcher: expected one of 'dynamic_bucket', 'fifo', 'direct'; got 'lifo'"),
        ("quantization:\n  weight_bits: 3\n", "quantization.weight_bits: expected one of 16, 8, 4; got 3"),
        ("quantization:\n  cache_bits: 4\n", "quantization.cache_bits: expected one of 16, 8; got 4"),
        ("memory:\n  max_cache_ratio: 1.5\n", "memory.max_cache_ratio: expected `float` <= 1.0"),
        ("memory:\n  block_size: 12\n", "memory.block_size: must be a power of two"),
        ("memory:\n  kv_cache_policy: fifo\n", "memory.kv_cache_policy: expected one of 'lru'"),
        ("memory:\n  cpu_prepack_weights: sometimes\n",
         "memory.cpu_prepack_weights: expected one of true, false, 'auto'; got 'sometimes'"),
        ("model:\n  device: tpu\n", "model.device: expected 'auto', 'cpu', 'cuda' or 'cuda:N'"),
        ("kafka:\n  heartbeat_interval_ms: 4000\n", "kafka.heartbeat_interval_ms: must be below session_timeout_ms / 3"),
        ("kafka:\n  flush_interval_ms: 70000\n", "kafka.flush_interval_ms: must be below transaction_timeout_ms"),
        ("kafka:\n  bootstrap_servers: kafka\n", "kafka.bootstrap_servers: expected comma-separated host:port"),
        ("kafka:\n  security_protocol: SASL_SSL\n", "kafka.sasl_mechanism: is required when security_protocol is SASL_SSL"),
        ("kafka:\n  sasl_username: bob\n", "kafka.sasl_username: is set but security_protocol PLAINTEXT"),
        ("kafka:\n  delivery: at_most_once\n", "kafka.delivery: expected one of 'exactly_once', 'at_least_once'"),
        ("topics:\n  dlq: infinilm.results\n", "topics.dlq: topic 'infinilm.results' is already used by results"),
        ("topics:\n  chat: 'bad topic'\n", "topics.chat: expected `str` matching regex"),
        ("redis:\n  url: http://x\n", "redis.url: expected a redis://, rediss:// or unix:// url"),
        ("redis:\n  heartbeat_interval_s: 10m\n", "redis.heartbeat_interval_s: must be below index_ttl_s"),
        ("metrics:\n  port: 70000\n", "metrics.port: expected `int` <= 65535"),
        ("chat:\n  tenant_rules: {acme: [\"a\\nb\"]}\n", "chat.tenant_rules: each rule for 'acme' must be one non-empty line"),
        ("chat:\n  rules_template: 'no rules here'\n", "chat.rules_template: must use the `rules` variable"),
        ("chat:\n  rules_template: '{% for %}'\n", "chat.rules_template: not a valid Jinja2 template"),
        ("risk:\n  default_labels: [a, a]\n", "risk.default_labels: labels must be unique"),
        ("model:\n  max_seq_len: 256\n", "chat.default_max_tokens: must be below model.max_seq_len (256)"),
        ("worker:\n  max_inflight: 4\n", "worker.max_inflight: must be >= execution.max_batch_size (16)"),
        ("worker:\n  stall_resync_s: 2\n", "worker.stall_resync_s: must be at least 5 s"),
        ("execution: [1, 2]\n", "execution: expected `object`, got `array`"),
        ("- just\n- a list\n", "expected a mapping of sections at the top level, got list"),
    ],
)
def test_bad_values_name_file_key_and_expectation(tmp_path, text, expected):
    message = error_of(tmp_path, text)
    assert message.startswith(str(tmp_path / "config.yaml")), message
    assert expected in message, message


def test_cross_field_error_mentions_the_override_that_caused_it():
    with pytest.raises(ConfigError) as info:
        load_config(None, env={"INFINILM__KAFKA__SECURITY_PROTOCOL": "SASL_SSL"})
    assert "(with INFINILM__KAFKA__SECURITY_PROTOCOL): kafka.sasl_mechanism" in str(info.value)


def test_missing_file_and_invalid_yaml(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load_config(tmp_path / "absent.yaml", env={})
    message = error_of(tmp_path, f"kafka:\n  sasl_password: {PASSWORD}\n  group_id: [unclosed\n")
    assert "not valid YAML at line 4" in message
    assert PASSWORD not in message


# ---- durations and byte sizes ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("50ms", 0.05), ("2s", 2.0), ("1.5s", 1.5), ("1.5m", 90.0), ("1h", 3600.0), ("0.25", 0.25), (" 10 MS ", 0.01)],
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["fast", "1d", "ms", "-1s", "1.5 seconds", "inf", "nan"])
def test_bad_durations_in_config(tmp_path, text):
    message = error_of(tmp_path, f"execution:\n  batch_timeout: '{text}'\n")
    assert "execution.batch_timeout: expected a duration such as '50ms'" in message


def test_durations_in_config(tmp_path):
    text = "execution:\n  batch_timeout: 2\nredis:\n  stream_state_ttl_s: 1h\nasr:\n  gap_timeout_s: 1.5s\n"
    config = load_config(write(tmp_path, text), env={})
    assert (config.execution.batch_timeout, config.redis.stream_state_ttl_s, config.asr.gap_timeout_s) == (2.0, 3600.0, 1.5)
    assert isinstance(config.execution.batch_timeout, float)


@pytest.mark.parametrize(
    ("text", "size"),
    [("2GiB", 2 << 30), ("512MiB", 512 << 20), ("1kib", 1024), ("1GB", 10**9), ("4096", 4096), ("1.5KiB", 1536)],
)
def test_parse_bytes(text, size):
    assert parse_bytes(text) == size


def test_byte_sizes_in_config(tmp_path):
    config = load_config(write(tmp_path, "memory:\n  kv_cache_bytes: 2GiB\nkafka:\n  max_message_bytes: 4MiB\n"), env={})
    assert config.memory.kv_cache_bytes == 2 << 30
    assert config.kafka.max_message_bytes == 4 << 20
    assert "memory.kv_cache_bytes: expected a byte size" in error_of(tmp_path, "memory:\n  kv_cache_bytes: 2G\n")
    assert "expected a whole number of bytes" in error_of(tmp_path, "memory:\n  kv_cache_bytes: 1.5B\n")


# ---- secrets ---------------------------------------------------------------------------------------------


def sasl_config(tmp_path: Path, password_yaml: str, env: dict[str, str] | None = None) -> ServiceConfig:
    return load_config(write(tmp_path, f"kafka:\n  sasl_password: {password_yaml}\n"), env={**SASL, **(env or {})})


def test_secret_from_file_is_read_on_get(tmp_path):
    secret_file = tmp_path / "kafka_password"
    secret_file.write_text(PASSWORD + "\n")
    config = sasl_config(tmp_path, f"{{file: {secret_file}}}")
    assert config.kafka.sasl_password.get() == PASSWORD
    secret_file.write_text("rotated\n")
    assert config.kafka.sasl_password.get() == "rotated"
    secret_file.unlink()
    with pytest.raises(ConfigError, match=r"cannot read secret file .*kafka_password"):
        config.kafka.sasl_password.get()


def test_secret_from_env_uses_the_given_mapping(tmp_path):
    config = sasl_config(tmp_path, "{env: KAFKA_PASSWORD}", env={"KAFKA_PASSWORD": PASSWORD})
    assert config.kafka.sasl_password.get() == PASSWORD
    assert config.secrets() == {"kafka.sasl_password": Secret(PASSWORD)}
    message = error_of(tmp_path, "kafka:\n  sasl_password: {env: KAFKA_PASSWORD}\n", env=SASL)
    assert "kafka.sasl_password: environment variable KAFKA_PASSWORD" in message
    assert "is not set or empty" in message


def test_secret_overrides_from_env(tmp_path):
    secret_file = tmp_path / "pw"
    secret_file.write_text(PASSWORD)
    by_file = load_config(None, env={**SASL, "INFINILM__KAFKA__SASL_PASSWORD_FILE": str(secret_file)})
    by_var = load_config(None, env={**SASL, "INFINILM__KAFKA__SASL_PASSWORD_ENV": "PW", "PW": PASSWORD})
    literal = load_config(None, env={**SASL, "INFINILM__KAFKA__SASL_PASSWORD": "12345"})
    assert by_file.kafka.sasl_password.get() == by_var.kafka.sasl_password.get() == PASSWORD
    assert literal.kafka.sasl_password.get() == "12345"  # text fields are not YAML-parsed
    redis = load_config(None, env={"INFINILM__REDIS__PASSWORD_ENV": "PW", "PW": PASSWORD})
    assert redis.redis.password.get() == PASSWORD
    both = {**SASL, "INFINILM__KAFKA__SASL_PASSWORD": "x", "INFINILM__KAFKA__SASL_PASSWORD_FILE": str(secret_file)}
    with pytest.raises(ConfigError, match=r"both set kafka\.sasl_password"):
        load_config(None, env=both)


def test_secret_never_shows(tmp_path):
    config = sasl_config(tmp_path, PASSWORD)
    secret = config.kafka.sasl_password
    assert repr(secret) == str(secret) == f"{secret}" == "***"
    assert PASSWORD not in repr(config)
    shown = config.redacted_dict()
    assert shown["kafka"]["sasl_password"] == "***"
    assert PASSWORD not in yaml.safe_dump(shown, allow_unicode=True)


@pytest.mark.parametrize(
    "password_yaml",
    ["12345", "''", "{file: /no/such/file}", "{vault: x}", "{env: A, file: B}", "[12345]"],
)
def test_bad_secret_errors_never_echo_the_value(tmp_path, password_yaml):
    message = error_of(tmp_path, f"kafka:\n  sasl_password: {password_yaml}\n", env=SASL)
    assert "kafka.sasl_password:" in message
    assert "12345" not in message


def test_errors_elsewhere_do_not_echo_secrets(tmp_path):
    message = error_of(tmp_path, f"kafka:\n  sasl_password: {PASSWORD}\n  group_id: 5\n", env=SASL)
    assert "kafka.group_id" in message and PASSWORD not in message
    message = error_of(tmp_path, f"redis:\n  url: 'redis://:{PASSWORD}@cache:6379/0'\n")
    assert "redis.url: must not contain a password" in message and PASSWORD not in message


# ---- engine mapping, runtime values, frozenness ------------------------------------------------------------


def test_engine_config_mapping(tmp_path):
    from engine.config import EngineConfig

    assert load_config(None, env={}).engine_config() == EngineConfig(max_cache_ratio=0.4)
    text = (
        "model: {name: /models/qwen, dtype: bfloat16, device: 'cuda:1', max_seq_len: 8192}\n"
        "execution: {max_num_seqs: 32, max_num_batched_tokens: 4096, num_threads: 4, cuda_graphs: false,"
        " async_scheduling: true}\n"
        "memory: {block_size: 32, enable_prefix_caching: false, kv_cache_bytes: 1GiB, max_cache_ratio: 0.5}\n"
        "quantization: {weight_bits: 8, cache_bits: 8}\n"
    )
    engine = load_config(write(tmp_path, text), env={}).engine_config()
    assert engine == EngineConfig(
        model="/models/qwen", dtype="bfloat16", device="cuda:1", max_model_len=8192, max_num_seqs=32,
        max_num_batched_tokens=4096, block_size=32, enable_prefix_caching=False, kv_cache_memory_bytes=1 << 30,
        max_cache_ratio=0.5, kv_cache_policy="lru", weight_bits=8, cache_bits=8, num_threads=4,
        cuda_graphs=False, async_scheduling=True,
    )
    for value in (True, False, "auto"):  # a bool or the string auto, as YAML and environment variables give them
        text = f"memory: {{cpu_prepack_weights: {str(value).lower()}}}\n"
        assert load_config(write(tmp_path, text), env={}).engine_config().cpu_prepack_weights == value
        env = {"INFINILM__MEMORY__CPU_PREPACK_WEIGHTS": str(value).lower()}
        assert load_config(None, env=env).engine_config().cpu_prepack_weights == value
    assert load_config(None, env={}).engine_config().huge_pages == "auto"
    for value in (True, False, "auto"):
        text = f"memory: {{huge_pages: {str(value).lower()}}}\n"
        assert load_config(write(tmp_path, text), env={}).engine_config().huge_pages == value
        env = {"INFINILM__MEMORY__HUGE_PAGES": str(value).lower()}
        assert load_config(None, env=env).engine_config().huge_pages == value
    with pytest.raises(ConfigError, match="huge_pages"):
        load_config(write(tmp_path, "memory: {huge_pages: sometimes}\n"), env={})
    assert load_config(None, env={}).engine_config().cpu_decode_split_rows == "auto"
    for value in (24, "auto"):
        text = f"execution: {{cpu_decode_split_rows: {value}}}\n"
        assert load_config(write(tmp_path, text), env={}).engine_config().cpu_decode_split_rows == value
        env = {"INFINILM__EXECUTION__CPU_DECODE_SPLIT_ROWS": str(value)}
        assert load_config(None, env=env).engine_config().cpu_decode_split_rows == value
    for bad in ("0", "sometimes"):
        with pytest.raises(ConfigError, match="cpu_decode_split_rows"):
            load_config(write(tmp_path, f"execution: {{cpu_decode_split_rows: {bad}}}\n"), env={})


def test_engine_reads_the_service_sections_themselves(tmp_path):
    from engine.config import ENGINE_NAMES, RENAMED, EngineConfig

    text = "model: {name: /models/qwen, max_seq_len: 512}\nmemory: {kv_cache_bytes: 64MiB, block_size: 32}\n"
    config = load_config(write(tmp_path, text), env={})
    engine = config.engine_config()
    for name, (group, key) in ENGINE_NAMES.items():
        if group != "options":  # engine-only settings have no config.yaml key
            assert getattr(engine, name) == getattr(getattr(config, group), key), name
    assert (engine.model, engine.max_model_len, engine.kv_cache_memory_bytes) == ("/models/qwen", 512, 64 << 20)
    assert set(RENAMED) <= set(ENGINE_NAMES)
    # The same settings from keyword options, as the offline API takes them, make an equal config.
    assert engine == EngineConfig(model="/models/qwen", max_model_len=512, kv_cache_memory_bytes=64 << 20,
                                  block_size=32)
    with pytest.raises(AttributeError):
        engine.block_size = 16  # type: ignore[misc]


def test_worker_id_is_derived_not_stored():
    config = load_config(None, env={})
    assert config.worker.id is None
    assert config.worker.resolved_id().endswith(f"-{os.getpid()}")
    assert config.worker.id is None
    assert load_config(None, env={"INFINILM__WORKER__ID": "w-1"}).worker.resolved_id() == "w-1"


def test_config_is_frozen():
    config = load_config(None, env={"INFINILM__CHAT__TOPIC_RULES": "{t: [x]}"})
    with pytest.raises(AttributeError):
        config.execution.max_batch_size = 1  # type: ignore[misc]
    with pytest.raises(AttributeError):
        config.kafka = None  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.chat.topic_rules["t"] = ("y",)  # type: ignore[index]
    config.topics.request_topics["chat"] = "elsewhere"
    assert config.topics.chat == "infinilm.requests.chat"


def test_default_rules_template_writes_one_must_obey_line_per_rule():
    rendered = jinja2.Environment().from_string(DEFAULT_RULES_TEMPLATE).render(rules=["不得承诺退款时限", "Be polite."])
    assert rendered.splitlines() == ["##必须遵守: 不得承诺退款时限", "##必须遵守: Be polite."]


# ---- CLI ----------------------------------------------------------------------------------------------------


@pytest.fixture
def cli(monkeypatch):
    for var in [v for v in os.environ if v.startswith("INFINILM__")]:
        monkeypatch.delenv(var)
    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)  # a second command keeps `config` a named group
    runner = CliRunner()
    return lambda *args, env=None: runner.invoke(app, ["config", *args], env=env)


def test_cli_check(cli, tmp_path):
    ok = cli("check", str(EXAMPLE))
    assert ok.exit_code == 0 and ok.output.startswith("OK: ")
    bad = cli("check", str(write(tmp_path, "execution:\n  max_batch_sise: 8\n")))
    assert bad.exit_code == 1
    assert "execution.max_batch_sise: unknown key" in bad.output


def test_cli_show_masks_secrets(cli, tmp_path):
    result = cli("show", env={**SASL, "INFINILM__KAFKA__SASL_PASSWORD": PASSWORD})
    assert result.exit_code == 0, result.output
    shown = yaml.safe_load(result.output)
    assert shown["kafka"]["sasl_password"] == "***"
    assert shown["execution"]["batch_timeout"] == 0.05
    assert PASSWORD not in result.output


def test_producers_get_the_configured_retry_backoff_and_record_size_and_consumers_keep_the_defaults(tmp_path):
    from worker.kafka_clients import client_kwargs, producer_kwargs

    default = load_config(None, env={}).kafka
    assert (producer_kwargs(default)["retry_backoff_ms"], producer_kwargs(default)["max_request_size"]) == (20, 1 << 20)
    cfg = load_config(write(tmp_path, "kafka:\n  producer_retry_backoff_ms: 45\n  max_message_bytes: 64KiB\n"),
                      env={}).kafka
    produced = producer_kwargs(cfg, client_id="w1")
    assert produced == {**client_kwargs(cfg, client_id="w1"), "retry_backoff_ms": 45, "max_request_size": 65536}
    assert "retry_backoff_ms" not in client_kwargs(cfg) and "max_request_size" not in client_kwargs(cfg)
    assert "producer_retry_backoff_ms" in error_of(tmp_path, "kafka:\n  producer_retry_backoff_ms: 0\n")
    assert "max_message_bytes: must be at least 16KiB, got 8192" in error_of(
        tmp_path, "kafka:\n  max_message_bytes: 8KiB\n")
