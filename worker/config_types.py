"""What every worker config section shares: the error type, secrets and unit-tagged field types."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec

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


# Units are parsed before msgspec sees the data, so the fields hold plain floats and ints;
# the Meta `extra["unit"]` tag is how the loader finds them (engine.settings.Bytes carries one too).
Seconds = Annotated[float, msgspec.Meta(gt=0, extra={"unit": "seconds"})]
# Kafka's legal topic names.
TopicName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9._-]{1,249}$")]


def require(ok: bool, key: str, message: str) -> None:
    """Raise ConfigError("key: message") unless ok; load_config turns the key into a dotted path."""
    if not ok:
        raise ConfigError(f"{key}: {message}")
