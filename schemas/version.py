"""The schema version written into every record (see the package docstring)."""

from __future__ import annotations

import msgspec

SCHEMA_VERSION = 1


def _current_version() -> int:
    return SCHEMA_VERSION


def version_field() -> int:
    """The `v` field of every wire type: defaults to SCHEMA_VERSION, always encoded.

    NOTE: a plain `v: int = 1` would be dropped by `omit_defaults`, and a record
    must always say its version. msgspec only omits default_factory fields whose
    factory is a builtin collection, so this factory keeps `v` on the wire.
    """
    return msgspec.field(default_factory=_current_version)


def always_written(default: object):
    """A field that `omit_defaults` still writes when it holds `default` (see version_field's note).

    For the keys a client may read on every record: a JSON reader must find `status`, never infer it.
    """
    return msgspec.field(default_factory=lambda: default)
