"""The worker's one typed, frozen configuration.

It is read once at start-up from a YAML file, overridden by environment
variables (`INFINILM__SECTION__KEY=value`), validated, and then passed whole.
Nothing mutates it: values found at runtime (the worker id, how many KV blocks
fit) live in their own objects. The engine's sections are engine/settings.py's
groups, embedded as they are; the worker's own are in worker/config_sections.py.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from types import MappingProxyType, NoneType, UnionType
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

import msgspec
import yaml

from engine.settings import MemorySettings, ModelSettings, ParallelSettings, QuantizationSettings, Settings
from worker.config_sections import (
    AsrConfig,
    ChatConfig,
    ExecutionConfig,
    KafkaConfig,
    LoggingConfig,
    MetricsConfig,
    RedisConfig,
    RiskConfig,
    SpeculativeConfig,
    TopicsConfig,
    WorkerConfig,
)
from worker.config_types import MASKED, ConfigError, Secret, require

if TYPE_CHECKING:
    from engine.config import EngineConfig

ENV_PREFIX = "INFINILM__"


class ServiceConfig(Settings):
    """The whole worker configuration; build it with `load_config`."""

    model: ModelSettings = msgspec.field(default_factory=ModelSettings)
    execution: ExecutionConfig = msgspec.field(default_factory=ExecutionConfig)
    memory: MemorySettings = msgspec.field(default_factory=MemorySettings)
    quantization: QuantizationSettings = msgspec.field(default_factory=QuantizationSettings)
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
    parallel: ParallelSettings = msgspec.field(default_factory=ParallelSettings)

    def __post_init__(self) -> None:
        max_seq_len = self.model.max_seq_len
        if max_seq_len is not None:
            require(self.chat.default_max_tokens < max_seq_len, "chat.default_max_tokens",
                    f"must be below model.max_seq_len ({max_seq_len}), leaving room for the prompt")
        # Fewer requests in flight than a batch holds means every batch waits out batch_timeout.
        require(self.worker.max_inflight >= self.execution.max_batch_size, "worker.max_inflight",
                f"must be >= execution.max_batch_size ({self.execution.max_batch_size})")

    def engine_config(self) -> EngineConfig:
        """The engine's config: its model, execution, memory and quantization sections, as loaded."""
        # Deferred: the engine pulls in torch, which validating a config does not need.
        from engine.config import EngineConfig
        from engine.errors import RequestError

        try:
            return EngineConfig.from_groups(model=self.model, execution=self.execution, memory=self.memory,
                                            quantization=self.quantization, speculative=self.speculative,
                                            parallel=self.parallel)
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

_SECTIONS: dict[str, type[Settings]] = get_type_hints(ServiceConfig)


@cache
def _fields(cls: type[Settings]) -> dict[str, Any]:
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
            return meta.extra.get("unit")
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
                values[key] = parse_duration(value) if unit == "seconds" else parse_bytes(value)
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
